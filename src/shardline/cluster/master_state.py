"""The master as a pure fold: `apply(state, event) -> (state, effects)`.

Like cluster/state.py and controller/state.py, this holds no thread, lock, clock or socket. The node loop
thread is the only one that feeds it (cluster/master.py is the shell): queries that arrived on the master's
queryable, updates from its instance controllers, and one Seen per loop step carrying a snapshot of the
node's ClusterState. The effects it returns are commands the shell carries out: publish a view, reply to a
query, start or stop an instance controller, fault a generation, log cluster events.

Layouts (where the runners of a new generation go) are cluster/layouts.py's, pure functions of this state;
the shell calls them from a controller's thread with the newest (immutable) state.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shardline.cluster import downloads, facts
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.layouts import arranged, holds_stages
from shardline.cluster.placement import PlacementError, place

VIEW_PERIOD_S = 0.5
EVENTS_IN_VIEW = 50
MAX_ANSWERED = 1024  # query nonces remembered for retries (oldest forgotten first)


# ---- what the master is given --------------------------------------------------------------------------


@dataclass(frozen=True)
class MasterConfig:
    me: str  # the master's node id
    namespace: str = "shardline"
    report_s: float = 0.5  # the node report period: a new master rebuilds after two
    threads: int = 0  # per runner; 0: each node's cores over the runners it holds (layouts.runner_threads)
    spec_fields: Mapping[str, Any] = field(default_factory=dict)  # RunnerSpec fields the settings decide


@dataclass(frozen=True)
class Snapshot:
    """The cluster as the node knew it at one loop step (a ClusterState is immutable: held as is)."""

    now: float  # monotonic
    wall: float
    cluster: cs.ClusterState


def snapshot(state: cs.ClusterState, now: float, wall: float) -> Snapshot:
    return Snapshot(now, wall, state)


# ---- events --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """The cluster as the node saw it at one loop step; changed: the step saw membership change."""

    snapshot: Snapshot
    changed: bool = False


@dataclass(frozen=True)
class QueryIn:
    """A query on the master's key. qid names the pending zenoh query (the shell holds it); salt and at
    are what a new instance's id and creation time are made of (drawn by the shell: this module is pure)."""

    qid: int
    query: cm.Place | cm.Remove
    salt: str = ""
    at: float = 0.0  # wall clock


@dataclass(frozen=True)
class Laid:
    """A controller laid out a new generation of an instance over these stages."""

    instance: str
    generation: int
    stages: tuple[cm.StageRecord, ...]
    digest: str = ""  # the model digest it launched with (a record from before digests gets one here)
    layout: str = ""  # pipeline or groups, and why


@dataclass(frozen=True)
class StageInfo:
    phase: str = "placed"
    pid: int | None = None
    weights_done: int = 0
    weights_total: int = 0
    path: str = ""  # the runner's compute path, once it is ready (dataplane Ready.path)


@dataclass(frozen=True)
class InstanceUpdate:
    """A controller's state changed (phase, generation, stages' progress): a copy taken in its thread."""

    instance: str
    generation: int
    controller_phase: str
    stages: tuple[StageInfo, ...]
    failures: int
    failure: str  # why it gave up ("" while it has not)
    last_failure: str  # the newest failure's reason ("" without one)
    kv_bytes_per_token: int
    at: float = 0.0  # wall clock


Event = Seen | QueryIn | Laid | InstanceUpdate


# ---- effects -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishView:
    view: cm.ClusterView


@dataclass(frozen=True)
class Reply:
    qid: int
    reply: cm.MasterReply


@dataclass(frozen=True)
class StartInstance:
    """Start an instance controller: adopt the generation that serves, or launch the next one."""

    record: cm.InstanceRecord
    adopt: bool
    lost: tuple[int, ...] = ()  # stages lost with the old master: a failure to record first
    attn_keys: int = 6 * 1024


@dataclass(frozen=True)
class StopInstance:
    instance: str


@dataclass(frozen=True)
class FaultGeneration:
    """Fault a generation whose stages sit on nodes that left (the controller rebuilds it)."""

    instance: str
    generation: int
    why: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Log:
    event: cm.ClusterEvent


Effect = PublishView | Reply | StartInstance | StopInstance | FaultGeneration | Log


# ---- the state -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MasterState:
    config: MasterConfig
    term: int
    started: float  # monotonic, when the role began
    snapshot: Snapshot
    # The newest records anyone holds, from the first view on: runners are fenced by what the view lists,
    # so a new master must never publish a view that forgets a live instance.
    records: Mapping[str, cm.InstanceRecord] = field(default_factory=dict)
    running: frozenset[str] = frozenset()  # instances with a controller
    answered: Mapping[str, cm.MasterReply] = field(default_factory=dict)  # nonce -> reply, oldest first
    paused: Mapping[str, float] = field(default_factory=dict)  # instance -> when it stopped serving (wall)
    rebuilt: bool = False
    dirty: bool = False
    last_view: float = -1e9
    seq: int = 0  # views published by this master
    downloads: Mapping[str, cm.Download] = field(default_factory=dict)  # model -> who downloads it


