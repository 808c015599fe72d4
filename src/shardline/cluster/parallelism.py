"""Pipeline stages or tensor-parallel groups: which layout decodes one stream fastest (a pure decision).

A token of one stream visits every stage in turn: a pipeline decodes it in the sum of its stages' times
plus a hop per stage. A tensor-parallel group of k divides each of its layers' weight reads by k, but adds
two sums a layer, each a round trip on the link plus the hidden state's bytes each way, plus a fixed
software cost. So big layers on fast links want groups; small layers or slow links stay pipeline-only.

Every input is measured: each node's read bandwidth (a decode step reads every weight once), the links
between nodes (round trip and bandwidth), and the fixed costs of a sum and of a hop on this software
(`shardline bench tp` and `bench engine` measure them). `place` chooses how many machines to use (for
throughput and memory); this chooses how to arrange them: S stages of groups of k, S * k of them. Groups
replace the pipeline only when one stream decodes at least GROUP_GAIN faster with them and every member
fits its node's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardline.cluster.placement import (
    DEFAULT_RESERVE_TOKENS,
    NodeCapacity,
    Placement,
    PlacementRequest,
    split_for_stages,
)
from shardline.compute.kv import round_up
from shardline.instance.slots import runner_slots
from shardline.models.footprint import ModelFootprint

# A sum's cost beyond the link (framing, the add, waking the waiting thread, MLX <-> numpy) and a ring hop's
# (framing, zenoh, the next stage's wake-up): measured on loopback, where the link itself is ~30 us a
# round trip, by `bench tp` (p50 of a decode step's sum) and `bench engine` (a 2-stage step's time beyond
# its stages' compute). The sum's figure is Python's exchange (TLS streams); the MLX operation's sums took
# 15-50 us at the median, link included, so on plain TCP the estimate leans towards the pipeline.
SUM_OVERHEAD_S = 60e-6
HOP_OVERHEAD_S = 400e-6
GROUP_GAIN = 0.15  # groups must make one stream's token this much faster than the pipeline placed
GROUP_SIZES = (2, 4, 8)
READ_FALLBACK = 10e9  # bytes/s of a node that did not measure its read bandwidth


@dataclass(frozen=True)
class LinkFigures:
    """The network between the nodes, as measured: a small message's round trip and the bandwidth."""

    rtt_s: float
    bytes_per_s: float

    def one_way(self, nbytes: int) -> float:
        return self.rtt_s / 2 + nbytes / self.bytes_per_s


LOOPBACK = LinkFigures(rtt_s=30e-6, bytes_per_s=3e9)
ETHERNET_1G = LinkFigures(rtt_s=250e-6, bytes_per_s=117e6)


@dataclass(frozen=True)
class Candidate:
    """One layout and its estimated time per token of one stream (seconds), with its parts."""

    stages: int
    group: int
    token_s: float
    compute_s: float
    sums_s: float
    hops_s: float
    fits: bool
    why_not: str = ""

    @property
    def runners(self) -> int:
        return self.stages * self.group

    def describe(self) -> str:
        shape = f"{self.stages} stage{'s' if self.stages > 1 else ''}"
        shape += f" x groups of {self.group}" if self.group > 1 else " (pipeline)"
        figures = (
            f"{shape}: {self.token_s * 1e3:.2f} ms a token (weights {self.compute_s * 1e3:.2f} ms, "
            f"sums {self.sums_s * 1e3:.2f} ms, hops {self.hops_s * 1e3:.2f} ms)"
        )
        return figures if self.fits else f"{figures}, not possible: {self.why_not}"


@dataclass(frozen=True)
class Choice:
    stages: int
    group: int
    candidates: tuple[Candidate, ...]
    explanation: str


