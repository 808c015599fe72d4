"""The master role, on one node at a time: placement, instance lifecycle, re-placement after failures.

It holds one InstanceController per instance (controller/controller.py, the same one a local Engine uses),
with a layout that places the model over the live nodes (cluster/placement.py) each time a generation
starts, so a node that left is simply not in the next placement. It answers place/preview/remove queries,
and publishes the cluster view on a short period and at every change. A new master rebuilds its instances
from the newest records in the view and in node reports, adopting generations that still serve: a master
change alone never restarts a runner.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING

import zenoh

from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.placement import ModelFootprint, PlacementError, place
from shardline.controller.controller import InstanceController, Launch, LayoutError
from shardline.controller.state import ControllerConfig, Failure, stage_phase
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Keys
from shardline.runner.spec import RunnerSpec

if TYPE_CHECKING:
    from shardline.cluster.node import Node

log = logging.getLogger("shardline.master")
VIEW_PERIOD_S = 0.5
EVENTS_IN_VIEW = 50


class Master:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.term = node.state.term
        self.started = time.monotonic()
        # The newest records anyone holds, from the first view on: runners are fenced by what the view
        # lists, so a new master must never publish a view that forgets a live instance.
        self.records: dict[str, cm.InstanceRecord] = {
            r.instance: r for r in node.state.instances() if r.phase != "failed"
        }
        self.controllers: dict[str, InstanceController] = {}
        self.lock = threading.RLock()
        self._rebuilt = False
        self._last_view = 0.0
        self._dirty = threading.Event()
        self._closed = False
        self._answered: dict[str, cm.MasterReply] = {}
        self._seq = 0  # views published by this master
        self._paused: dict[str, float] = {}  # instance -> when it stopped serving (wall clock)
        assert node.session is not None
        self._queryable = node.session.declare_queryable(node.keys.query, self._on_query)

    def close(self, stop_runners: bool = True) -> None:
        """Stop the role. stop_runners=False (deposed): the instances live on under the new master."""
        with self.lock:
            self._closed = True
            controllers = list(self.controllers.values())
        try:
            self._queryable.undeclare()
        except zenoh.ZError:
            pass
        for c in controllers:
            c.stop(grace_s=2.0) if stop_runners else c.detach()

    # ---- the periodic step ---------------------------------------------------------------------------------

    def tick(self, happened: list[cm.ClusterEvent]) -> None:
        now = time.monotonic()
        if not self._rebuilt and now - self.started >= self.node.config.report_s * 2:
            self._rebuild()  # one report period (and a margin) after the claim: every live node reported
        with self.node.lock:
            losses = cs.node_losses(self.node.state, list(self.records.values()))
        for instance, generation, why, lost in losses:
            c, rec = self.controllers.get(instance), self.records.get(instance)
            if c is not None and rec is not None:
                c.fault(generation, why, [k for k, s in enumerate(rec.stages) if s.node_id in lost])
        if happened or self._dirty.is_set() or now - self._last_view >= VIEW_PERIOD_S:
            self._dirty.clear()
            self._last_view = now
            self.node.publish_view(self.view())

    def _rebuild(self) -> None:
        """Instances from the newest records anyone holds; adopt what still serves, rebuild the rest."""
        self._rebuilt = True
        with self.lock:
            records = list(self.records.values())
        with self.node.lock:
            held = {
                (i.instance, i.generation, i.stage, node_id)
                for node_id, r in self.node.state.reports.items()
                for i in r.runners
                if i.pid is not None
            }
        for rec in records:
            if rec.instance in self.controllers:
                continue
            complete = rec.stages and all(
                (rec.instance, rec.generation, k, s.node_id) in held for k, s in enumerate(rec.stages)
            )
            log.info(
                "master adopts %s generation %d (%s)",
                rec.instance,
                rec.generation,
                "serving" if complete and rec.phase == "ready" else "rebuilding",
            )
            # Stages still reported alive survive the rebuild (same layers: same process, new generation).
            lost = [
                k
                for k, s in enumerate(rec.stages)
                if (rec.instance, rec.generation, k, s.node_id) not in held
            ]
            self._start(rec, adopt=bool(complete and rec.phase == "ready"), lost=lost)

    # ---- instances -----------------------------------------------------------------------------------------

    def _start(self, rec: cm.InstanceRecord, adopt: bool, lost: list[int] | None = None) -> None:
        node = self.node
        r = node.config.runners
        ccfg = ControllerConfig.of(r, max(1, len(rec.stages)))
        keys = Keys(rec.instance, 0, node.config.namespace)
        c = InstanceController(
            node.session,
            keys,
            ccfg,
            lambda generation: self._layout(rec.instance, generation),
            rec.kv_budget_bytes,
            attn_keys=6 * max(1, self._hidden(rec)),
            on_change=lambda: self._changed(rec.instance),
            reuse=r.reuse_survivors,
        )
        c.term = self.term
        with self.lock:
            self.records[rec.instance] = rec
            self.controllers[rec.instance] = c
        if adopt:
            agents = [node.keys.agent(s.node_id) for s in rec.stages]
            c.adopt(rec.generation, len(rec.stages), agents, rec.kv_bytes_per_token)
        else:
            c.state.generation = rec.generation  # the next generation is newer than any that ran
            if lost and rec.generation >= 0:  # the failure the old master did not live to handle
                why = f"stages {lost} lost with the master"
                c.state.failures.append(Failure(why, rec.generation, time.monotonic(), time.time(), [], lost))
            c.start()

    def _hidden(self, rec: cm.InstanceRecord) -> int:
        with self.node.lock:
            fp = cs.footprint(self.node.state, rec.model)
        return fp.hidden_size if fp else 1024

    def _layout(self, instance: str, generation: int) -> list[Launch]:
        """Place the model over the nodes alive now; one StartRunner per stage."""
        node = self.node
        with self.lock:
            rec = self.records[instance]
        with node.lock:
            fp = cs.footprint(node.state, rec.model)
            nodes = [c for c in cs.capacities(node.state, instance) if self._worker(c.node_id)]
            sources = cs.sources(node.state, rec.model)
            endpoints = {n: r.endpoint for n, r in node.state.reports.items()}
        if fp is None or not sources:
            raise LayoutError(f"model {rec.model!r} is on no live node")
        with self.lock:
            c = self.controllers.get(instance)
        keep = _keep(rec, c) if c is not None and c.reuse else {}
        avoid = _unreachable(rec, c) if c is not None else set()
        try:
            try:  # a node that stalled or vanished is most likely cut off: not used again while others fit
                placement = place(fp, [n for n in nodes if n.node_id not in avoid], rec.request, keep=keep)
            except PlacementError:
                if not avoid:
                    raise
                placement = place(fp, nodes, rec.request, keep=keep)
        except PlacementError as exc:
            raise LayoutError(str(exc)) from exc
        stages = [cm.StageRecord(node_id=a.node_id, start=a.start, end=a.end) for a in placement.stages]
        with self.lock:
            self.records[instance] = rec.model_copy(
                update={"stages": stages, "generation": generation, "phase": "placed"}
            )
        launches = []
        for k, a in enumerate(placement.stages):
            start = self._start_runner(rec, fp, generation, k, a, len(stages), endpoints, sources)
            # A survivor keeps its process where its layers stay (keep is empty unless reuse is on).
            start = start.model_copy(update={"reuse": keep.get(a.node_id) == (a.start, a.end)})
            launches.append((node.keys.agent(a.node_id), start))
        return launches

    def _worker(self, node_id: str) -> bool:
        r = self.node.state.reports.get(node_id)
        return r is not None and r.worker

    def _start_runner(
        self,
        rec: cm.InstanceRecord,
        fp: ModelFootprint,
        generation: int,
        stage: int,
        a: object,
        stages: int,
        endpoints: dict[str, str],
        sources: list[str],
    ) -> m.StartRunner:
        r = self.node.config.runners
        endpoint = endpoints[a.node_id]  # type: ignore[attr-defined]
        host = endpoint.split("/", 1)[1].rpartition(":")[0]
        spec = RunnerSpec(
            instance=rec.instance,
            generation=generation,
            stage=stage,
            stages=stages,
            model_dir="",
            model=rec.model,
            namespace=self.node.config.namespace,
            layer_start=a.start,  # type: ignore[attr-defined]
            layer_end=a.end,  # type: ignore[attr-defined]
            layer_total=fp.layers,
            connect=[endpoint],
            listen=[f"tcp/{host}:0"],
            kv_budget_bytes=rec.kv_budget_bytes,
            **r.settings_fields(),
        )
        threads = self.node.config.threads or 1
        return m.StartRunner(spec=spec, threads=threads, sources=sources, term=self.term, view_seq=self._seq)

    def _changed(self, instance: str) -> None:
        with self.lock:
            c, rec = self.controllers.get(instance), self.records.get(instance)
            if c is None or rec is None:
                return
            s = c.state
            phase = _phase(s.phase, [stage_phase(v) for v in s.views], len(s.failures))
            stages = []
            for k, st in enumerate(rec.stages):
                v = s.views[k] if k < len(s.views) else None
                w = v.weights if v is not None else None
                stages.append(
                    st.model_copy(
                        update={
                            "phase": stage_phase(v) if v is not None else "placed",
                            "pid": v.pid if v is not None else None,
                            "weights_done": w.done if w else 0,
                            "weights_total": w.total if w else 0,
                        }
                    )
                )
            new = rec.model_copy(
                update={
                    "generation": s.generation,
                    "phase": phase,
                    "why": s.failure or (s.failures[-1].why if s.failures and phase != "ready" else ""),
                    "stages": stages,
                    "kv_bytes_per_token": c.kv_bytes_per_token,
                    "recoveries": len(s.failures),
                }
            )
            self.records[instance] = new
            events, paused = _transitions(rec, new, self._paused.get(instance))
            if paused is None:
                self._paused.pop(instance, None)
            else:
                self._paused[instance] = paused
        if events:
            with self.node.lock:
                self.node.state.events.extend(events)
        self._dirty.set()

    # ---- queries -------------------------------------------------------------------------------------------

    def _on_query(self, query: zenoh.Query) -> None:
        # Answered beside zenoh's own threads: placing declares keys and may wait.
        threading.Thread(target=self._reply, args=(query,), daemon=True, name="master-query").start()

    def _reply(self, query: zenoh.Query) -> None:
        try:
            q = cm.QUERY.validate_json(query.payload.to_bytes() if query.payload else b"")
            with self.lock:
                # A client that retried (its first answer was slow or lost) gets the first answer again.
                reply = self._answered.get(q.nonce) if q.nonce else None
            if reply is None:
                reply = self._answer(q)
                if q.nonce:
                    with self.lock:
                        self._answered[q.nonce] = reply
        except Exception as exc:  # a bad query gets an error, never kills the master
            reply = cm.MasterReply(ok=False, error=f"{type(exc).__name__}: {exc}", term=self.term)
        try:
            query.reply(query.key_expr, reply.model_dump_json().encode())
        except zenoh.ZError:
            pass
        finally:
            query.drop()

    def _answer(self, q: cm.Place | cm.Remove) -> cm.MasterReply:
        node = self.node
        if isinstance(q, cm.Remove):
            with self.lock:
                c = self.controllers.pop(q.instance, None)
                rec = self.records.pop(q.instance, None)
            if c is None or rec is None:
                return cm.MasterReply(ok=False, error=f"no instance {q.instance!r}", term=self.term)
            c.stop(grace_s=2.0)
            self._event("removed", instance=q.instance, message=rec.model)
            return cm.MasterReply(ok=True, instance=rec, term=self.term)
        with node.lock:
            fp = cs.footprint(node.state, q.model)
            nodes = [c for c in cs.capacities(node.state) if self._worker(c.node_id)]
        if fp is None:
            return cm.MasterReply(ok=False, error=f"model {q.model!r} is on no live node", term=self.term)
        try:
            placement = place(fp, nodes, q.request)
        except PlacementError as exc:
            return cm.MasterReply(ok=False, error=str(exc), term=self.term)
        if q.dry_run:
            return cm.MasterReply(ok=True, placement=placement, term=self.term)
        sequences = placement.sequences * placement.reserve_tokens
        rec = cm.InstanceRecord(
            instance=f"{q.model[:40]}-{uuid.uuid4().hex[:6]}",
            model=q.model,
            request=q.request,
            kv_budget_bytes=fp.kv_bytes_per_token_per_layer * fp.layers * sequences,
            vocab_size=fp.vocab_size,
            context_length=fp.context_length,
            created_at=time.time(),
            stages=[cm.StageRecord(node_id=a.node_id, start=a.start, end=a.end) for a in placement.stages],
        )
        self._start(rec, adopt=False)
        self._event("placed", instance=rec.instance, message=_describe(placement))
        return cm.MasterReply(ok=True, placement=placement, instance=rec, term=self.term)

    def _event(self, kind: str, **kw: str) -> None:
        with self.node.lock:
            self.node.state.events.append(cm.ClusterEvent(at=time.time(), kind=kind, **kw))  # type: ignore[arg-type]
        self._dirty.set()

    # ---- the view ------------------------------------------------------------------------------------------

    def view(self) -> cm.ClusterView:
        with self.node.lock:
            st = self.node.state
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
                )
                for n, r in sorted(st.reports.items())
            ]
            nodes += [
                cm.NodeSummary(
                    node_id=n, name=r.name, endpoint=r.endpoint, alive=False, api=r.api, left_at=left_at
                )
                for n, (r, left_at) in sorted(st.departed.items())
                if n not in st.reports
            ]
            events = list(st.events)[-EVENTS_IN_VIEW:]
        with self.lock:
            instances = list(self.records.values())
        with self.lock:
            self._seq += 1
            seq = self._seq
        return cm.ClusterView(
            term=self.term, master=self.node.node_id, seq=seq, nodes=nodes, instances=instances, events=events
        )


def _keep(rec: cm.InstanceRecord, c: InstanceController) -> dict[str, tuple[int, int]]:
    """node -> layer range of the previous generation's stages that its failure did not blame."""
    failures = c.state.failures
    blamed = failures[-1].suspects if failures else None
    if rec.generation < 0 or blamed is None:
        return {}
    return {s.node_id: (s.start, s.end) for k, s in enumerate(rec.stages) if k not in blamed}