def initial(config: MasterConfig, term: int, snap: Snapshot) -> MasterState:
    records = {r.instance: r for r in snap.cluster.instances() if r.phase != "failed"}
    last = snap.cluster.view
    downloads = {d.model: d for d in last.downloads} if last is not None else {}  # the nodes keep going
    return MasterState(
        config=config, term=term, started=snap.now, snapshot=snap, records=records, downloads=downloads
    )


def apply(state: MasterState, event: Event) -> tuple[MasterState, list[Effect]]:
    if isinstance(event, Seen):
        return _seen(state, event)
    if isinstance(event, QueryIn):
        return _query(state, event)
    if isinstance(event, Laid):
        rec = state.records.get(event.instance)
        if rec is None or event.instance not in state.running:
            return state, []
        new = rec.model_copy(
            update={
                "stages": list(event.stages),
                "generation": event.generation,
                "phase": "placed",
                "digest": event.digest or rec.digest,
                "layout": event.layout or rec.layout,
            }
        )
        return replace(state, records={**state.records, event.instance: new}, dirty=True), []
    return _update(state, event)


# ---- the step ------------------------------------------------------------------------------------------


def _seen(state: MasterState, event: Seen) -> tuple[MasterState, list[Effect]]:
    snap = event.snapshot
    state = replace(state, snapshot=snap)
    if state.downloads and (settled := downloads.settle(state.downloads, snap.cluster)) != state.downloads:
        state = replace(state, downloads=settled, dirty=True)
    out: list[Effect] = []
    if not state.rebuilt and snap.now - state.started >= state.config.report_s * 2:
        state, out = _rebuild(state)  # one report period (and a margin) after the claim: all reported
    for instance, generation, why, lost in facts.node_losses(snap.cluster, list(state.records.values())):
        rec = state.records[instance]
        if instance in state.running:
            stages = tuple(k for k, s in enumerate(rec.stages) if s.node_id in lost)
            out.append(FaultGeneration(instance, generation, why, stages))
    if event.changed or state.dirty or snap.now - state.last_view >= VIEW_PERIOD_S:
        state = replace(state, dirty=False, last_view=snap.now, seq=state.seq + 1)
        out.append(PublishView(view(state)))
    return state, out


def _rebuild(state: MasterState) -> tuple[MasterState, list[Effect]]:
    """Instances from the newest records anyone holds; adopt what still serves, rebuild the rest."""
    held = {
        (i.instance, i.generation, i.slot, node_id)
        for node_id, r in state.snapshot.cluster.reports.items()
        for i in r.runners
        if i.pid is not None
    }
    out: list[Effect] = []
    running = set(state.running)
    for rec in state.records.values():
        if rec.instance in running:
            continue
        complete = bool(rec.stages) and all(
            (rec.instance, rec.generation, k, s.node_id) in held for k, s in enumerate(rec.stages)
        )
        # Stages still reported alive survive the rebuild (same layers: same process, new generation).
        lost = tuple(
            k for k, s in enumerate(rec.stages) if (rec.instance, rec.generation, k, s.node_id) not in held
        )
        running.add(rec.instance)
        adopt = complete and rec.phase == "ready"
        out.append(StartInstance(rec, adopt=adopt, lost=lost, attn_keys=_attn_keys(state, rec.model)))
    return replace(state, rebuilt=True, running=frozenset(running), dirty=state.dirty or bool(out)), out


def _attn_keys(state: MasterState, model: str) -> int:
    fp = facts.footprint(state.snapshot.cluster, model)
    return 6 * max(1, fp.hidden_size if fp else 1024)


# ---- queries -------------------------------------------------------------------------------------------


def _query(state: MasterState, event: QueryIn) -> tuple[MasterState, list[Effect]]:
    q = event.query
    # A client that retried (its first answer was slow or lost) gets the first answer again.
    if q.nonce and q.nonce in state.answered:
        return state, [Reply(event.qid, state.answered[q.nonce])]
    if isinstance(q, cm.Forget):  # the node's membership, answered by the shell (cluster/master.py)
        return state, [Reply(event.qid, cm.MasterReply(ok=False, error="not here", term=state.term))]
    if isinstance(q, cm.Remove):
        state, reply, out = _remove(state, q, event.at)
    else:
        state, reply, out = _place(state, q, event.salt, event.at)
    if q.nonce:
        answered = {**state.answered, q.nonce: reply}
        while len(answered) > MAX_ANSWERED:
            del answered[next(iter(answered))]
        state = replace(state, answered=answered)
    return state, [*out, Reply(event.qid, reply)]