def _splits(model: ModelFootprint, size: int) -> bool:
    if size == 1:
        return True
    if not (model.heads and model.kv_heads and model.intermediate_size):
        return False  # an old report without the shapes: never split what cannot be checked
    widths = (model.heads // size * model.head_dim, model.intermediate_size // size)
    return (
        model.heads % size == 0
        and model.kv_heads % size == 0
        and model.intermediate_size % size == 0
        and not (model.quant_group and any(w % model.quant_group for w in widths))
    )


def estimate(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    stages: int,
    group: int,
    link: LinkFigures,
    request: PlacementRequest,
    ranges: list[tuple[int, int]] | None = None,
) -> Candidate:
    """One stream's token on `stages` stages, each a group of `group` nodes (in node order), or `ranges`."""
    ranges = ranges or split_for_stages(model, stages)
    order = sorted(nodes, key=lambda n: n.node_id)
    tokens = round_up(request.reserve_tokens or min(model.context_length, DEFAULT_RESERVE_TOKENS))
    kv_layer = model.kv_bytes_per_token_per_layer * tokens * request.sequences
    hidden_bytes = model.hidden_size * 4
    compute = sums = 0.0
    why_not = ""
    if len(order) < stages * group:
        why_not = f"needs {stages * group} nodes, the cluster has {len(order)}"
    elif group > 1 and model.tensor_split:  # its layers are not the shape a group splits
        why_not = model.tensor_split
    elif not _splits(model, group):
        why_not = f"its heads or columns do not split {group} ways"
    for k, (s, e) in enumerate(ranges):
        members = order[k * group : (k + 1) * group]
        layers = sum(model.layer_bytes[s:e])
        face_extra = (model.embed_bytes if s == 0 else 0) + (model.head_bytes if e == model.layers else 0)
        if model.tied and e == model.layers and s > 0:
            face_extra += model.embed_bytes
        read = min((n.read_bytes_per_s or READ_FALLBACK for n in members), default=READ_FALLBACK)
        work = layers / group + model.layer_overhead_bytes * (e - s) + _head_work(model, s, e)
        compute += work / read
        if group > 1:
            # Members send their partials to the face, which returns the total: k - 1 partials in, as many
            # totals out, on the face's link.
            per_sum = link.rtt_s + 2 * (group - 1) * hidden_bytes / link.bytes_per_s + SUM_OVERHEAD_S
            sums += 2 * (e - s) * per_sum
        need = layers / group + kv_layer * (e - s) / group + request.activation_bytes
        for i, n in enumerate(members):
            mine = need + (face_extra if i == 0 else 0)
            if mine > n.available_bytes and not why_not:
                why_not = f"{n.node_id} offers {n.available_bytes / 1e9:.2f} GB, needs {mine / 1e9:.2f} GB"
    hops = stages * (link.one_way(hidden_bytes) + HOP_OVERHEAD_S) if stages > 1 else 0.0
    total = compute + sums + hops
    return Candidate(stages, group, total, compute, sums, hops, fits=not why_not, why_not=why_not)


def _head_work(model: ModelFootprint, s: int, e: int) -> float:
    """The head's bytes a stage reads each token (the face alone computes it)."""
    work = model.head_bytes if e == model.layers else 0
    if model.tied and (s, e) == (0, model.layers):
        work += model.embed_bytes
    elif model.tied and (s == 0 or e == model.layers):
        work += model.embed_bytes / 2
    return work


def choose(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    pipeline: Placement,
    link: LinkFigures,
    request: PlacementRequest | None = None,
) -> Choice:
    """Keep `pipeline` (what place() chose), or replace it with groups that decode one stream faster."""
    request = request or PlacementRequest()
    ranges = [(a.start, a.end) for a in pipeline.stages]
    used = [n for n in nodes if n.node_id in {a.node_id for a in pipeline.stages}]
    base = estimate(model, used, len(ranges), 1, link, request, ranges)
    # The same machines, arranged otherwise: S stages of k, S * k = the pipeline's stages.
    options = [base]
    for group in GROUP_SIZES:
        if len(used) % group == 0 and len(used) // group <= model.layers:
            options.append(estimate(model, used, len(used) // group, group, link, request))
    fitting = [c for c in options[1:] if c.fits]
    best = min(fitting, key=lambda c: (c.token_s, c.runners), default=None)
    link_text = f"link: {link.rtt_s * 1e6:.0f} us round trip, {link.bytes_per_s / 1e9:.2f} GB/s"
    listed = "; ".join(c.describe() for c in options)
    if best is not None and best.token_s <= base.token_s * (1 - GROUP_GAIN):
        gain = base.token_s / best.token_s
        why = (
            f"groups: {best.stages} stage(s) x {best.group} decode one stream {gain:.2f}x faster than the "
            f"{base.stages}-stage pipeline ({link_text}). Candidates: {listed}"
        )
        return Choice(best.stages, best.group, tuple(options), why)
    if best is None:
        reason = "no group layout fits or splits"
    else:
        reason = (
            f"the best group layout ({best.stages} x {best.group}, {best.token_s * 1e3:.2f} ms) is not "
            f"{GROUP_GAIN:.0%} faster than the pipeline's {base.token_s * 1e3:.2f} ms: its sums cost about "
            "what the weight reads they split save"
        )
    why = f"pipeline: {reason} ({link_text}). Candidates: {listed}"
    return Choice(base.stages, 1, tuple(options), why)


def arrange(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    pipeline: Placement,
    link: LinkFigures,
    request: PlacementRequest,
) -> tuple[Choice, list[tuple[str, int, int, int, int]]]:
    """The layout to launch: (node, ring stage, member, start, end) per runner in slot order, and why.

    request.tensor_parallel: None lets `choose` decide; 1 keeps the pipeline; k asks for groups of k on
    max_stages (default 1) stages, on the first nodes in node order, and where they cannot be (too few
    machines after a loss, too little memory), `choose` decides and the reason says so."""
    forced = request.tensor_parallel
    if forced is None:
        choice = choose(model, nodes, pipeline, link, request)
    elif forced == 1:
        base = estimate(model, nodes, len(pipeline.stages), 1, link, request, pipeline_ranges(pipeline))
        choice = Choice(len(pipeline.stages), 1, (base,), "pipeline: asked for (tensor_parallel 1)")
    else:
        stages = request.max_stages or 1
        c = estimate(model, nodes, stages, forced, link, request)
        if c.fits:
            choice = Choice(stages, forced, (c,), f"groups: asked for; {c.describe()}")
        else:  # a re-placement after a loss may have too few machines: the instance lives on as it can
            fallback = choose(model, nodes, pipeline, link, request)
            why = f"{stages} stage(s) x groups of {forced} asked for, not possible: {c.why_not}; "
            choice = replace(fallback, explanation=why + fallback.explanation)
            forced = None
    if choice.group == 1:
        runners = [(a.node_id, k, 0, a.start, a.end) for k, a in enumerate(pipeline.stages)]
        return choice, runners
    ranges = split_for_stages(model, choice.stages)
    order = sorted(nodes, key=lambda n: n.node_id)
    if forced is None:  # choose() arranged the pipeline's own machines
        used = {a.node_id for a in pipeline.stages}
        order = [n for n in order if n.node_id in used]
    runners = []
    for stage, member in runner_slots(choice.stages, choice.group):
        node = order[stage * choice.group + member]
        runners.append((node.node_id, stage, member, *ranges[stage]))
    return choice, runners


def pipeline_ranges(pipeline: Placement) -> list[tuple[int, int]]:
    return [(a.start, a.end) for a in pipeline.stages]
