"""Pipeline stages, tensor-parallel or expert-parallel groups: which layout decodes one stream fastest (a
pure decision).

A token of one stream visits every stage in turn: a pipeline decodes it in the sum of its stages' times
plus a hop per stage. A tensor-parallel group of k divides each of its layers' weight reads by k, but adds
two sums a layer, each a round trip on the link plus the hidden state's bytes each way, plus a fixed
software cost. So big layers on fast links want groups; small layers or slow links stay pipeline-only.
A mixture-of-experts model may instead form expert-parallel groups (cluster/experts.py): every member
holds the attention whole and E/k of each MoE layer's experts, so a token's expert reads spread over the
members (the group waits for the busiest) at one sum a MoE layer; a token reads only the experts it routes
to, so every layout is charged those (cluster/experts.py: layer_reads), not the layer's whole bytes.

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

from shardline.cluster.experts import (
    EXPERT,
    PIPELINE,
    TENSOR,
    expected_max_share,
    layer_memory,
    layer_reads,
    layout_owners,
    split_refusal,
)
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
    experts: bool = False  # the groups hold whole experts (expert parallelism), not slices of every layer
    heads: bool = (
        False  # an expert group whose members split attention by heads too (RunnerSpec.expert_heads)
    )

    @property
    def runners(self) -> int:
        return self.stages * self.group

    @property
    def mode(self) -> str:
        return PIPELINE if self.group == 1 else EXPERT if self.experts else TENSOR

    def shape(self) -> str:
        shape = f"{self.stages} stage{'s' if self.stages > 1 else ''}"
        if self.group == 1:
            return f"{shape} (pipeline)"
        kind = "groups"
        if self.experts:
            kind = "expert groups (attention by heads)" if self.heads else "expert groups (attention whole)"
        return f"{shape} x {kind} of {self.group}"

    def describe(self) -> str:
        figures = (
            f"{self.shape()}: {self.token_s * 1e3:.2f} ms a token (weights {self.compute_s * 1e3:.2f} ms, "
            f"sums {self.sums_s * 1e3:.2f} ms, hops {self.hops_s * 1e3:.2f} ms)"
        )
        return figures if self.fits else f"{figures}, not possible: {self.why_not}"


@dataclass(frozen=True)
class Choice:
    stages: int
    group: int
    candidates: tuple[Candidate, ...]
    explanation: str
    experts: bool = False  # expert-parallel groups
    heads: bool = False  # whose members split attention by heads too
    # Per ring stage, its expert map (cluster/experts.py) where `experts`: arrange fills it.
    owners: tuple[list[list[int]], ...] = ()


def _splits(model: ModelFootprint, size: int) -> bool:
    if size == 1:
        return True
    if not (model.heads and model.kv_heads and model.intermediate_size):
        return False  # an old report without the shapes: never split what cannot be checked
    widths = (model.heads // size * model.head_dim, model.intermediate_size // size)
    # Every routed and shared expert splits by columns too: whole quantization groups to each member.
    experts = size * (model.quant_group or 1)
    return (
        not (model.expert_columns and model.expert_columns % experts)
        and model.heads % size == 0
        and model.kv_heads % size == 0
        and model.intermediate_size % size == 0
        and not (model.quant_group and any(w % model.quant_group for w in widths))
    )


def _refusal(model: ModelFootprint, group: int, mode: str) -> str:
    """Why the model's layers cannot form groups of `group` in `mode`, or ""."""
    if mode == TENSOR and model.tensor_split:  # its layers are not the shape a group splits
        return model.tensor_split
    if mode == TENSOR and not _splits(model, group):
        return f"its heads or columns do not split {group} ways"
    if mode == EXPERT:
        return model.expert_split or split_refusal(model.experts, group)
    return ""