def _remove(state: MasterState, q: cm.Remove, at: float) -> tuple[MasterState, cm.MasterReply, list[Effect]]:
    rec = state.records.get(q.instance)
    if rec is None:
        return state, cm.MasterReply(ok=False, error=f"no instance {q.instance!r}", term=state.term), []
    out: list[Effect] = [StopInstance(q.instance)] if q.instance in state.running else []
    out.append(Log(cm.ClusterEvent(at=at, kind="removed", instance=q.instance, message=rec.model)))
    records = {k: v for k, v in state.records.items() if k != q.instance}
    paused = {k: v for k, v in state.paused.items() if k != q.instance}
    state = replace(state, records=records, running=state.running - {q.instance}, paused=paused, dirty=True)
    return state, cm.MasterReply(ok=True, instance=rec, term=state.term), out


def existing(state: MasterState, model: str) -> cm.InstanceRecord | None:
    """The oldest instance of `model` that has not failed (a failed one has stopped all its runners)."""
    found = [r for r in state.records.values() if r.model == model and r.phase != "failed"]
    return min(found, key=lambda r: (r.created_at, r.instance)) if found else None


def _place(
    state: MasterState, q: cm.Place, salt: str, at: float
) -> tuple[MasterState, cm.MasterReply, list[Effect]]:
    if q.if_absent and (rec := existing(state, q.model)) is not None:
        return state, cm.MasterReply(ok=True, instance=rec, term=state.term), []
    snap = state.snapshot.cluster
    fp = facts.footprint(snap, q.model)
    if fp is None and q.source and not q.dry_run:
        return _download(state, q, at)
    if fp is None:
        error = f"model {q.model!r} is on no live node"
        return state, cm.MasterReply(ok=False, error=error, term=state.term), []
    digest = facts.expected_digest(snap, q.model)
    if digest is None:  # no copy could be checked, or holders disagree: nothing is placed on trust
        error = facts.digest_refusal(snap, q.model)
        return state, cm.MasterReply(ok=False, error=error, term=state.term), []
    nodes = [c for c in facts.capacities(snap) if holds_stages(snap, c.node_id)]
    try:
        placement = place(fp, nodes, q.request)
        why, runners = arranged(snap, fp, nodes, placement, q.request)
    except (PlacementError, ValueError) as exc:
        return state, cm.MasterReply(ok=False, error=str(exc), term=state.term), []
    if q.dry_run:
        reply = cm.MasterReply(ok=True, placement=placement, runners=runners, layout=why, term=state.term)
        return state, reply, []
    sequences = placement.sequences * placement.reserve_tokens
    instance = f"{q.model[:40]}-{salt}"
    n = 1
    while instance in state.records:  # a salt drawn twice: never two records under one id
        instance, n = f"{q.model[:40]}-{salt}{n}", n + 1
    rec = cm.InstanceRecord(
        instance=instance,
        model=q.model,
        request=q.request,
        kv_budget_bytes=fp.kv_bytes_per_token_per_layer * fp.layers * sequences,
        vocab_size=fp.vocab_size,
        context_length=fp.context_length,
        created_at=at,
        stages=[cm.StageRecord(node_id=a.node_id, start=a.start, end=a.end) for a in placement.stages],
        digest=digest,
        weight_format=fp.weight_format,
    )
    state = replace(
        state, records={**state.records, instance: rec}, running=state.running | {instance}, dirty=True
    )
    out: list[Effect] = [
        StartInstance(rec, adopt=False, attn_keys=6 * max(1, fp.hidden_size)),
        Log(cm.ClusterEvent(at=at, kind="placed", instance=instance, message=_describe(placement))),
    ]
    return state, cm.MasterReply(ok=True, placement=placement, instance=rec, term=state.term), out


def _download(state: MasterState, q: cm.Place, at: float) -> tuple[MasterState, cm.MasterReply, list[Effect]]:
    """No live node holds the model: one node downloads it for everyone; the client asks again after."""
    held, reply, event = downloads.wait_on(state.downloads, state.snapshot.cluster, q, at, state.term)
    return replace(state, downloads=held, dirty=True), reply, [Log(event)] if event is not None else []


# ---- controllers' updates ------------------------------------------------------------------------------


