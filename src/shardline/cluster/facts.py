"""What the node and the master read from a ClusterState (cluster/state.py), as pure functions.

For placement: `capacities` (what each live node offers), `footprint` (a model's, from a holder's report),
`expected_digest` and `sources` (what a model's copies must be, and who holds such a copy), `link_between`
(the network placement assumes). For recovery and fencing: `node_losses` (instances whose stages sit on
nodes that left), `stale_runners` (runners a node must kill because the newest view no longer lists their
generation).
"""

from __future__ import annotations

from shardline.cluster import messages as cm
from shardline.cluster.parallelism import ETHERNET_1G, LOOPBACK, LinkFigures
from shardline.cluster.placement import NodeCapacity
from shardline.cluster.state import ClusterState
from shardline.models.footprint import ModelFootprint


def node_losses(
    state: ClusterState, instances: list[cm.InstanceRecord]
) -> list[tuple[str, int, str, set[str]]]:
    """(instance, generation, why, lost nodes) for every live instance with a stage on a node that left."""
    alive = state.alive | {state.me}
    out = []
    for rec in instances:
        if rec.phase == "failed" or rec.generation < 0:
            continue
        lost = sorted({s.node_id for s in rec.stages if s.node_id not in alive})
        if lost:
            out.append((rec.instance, rec.generation, f"node {', '.join(lost)} left the cluster", set(lost)))
    return out


def stale_runners(view: cm.ClusterView, held: list[cm.RunnerInfo]) -> list[tuple[str, int]]:
    """(instance, generation to keep or -1) for runners the view no longer lists: they must stop.

    A view judges only runners started before it was made: views and commands travel on different keys, so
    a view may arrive after a newer command (its instance or generation not in it yet)."""
    current = {r.instance: r.generation for r in view.instances if r.phase != "failed"}
    settled = {r.instance for r in view.instances if r.phase == "ready"}
    made = (view.term, view.seq)
    doomed, spared = set(), set()
    for r in held:
        listed = r.instance in current
        keep = current.get(r.instance, -1)
        if r.issued >= made or (listed and r.generation > keep):
            # Newer than the view: it cannot judge this instance yet. A listed instance's generation may be
            # older than its runners' (-1 too): a controller's layout reaches views after its launches.
            spared.add(r.instance)
        elif keep >= 0 and r.instance not in settled:
            spared.add(r.instance)  # a new generation is starting: this runner may be handed over to it
        elif r.generation != keep:
            doomed.add((r.instance, keep))
    return sorted(d for d in doomed if d[0] not in spared)


def capacities(state: ClusterState, instance: str | None = None) -> list[NodeCapacity]:
    """What each live node offers placement; memory held by `instance`'s own runners counts as free (a
    re-placement replaces them)."""
    out = []
    for node_id, r in sorted(state.reports.items()):
        # A node whose token is gone is not placed on, even while its lease runs: it is most likely dead.
        if node_id != state.me and (node_id not in state.alive or node_id not in state.tokens):
            continue
        available = r.resources.memory_available
        if instance is not None:
            available += sum(
                _held_bytes(state, instance, info) for info in r.runners if info.instance == instance
            )
        read = r.resources.read_gbps * 1e9
        out.append(NodeCapacity(node_id, max(0, available), max(r.resources.compute_score, 1e-3), read))
    return out


def _held_bytes(state: ClusterState, instance: str, info: cm.RunnerInfo) -> int:
    fp = footprint(state, next((r.model for r in state.instances() if r.instance == instance), ""))
    return sum(fp.layer_bytes[info.start : info.end]) if fp else 0


def footprint(state: ClusterState, model: str) -> ModelFootprint | None:
    for _, r in sorted(state.reports.items()):
        local = r.models.get(model)
        if local is not None and local.footprint is not None:
            return local.footprint
    return None


def _whole_copies(state: ClusterState, model: str) -> dict[str, str]:
    """node -> the model digest of its whole copy of `model`, for live nodes that recorded one."""
    return {
        n: m.digest
        for n, r in sorted(state.reports.items())
        if n in state.alive | {state.me} and (m := r.models.get(model)) and m.full and m.digest
    }


def expected_digest(state: ClusterState, model: str) -> str | None:
    """The digest every copy of `model` must have: the one of this node's (the master's) own whole copy;
    without one, the one every live holder's record agrees on; None while no holder recorded one, or when
    they disagree (nothing is placed on trust: an operator removes the version not wanted).

    A self-reported import time never decides: any key holder could claim the earliest. Reports are
    authenticated where they are received (a key's HMAC, or a node certificate whose name is the report's
    node id: trust/seal.py), so a holder speaks for its own copy only; a peer that lies about its copy
    can at worst block a placement that needs a peer's word, never choose the weights every node loads. An
    instance keeps the digest it was placed with (its record) whatever holders join later."""
    copies = _whole_copies(state, model)
    if state.me in copies:
        return copies[state.me]
    versions = set(copies.values())
    return versions.pop() if len(versions) == 1 else None


def digest_refusal(state: ClusterState, model: str) -> str:
    """Why expected_digest is None, in a sentence for the client."""
    copies = _whole_copies(state, model)
    if not copies:
        return f"model {model!r} has no recorded digests on any live node yet (being hashed): try again soon"
    held = ", ".join(f"{n}: {d[:12]}" for n, d in copies.items())
    return (
        f"the live holders of model {model!r} hold different versions ({held}) and this master holds none: "
        "not placed on any one node's word (remove the version not wanted from its holders)"
    )


def sources(state: ClusterState, model: str, digest: str | None = None) -> list[str]:
    """Live nodes holding the whole model (with `digest`, when given): where a node without it fetches its
    stage. A holder of another version is never a source."""
    return [
        n
        for n, r in sorted(state.reports.items())
        if n in state.alive | {state.me}
        and (m := r.models.get(model))
        and m.full
        and (digest is None or m.digest == digest)
    ]


def link_between(state: ClusterState, node_ids: list[str]) -> tuple[LinkFigures, str]:
    """The link placement assumes between these nodes: the slowest pair as the nodes measured it (each
    reports its round trips to its peers), else what their endpoints suggest, said as an assumption."""
    rtts, rates = [], []
    for a in node_ids:
        r = state.reports.get(a)
        for b in node_ids:
            fact = r.links.get(b) if r is not None and a != b else None
            if fact is not None:
                rtts.append(fact.rtt_us * 1e-6)
                rates.append(fact.bytes_per_s)
    if rtts and len(rtts) >= len(node_ids) - 1:
        return LinkFigures(max(rtts), min(rates)), "measured"
    endpoints = [state.reports[n].endpoint for n in node_ids if n in state.reports]
    hosts = {e.split("/", 1)[-1].rpartition(":")[0] for e in endpoints}
    if hosts and all(h.startswith("127.") or h in ("localhost", "[::1]") for h in hosts):
        return LOOPBACK, "assumed: loopback"
    return ETHERNET_1G, "assumed: gigabit Ethernet (not measured yet)"