def estimate(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    stages: int,
    group: int,
    link: LinkFigures,
    request: PlacementRequest,
    ranges: list[tuple[int, int]] | None = None,
    experts: bool = False,
) -> Candidate:
    """One stream's token on `stages` stages, each a group of `group` nodes (in node order), or `ranges`;
    `experts`: expert-parallel groups rather than tensor-parallel ones."""
    ranges = ranges or split_for_stages(model, stages)
    mode = PIPELINE if group == 1 else EXPERT if experts else TENSOR
    order = sorted(nodes, key=lambda n: n.node_id)
    tokens = round_up(request.reserve_tokens or min(model.context_length, DEFAULT_RESERVE_TOKENS))
    kv_layer = model.kv_bytes_per_token_per_layer * tokens * request.sequences
    hidden_bytes = model.hidden_size * 4
    compute = sums = 0.0
    # An expert group's attention: whole on every member (one sum a MoE layer), or split by heads where it
    # splits (a sum more a layer, 1/k of its reads and KV): both are costed, the faster is made.
    heads = mode == EXPERT and _heads_split(model, group)
    heads_saved = heads_sums = 0.0
    why_not = _refusal(model, group, mode)
    if len(order) < stages * group:
        why_not = f"needs {stages * group} nodes, the cluster has {len(order)}"
    # Members send their partials to the face, which returns the total: k - 1 partials in, as many totals
    # out, on the face's link.
    per_sum = link.rtt_s + 2 * (group - 1) * hidden_bytes / link.bytes_per_s + SUM_OVERHEAD_S
    # An expert map that cannot be made has no busiest member to charge: its figures are a tensor group's.
    figures = TENSOR if mode == EXPERT and split_refusal(model.experts, group) else mode
    for k, (s, e) in enumerate(ranges):
        members = order[k * group : (k + 1) * group]
        face_extra = (model.embed_bytes if s == 0 else 0) + (model.head_bytes if e == model.layers else 0)
        if model.tied and e == model.layers and s > 0:
            face_extra += model.embed_bytes
        read = min((n.read_bytes_per_s or READ_FALLBACK for n in members), default=READ_FALLBACK)
        reads = sum(layer_reads(model, i, figures, group) for i in range(s, e))
        work = reads + model.layer_overhead_bytes * (e - s) + _head_work(model, s, e)
        compute += work / read
        if mode == TENSOR:
            sums += 2 * (e - s) * per_sum
        elif mode == EXPERT:  # one sum a MoE layer; a dense layer runs whole on every member
            sums += model.moe_layers(s, e) * per_sum
            attention = sum(
                model.layer_bytes[i] - model.expert_at(i) - model.shared_at(i) for i in range(s, e)
            )
            heads_saved += attention * (1 - 1 / group) / read
            heads_sums += (e - s) * per_sum
        held = sum(layer_memory(model, i, figures, group) for i in range(s, e))
        kv = kv_layer * (e - s) / (group if mode == TENSOR else 1)  # an expert group's attention is whole
        need = held + kv + request.activation_bytes
        for i, n in enumerate(members):
            mine = need + (face_extra if i == 0 else 0)
            if mine > n.available_bytes and not why_not:
                why_not = f"{n.node_id} offers {n.available_bytes / 1e9:.2f} GB, needs {mine / 1e9:.2f} GB"
    heads = heads and heads_saved > heads_sums
    if heads:
        compute, sums = compute - heads_saved, sums + heads_sums
    hops = stages * (link.one_way(hidden_bytes) + HOP_OVERHEAD_S) if stages > 1 else 0.0
    total = compute + sums + hops
    return Candidate(
        stages,
        group,
        total,
        compute,
        sums,
        hops,
        fits=not why_not,
        why_not=why_not,
        experts=mode == EXPERT,
        heads=heads,
    )


def _heads_split(model: ModelFootprint, group: int) -> bool:
    """Whether an expert group of `group` may split the attention by heads: where a tensor group could."""
    return bool(model.heads and model.kv_heads) and not model.tensor_split and _splits_heads(model, group)


def _splits_heads(model: ModelFootprint, group: int) -> bool:
    width = model.heads // group * model.head_dim
    return (
        model.heads % group == 0
        and model.kv_heads % group == 0
        and not (model.quant_group and width % model.quant_group)
    )


def _head_work(model: ModelFootprint, s: int, e: int) -> float:
    """The head's bytes a stage reads each token (the face alone computes it)."""
    work = model.head_bytes if e == model.layers else 0
    if model.tied and (s, e) == (0, model.layers):
        work += model.embed_bytes
    elif model.tied and (s == 0 or e == model.layers):
        work += model.embed_bytes / 2
    return work


def _why_experts(model: ModelFootprint, best: Candidate) -> str:
    share = expected_max_share(model.experts, model.experts_active, best.group)
    attention = "its share of the attention heads" if best.heads else "the attention whole"
    sums = "two sums" if best.heads else "one sum"
    return (
        f"each member holds {model.experts // best.group} of every MoE layer's {model.experts} experts and "
        f"{attention}; of a token's {model.experts_active} experts the busiest member reads "
        f"{share:.0%} on average, at {sums} a MoE layer"
    )