def _update(state: MasterState, u: InstanceUpdate) -> tuple[MasterState, list[Effect]]:
    rec = state.records.get(u.instance)
    if rec is None or u.instance not in state.running:
        return state, []  # removed meanwhile
    phase = _phase(u.controller_phase, [s.phase for s in u.stages], u.failures)
    stages = []
    for k, st in enumerate(rec.stages):
        v = u.stages[k] if k < len(u.stages) else StageInfo()
        stages.append(
            st.model_copy(
                update={
                    "phase": v.phase,
                    "pid": v.pid,
                    "weights_done": v.weights_done,
                    "weights_total": v.weights_total,
                    "path": v.path or st.path,
                }
            )
        )
    new = rec.model_copy(
        update={
            "generation": u.generation,
            "phase": phase,
            "why": u.failure or (u.last_failure if phase != "ready" else ""),
            "stages": stages,
            "kv_bytes_per_token": u.kv_bytes_per_token,
            "recoveries": u.failures,
        }
    )
    events, paused = _transitions(rec, new, state.paused.get(u.instance), now=u.at)
    paused_map = {k: v for k, v in state.paused.items() if k != u.instance}
    if paused is not None:
        paused_map[u.instance] = paused
    state = replace(state, records={**state.records, u.instance: new}, paused=paused_map, dirty=True)
    return state, [Log(e) for e in events]


# ---- the view ------------------------------------------------------------------------------------------


def view(state: MasterState) -> cm.ClusterView:
    st = state.snapshot.cluster
    nodes = [
        cm.NodeSummary(
            node_id=n,
            name=r.name,
            endpoint=r.endpoint,
            alive=n in st.alive,
            resources=r.resources,
            models=sorted(r.models),
            api=r.api,
            leaving=r.leaving,
            downloads=r.downloads,
        )
        for n, r in sorted(st.reports.items())
    ]
    nodes += [
        cm.NodeSummary(node_id=n, name=r.name, endpoint=r.endpoint, alive=False, api=r.api, left_at=left_at)
        for n, (r, left_at) in sorted(st.departed.items())
        if n not in st.reports
    ]
    return cm.ClusterView(
        term=state.term,
        master=state.config.me,
        seq=state.seq,
        nodes=nodes,
        instances=list(state.records.values()),
        events=list(st.events)[-EVENTS_IN_VIEW:],
        membership=st.membership,
        downloads=list(state.downloads.values()),
    )


# ---- records' phases and the events between them -------------------------------------------------------


def _phase(controller_phase: str, stage_phases: list[str], failures: int = 0) -> cm.InstancePhase:
    """The instance's phase: after a failure it is recovering until it serves again (its stages show how far
    each has come: placed, weights, loading, warming)."""
    if controller_phase == "serving":
        return "ready"
    if controller_phase == "failed":
        return "failed"
    if controller_phase == "backoff" or failures:
        return "recovering"
    for p in ("placed", "weights", "loading", "warming"):
        if p in stage_phases or (p == "placed" and "starting" in stage_phases):
            return p  # type: ignore[return-value]
    return "loading"


def _transitions(
    old: cm.InstanceRecord, new: cm.InstanceRecord, paused: float | None, now: float
) -> tuple[list[cm.ClusterEvent], float | None]:
    """The events between two records of an instance, and since when it has not served (None: serving).

    A pause starts at the failure or when a ready instance stops being ready, and ends when it is ready
    again: the `recovered` event says how long it lasted.
    """
    out = []
    stopped = new.recoveries > old.recoveries or (old.phase == "ready" and new.phase != "ready")
    if paused is None and stopped:
        paused = now
    if new.recoveries > old.recoveries:
        # Name the node as well as the stage: that is what a user can act on. A group member is named by
        # its slot ("stage 0 member 1 (runner 2)"); a face that lost one names it last, after itself.
        named = re.findall(r"\(runner (\d+)\)", new.why) or re.findall(r"stage (\d+)", new.why)[:1]
        k = int(named[-1]) if named else -1
        node = old.stages[k].node_id if 0 <= k < len(old.stages) else ""
        message = f"{new.why} (node {node})" if node else new.why
        out.append(cm.ClusterEvent(at=now, kind="failure", node=node, instance=new.instance, message=message))
    if new.phase != old.phase:
        if new.phase == "ready":
            kind = "recovered" if new.recoveries else "ready"
            pause_s = round(now - paused, 3) if kind == "recovered" and paused is not None else None
            message = f"generation {new.generation}"
            if pause_s is not None:
                message += f", after a pause of {pause_s:.1f}s"
            out.append(
                cm.ClusterEvent(at=now, kind=kind, instance=new.instance, message=message, pause_s=pause_s)
            )
            paused = None
        elif new.phase == "failed":
            out.append(cm.ClusterEvent(at=now, kind="failed", instance=new.instance, message=new.why))
            paused = None
    return out, paused


def _describe(p: object) -> str:
    stages = getattr(p, "stages", [])
    return ", ".join(f"{a.node_id}[{a.start},{a.end})" for a in stages)