def _unreachable(rec: cm.InstanceRecord, c: InstanceController) -> set[str]:
    """Nodes of the stages the last failure blamed, when it looks like the machine or its link (a stall, a
    vanished peer) rather than the process (an exit, a typed failure, which a restart there cures)."""
    failures = c.state.failures
    if rec.generation < 0 or not failures or failures[-1].suspects is None:
        return set()
    last = failures[-1]
    if not any(word in last.why for word in ("stalled", "vanished", "left the cluster")):
        return set()
    return {s.node_id for k, s in enumerate(rec.stages) if k in last.suspects}


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
    old: cm.InstanceRecord, new: cm.InstanceRecord, paused: float | None, now: float | None = None
) -> tuple[list[cm.ClusterEvent], float | None]:
    """The events between two records of an instance, and since when it has not served (None: serving).

    A pause starts at the failure or when a ready instance stops being ready, and ends when it is ready
    again: the `recovered` event says how long it lasted.
    """
    now = time.time() if now is None else now
    out = []
    stopped = new.recoveries > old.recoveries or (old.phase == "ready" and new.phase != "ready")
    if paused is None and stopped:
        paused = now
    if new.recoveries > old.recoveries:
        # Name the node as well as the stage: that is what a user can act on.
        where = re.search(r"stage (\d+)", new.why)
        k = int(where[1]) if where else -1
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
