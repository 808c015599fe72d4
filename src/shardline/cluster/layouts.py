"""Where the runners of an instance's new generation go: pure functions of the master's state.

The shell (cluster/master.py) calls `layout` from an instance controller's thread with the newest master
state, which is immutable: it reads it without a lock. `keep_layers` and `unreachable` say what the last
failure leaves of the previous generation; `arranged` (pipeline, tensor- or expert-parallel groups over the
placed machines) is shared with the master's dry-run and placement answers (cluster/master_state.py). An
expert group's map lives in its face's StageRecord: a recovery rebuilds the same map (`expert_map`) unless
measured routing makes a clearly better one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardline.cluster import facts
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.experts import model_owners
from shardline.cluster.keys import ClusterKeys
from shardline.cluster.parallelism import arrange
from shardline.cluster.placement import Placement, PlacementError, place
from shardline.controller.controller import Launch, LayoutError
from shardline.dataplane import messages as m
from shardline.instance.spec import runner_spec
from shardline.models.footprint import ModelFootprint

if TYPE_CHECKING:  # master_state imports this module for `arranged`; the state type alone comes back
    from shardline.cluster import master_state as ms


def layout(
    state: ms.MasterState,
    instance: str,
    generation: int,
    keep: Mapping[str, tuple[int, int]],
    avoid: set[str],
    load: list[list[float]] | None = None,
) -> tuple[tuple[cm.StageRecord, ...], list[Launch], str]:
    """Place the model over the nodes alive now; one StartRunner per runner (a stage, or a member of a
    stage's tensor-parallel group), and why that layout. `load`: the routing the last generation's expert
    groups measured (cluster/experts.py: measured_load), else the record's. Raises LayoutError."""
    rec = state.records.get(instance)
    if rec is None:
        raise LayoutError(f"instance {instance!r} was removed")
    snap = state.snapshot.cluster
    fp = facts.footprint(snap, rec.model)
    nodes = [c for c in facts.capacities(snap, instance) if holds_stages(snap, c.node_id)]
    digest = rec.digest or facts.expected_digest(snap, rec.model) or ""
    sources = facts.sources(snap, rec.model, digest)
    endpoints = {n: r.endpoint for n, r in snap.reports.items()}
    if fp is None or not facts.sources(snap, rec.model):
        raise LayoutError(f"model {rec.model!r} is on no live node")
    if not sources:
        raise LayoutError(f"no live node holds model {rec.model!r} with the expected digest {digest[:12]}")
    try:
        try:  # a node that stalled or vanished is most likely cut off: not used again while others fit
            usable = [n for n in nodes if n.node_id not in avoid]
            placement = place(fp, usable, rec.request, keep=keep)
        except PlacementError:
            if not avoid:
                raise
            usable = nodes
            placement = place(fp, nodes, rec.request, keep=keep)
        previous = expert_map(rec)
        measured = load or rec.expert_load
        why, runners = arranged(snap, fp, usable, placement, rec.request, previous, measured)
    except (PlacementError, ValueError) as exc:
        raise LayoutError(str(exc)) from exc
    groups = any(r.member for r in runners)
    stages = tuple(runners)
    keys = ClusterKeys(state.config.namespace)
    launches = []
    ring_stages = sum(1 for r in runners if not r.member)
    threads = runner_threads(state, instance, runners)
    for k, a in enumerate(runners):
        group = len(runners) // ring_stages
        face = runners[a.ring if a.member and a.ring is not None else k]
        start = _start_runner(
            state,
            rec,
            fp,
            generation,
            k,
            a,
            ring_stages,
            endpoints,
            sources,
            group,
            face.expert_owners,
            face.expert_heads,
            threads[a.node_id],
        )
        start = start.model_copy(update={"digest": digest})
        # A survivor keeps its process where its layers stay (keep is empty unless reuse is on); a group's
        # members are always new (they meet their face at bring-up).
        start = start.model_copy(update={"reuse": not groups and keep.get(a.node_id) == (a.start, a.end)})
        launches.append((keys.agent(a.node_id), start))
    return stages, launches, why


def _start_runner(
    state: ms.MasterState,
    rec: cm.InstanceRecord,
    fp: ModelFootprint,
    generation: int,
    slot: int,
    a: cm.StageRecord,
    stages: int,
    endpoints: dict[str, str],
    sources: list[str],
    group: int = 1,
    expert_owners: list[list[int]] | None = None,
    expert_heads: bool = False,
    threads: int = 1,
) -> m.StartRunner:
    """The command that starts runner `slot` of a generation on node `a.node_id`; `expert_owners`,
    `expert_heads`: its expert group's map and arrangement (its face's record's)."""
    spec = runner_spec(
        state.config.spec_fields,
        instance=rec.instance,
        generation=generation,
        slot=slot,
        stages=stages,
        layers=(a.start, a.end, fp.layers),
        endpoint=endpoints[a.node_id],
        kv_budget_bytes=rec.kv_budget_bytes,
        group=group,
        member=a.member,
        expert_owners=expert_owners,
        expert_heads=expert_heads,
        position=a.ring,
        model=rec.model,
        namespace=state.config.namespace,
    )
    return m.StartRunner(spec=spec, threads=threads, sources=sources, term=state.term, view_seq=state.seq)


def keep_layers(rec: cm.InstanceRecord, failures: list[Any]) -> dict[str, tuple[int, int]]:
    """node -> layer range of the previous generation's stages that its failure did not blame."""
    blamed = failures[-1].suspects if failures else None
    if rec.generation < 0 or blamed is None or any(s.member for s in rec.stages):
        return {}  # a tensor-parallel group's runners are never handed on: their group is gone
    return {s.node_id: (s.start, s.end) for k, s in enumerate(rec.stages) if k not in blamed}


def unreachable(rec: cm.InstanceRecord, failures: list[Any]) -> set[str]:
    """Nodes of the stages the last failure blamed, when it looks like the machine or its link (a stall, a
    vanished peer) rather than the process (an exit, a typed failure, which a restart there cures)."""
    if rec.generation < 0 or not failures or failures[-1].suspects is None:
        return set()
    last = failures[-1]
    if not any(word in last.why for word in ("stalled", "vanished", "left the cluster")):
        return set()
    return {s.node_id for k, s in enumerate(rec.stages) if k in last.suspects}


def arranged(
    snap: cs.ClusterState,
    fp: ModelFootprint,
    nodes: list[Any],
    placement: Placement,
    request: Any,
    owners: Sequence[Sequence[int]] = (),
    load: Sequence[Sequence[float]] | None = None,
) -> tuple[str, list[cm.StageRecord]]:
    """Pipeline, tensor-parallel or expert-parallel groups over the placed machines (cluster/parallelism.py),
    and why. owners: the instance's expert map over all layers (kept where it still serves), load: its
    measured routing (cluster/experts.py: layout_owners)."""
    link, source = facts.link_between(snap, [n.node_id for n in nodes])
    choice, runners = arrange(fp, nodes, placement, link, request, owners, load)
    records = [
        cm.StageRecord(
            node_id=node,
            start=s,
            end=e,
            ring=stage if member else None,
            member=member,
            expert_owners=choice.owners[stage] if choice.experts and not member else [],
            expert_heads=choice.heads and not member,
        )
        for node, stage, member, s, e in runners
    ]
    return f"{choice.explanation} [link {source}]", records


def expert_map(rec: cm.InstanceRecord) -> list[list[int]]:
    """The instance's expert map over all layers, from its faces' records ([] where it has none)."""
    return model_owners([(s.start, s.end, s.expert_owners) for s in rec.stages if not s.member])


def runner_threads(state: ms.MasterState, instance: str, runners: Sequence[cm.StageRecord]) -> dict[str, int]:
    """Threads for each node's runners of this layout: the node's setting (MasterConfig.threads), else its
    cores shared by the runners it would hold, of this instance and of every other one (a stage alone on
    its machine uses all its cores for one token; the products split their rows across them)."""
    here = Counter(a.node_id for a in runners)
    if state.config.threads:
        return {node: state.config.threads for node in here}
    others = Counter(s.node_id for name, rec in state.records.items() if name != instance for s in rec.stages)
    reports = state.snapshot.cluster.reports
    out = {}
    for node, count in here.items():
        report = reports.get(node)
        cpus = report.resources.cpus if report is not None and report.resources is not None else 1
        out[node] = max(1, cpus // (count + others[node]))
    return out


def holds_stages(snap: cs.ClusterState, node_id: str) -> bool:
    r = snap.reports.get(node_id)
    return r is not None and r.holds_stages