def choose(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    pipeline: Placement,
    link: LinkFigures,
    request: PlacementRequest | None = None,
) -> Choice:
    """Keep `pipeline` (what place() chose), or replace it with groups (tensor-parallel, or expert-parallel
    for a mixture of experts) that decode one stream faster."""
    request = request or PlacementRequest()
    ranges = [(a.start, a.end) for a in pipeline.stages]
    used = [n for n in nodes if n.node_id in {a.node_id for a in pipeline.stages}]
    base = estimate(model, used, len(ranges), 1, link, request, ranges)
    # The same machines, arranged otherwise: S stages of k, S * k = the pipeline's stages.
    options = [base]
    for group in GROUP_SIZES:
        if len(used) % group == 0 and len(used) // group <= model.layers:
            options.append(estimate(model, used, len(used) // group, group, link, request))
            if model.experts:
                options.append(estimate(model, used, len(used) // group, group, link, request, experts=True))
    fitting = [c for c in options[1:] if c.fits]
    best = min(fitting, key=lambda c: (c.token_s, c.runners), default=None)
    link_text = f"link: {link.rtt_s * 1e6:.0f} us round trip, {link.bytes_per_s / 1e9:.2f} GB/s"
    listed = "; ".join(c.describe() for c in options)
    if best is not None and best.token_s <= base.token_s * (1 - GROUP_GAIN):
        gain = base.token_s / best.token_s
        faster = f"{best.shape()} decode one stream {gain:.2f}x faster than the {base.stages}-stage pipeline"
        if best.experts:
            why = f"expert groups: {faster}: {_why_experts(model, best)} ({link_text}). Candidates: {listed}"
        else:
            why = f"groups: {faster} ({link_text}). Candidates: {listed}"
        return Choice(best.stages, best.group, tuple(options), why, experts=best.experts, heads=best.heads)
    if best is None:
        reason = "no group layout fits or splits"
    else:
        reason = (
            f"the best group layout ({best.shape()}, {best.token_s * 1e3:.2f} ms) is not "
            f"{GROUP_GAIN:.0%} faster than the pipeline's {base.token_s * 1e3:.2f} ms: its sums cost about "
            "what the weight reads they split save"
        )
    why = f"pipeline: {reason} ({link_text}). Candidates: {listed}"
    return Choice(base.stages, 1, tuple(options), why)


def _forced(request: PlacementRequest) -> tuple[int | None, bool]:
    """(group size asked for, whether expert groups): None lets `choose` decide; 1 keeps the pipeline.
    Tensor groups where both kinds are asked for (the older field), else the groups asked for."""
    tp, ep = request.tensor_parallel, request.expert_parallel
    if ep is not None and ep > 1 and not (tp is not None and tp > 1):
        return ep, True
    return tp or ep, False


def arrange(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    pipeline: Placement,
    link: LinkFigures,
    request: PlacementRequest,
    owners: Sequence[Sequence[int]] = (),
    load: Sequence[Sequence[float]] | None = None,
) -> tuple[Choice, list[tuple[str, int, int, int, int]]]:
    """The layout to launch: (node, ring stage, member, start, end) per runner in slot order, and why; for
    expert groups, each ring stage's expert map in the Choice's `owners` (cluster/experts.py:
    layout_owners: `owners`, the previous map over all layers, where it still serves, else by `load`).

    request.tensor_parallel (request.expert_parallel): None lets `choose` decide; 1 keeps the pipeline; k
    asks for tensor (expert) groups of k on max_stages (default 1) stages, on the first nodes in node order,
    and where they cannot be (too few machines after a loss, too little memory), `choose` decides and the
    reason says so."""
    forced, experts = _forced(request)
    kind = "expert groups" if experts else "groups"
    if forced is None:
        choice = choose(model, nodes, pipeline, link, request)
    elif forced == 1:
        base = estimate(model, nodes, len(pipeline.stages), 1, link, request, pipeline_ranges(pipeline))
        asked = "tensor_parallel" if request.tensor_parallel is not None else "expert_parallel"
        choice = Choice(len(pipeline.stages), 1, (base,), f"pipeline: asked for ({asked} 1)")
    else:
        stages = request.max_stages or 1
        c = estimate(model, nodes, stages, forced, link, request, experts=experts)
        if c.fits:
            why = f"{kind}: asked for; {c.describe()}"
            choice = Choice(stages, forced, (c,), why, experts=experts, heads=c.heads)
        else:  # a re-placement after a loss may have too few machines: the instance lives on as it can
            fallback = choose(model, nodes, pipeline, link, request)
            why = f"{stages} stage(s) x {kind} of {forced} asked for, not possible: {c.why_not}; "
            choice = replace(fallback, explanation=why + fallback.explanation)
            forced = None
    if choice.group == 1:
        runners = [(a.node_id, k, 0, a.start, a.end) for k, a in enumerate(pipeline.stages)]
        return choice, runners
    ranges = split_for_stages(model, choice.stages)
    if choice.experts:
        choice = replace(choice, owners=tuple(layout_owners(model, ranges, choice.group, owners, load)))
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
