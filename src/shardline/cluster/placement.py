"""Placement: which node holds which contiguous range of a model's layers (footprints: models/footprint.py).

`place` is a pure function of a footprint, the nodes' reported capacities and a request; it never does I/O.

Cost model (relative, for comparing placements, not a latency prediction):
- a stage's time per decode step is the weight bytes it multiplies by (its layers, plus the head on the last
  stage: lm_head; a tied head, the embedding, is split half and half between the first and the last stage,
  as runners do), plus a fixed work-equivalent per layer for its other ops (norms, rope, attention,
  dispatch), / (compute_score * 1e9), i.e. one FLOP per weight byte;
- a split pipeline adds `hop_cost` to every stage (sending hidden states on), where hop_cost is
  `hop_cost_fraction` of the whole model's time on the fastest node, so extra stages are never free;
- a placement's step time is its slowest stage's: with one micro-batch per stage in flight, that stage bounds
  the rate of the whole pipeline.
Pipeline order is node_id order (predictable, stable when nodes join or leave); unneeded nodes are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from pydantic import BaseModel, ConfigDict, Field

from shardline.compute.kv import round_up
from shardline.compute.pipeline_limits import pipeline_refusal
from shardline.models.footprint import ModelFootprint

GB = 1e9  # decimal, as memory sizes are quoted ("a 36 GB machine")
DEFAULT_RESERVE_TOKENS = 4096


@dataclass(frozen=True)
class NodeCapacity:
    """What a node reports it can give one instance."""

    node_id: str
    available_bytes: int  # memory offered (already the --memory-limit share if one is set)
    compute_score: float  # relative speed: GFLOP/s of a short matmul
    read_bytes_per_s: float = 0.0  # measured memory read bandwidth (0: not measured)

    def __post_init__(self) -> None:
        if self.available_bytes < 0 or not (0 < self.compute_score < math.inf):
            raise ValueError(
                f"bad capacity for {self.node_id!r}: {self.available_bytes} B, score {self.compute_score}"
            )


class PlacementRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    reserve_tokens: int | None = Field(None, ge=1)  # KV per sequence; None: min(context, 4096)
    sequences: int = Field(4, ge=1)  # concurrent sequences to reserve KV for
    activation_bytes: int = Field(256 << 20, ge=0)  # scratch headroom per stage
    max_stages: int | None = Field(None, ge=1)
    hop_cost_fraction: float = Field(0.05, ge=0)  # see the module docstring
    # Runners per stage (cluster/parallelism.py): None lets placement choose; 1: pipeline stages only; k:
    # tensor-parallel groups of k, on max_stages (default 1) stages.
    tensor_parallel: int | None = Field(None, ge=1, le=64)
    # Expert-parallel groups of k (cluster/experts.py) as tensor_parallel asks for tensor groups; 1: pipeline.
    # Where both ask for groups, tensor_parallel's are made (cluster/parallelism.py: arrange).
    expert_parallel: int | None = Field(None, ge=1, le=64)


class StageAssignment(BaseModel):
    model_config = ConfigDict(frozen=True)

    node_id: str
    start: int
    end: int  # exclusive
    weight_bytes: int  # its layers, plus the embedding (first stage) and head (last stage) it holds
    kv_bytes: int
    need_bytes: int  # weight + KV + activation headroom; never above available_bytes
    available_bytes: int
    est_time: float  # relative seconds per decode step, hop included


class Placement(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    stages: list[StageAssignment]  # in pipeline order = layer order
    est_step_time: float  # the slowest stage's
    hop_cost: float  # added to each stage's time when split (0 on one stage)
    reserve_tokens: int  # per sequence, rounded up to the KV cache's allocation step
    sequences: int
    need_bytes: int  # all stages together
    unused_nodes: list[str]


class PlacementError(ValueError):
    """No placement fits; the message has the numbers (model need, each node's memory)."""

    def __init__(self, message: str, needed_bytes: int, available: dict[str, int]) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes  # the whole model on one stage
        self.available = dict(available)

    def __reduce__(self) -> tuple:  # picklable despite the extra constructor arguments
        return (type(self), (str(self), self.needed_bytes, self.available))


@dataclass(frozen=True)
class _Costs:
    """Memory and time of any layer range [s, e) for one model and request; O(1) each via prefix sums."""

    model: ModelFootprint
    prefix: list[int]
    kv_per_layer: int
    activation_bytes: int

    def weights(self, s: int, e: int) -> int:
        m = self.model
        w = self.prefix[e] - self.prefix[s] + (m.embed_bytes if s == 0 else 0)
        if e == m.layers:
            w += m.head_bytes + (m.embed_bytes if m.tied and s > 0 else 0)
        return w

    def need(self, s: int, e: int) -> int:  # grows with e: a stage that can't hold [s, e) can't hold more
        return self.weights(s, e) + self.kv_per_layer * (e - s) + self.activation_bytes

    def time(self, node: NodeCapacity, s: int, e: int) -> float:
        m = self.model
        work = self.prefix[e] - self.prefix[s] + m.layer_overhead_bytes * (e - s)
        if e == m.layers:
            work += m.head_bytes
        if m.tied and (s, e) == (0, m.layers):
            work += m.embed_bytes
        elif m.tied and (s == 0 or e == m.layers):
            work += m.embed_bytes / 2  # a tied head splits between the first and the last stage
        return work / (node.compute_score * 1e9)


def _min_bottleneck(c: _Costs, order: Sequence[NodeCapacity], kmax: int) -> float:
    """Least possible slowest-stage time over splits into 2..kmax stages, nodes in order (DP, O(N*K*L^2))."""
    n = c.model.layers
    best = [[math.inf] * (n + 1) for _ in range(kmax + 1)]  # best[k][i]: layers [0, i) on k stages
    best[0][0] = 0.0
    for node in order:
        for k in range(kmax - 1, -1, -1):  # downwards, so that this node extends only plans without it
            row, nxt = best[k], best[k + 1]
            for s in range(n):
                if row[s] < math.inf:
                    for e in range(s + 1, n + 1):
                        if c.need(s, e) > node.available_bytes:
                            break
                        if (s, e) != (0, n):
                            nxt[e] = min(nxt[e], max(row[s], c.time(node, s, e)))
    return min(best[k][n] for k in range(2, kmax + 1))


def _balanced(
    c: _Costs,
    order: Sequence[NodeCapacity],
    bound: float,
    keep: Mapping[str, tuple[int, int]] | None = None,
) -> list[tuple[NodeCapacity, int, int]]:
    """Among splits with every stage within `bound`: most ranges kept where `keep` asks (a node that already
    holds those layers), then fewest stages, then shares closest to proportional to speed (least sum of
    work * time, which is smallest when every stage takes equally long)."""
    keep = keep or {}
    n = c.model.layers
    # best[i]: (-kept, stages, energy, path) for layers [0, i)
    best: list[tuple[int, int, float, tuple] | None] = [None] * (n + 1)
    best[0] = (0, 0, 0.0, ())
    for node in order:
        for s in range(n - 1, -1, -1):  # downwards: writes go to e > s, never to a prefix read later
            if (here := best[s]) is None:
                continue
            for e in range(s + 1, n + 1):
                t = c.time(node, s, e)
                if c.need(s, e) > node.available_bytes or t > bound:
                    break
                if (s, e) == (0, n):
                    continue
                kept = here[0] - (keep.get(node.node_id) == (s, e))
                cand = (kept, here[1] + 1, here[2] + t * t * node.compute_score, (*here[3], (node, s, e)))
                if (old := best[e]) is None or cand[:3] < old[:3]:
                    best[e] = cand
    assert best[n] is not None, "bound came from a feasible split"
    return list(best[n][3])


def place(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    request: PlacementRequest | None = None,
    keep: Mapping[str, tuple[int, int]] | None = None,
    keep_slack: float = 0.25,
) -> Placement:
    """The placement with the fastest slowest stage (fewest stages on ties); raises PlacementError.

    keep: node -> layer range it holds already (survivors of a failed generation). Splits whose slowest stage
    is within `keep_slack` of the best are then preferred by how many of those ranges they keep: measured
    compute scores differ by noise, and a survivor that keeps its range keeps its process and weights."""
    request = PlacementRequest() if request is None else request
    if len({n.node_id for n in nodes}) != len(nodes):
        raise ValueError(f"duplicate node ids in {[n.node_id for n in nodes]}")
    order = sorted(nodes, key=lambda n: n.node_id)
    if keep:
        # Survivors where their layers are, the others where the first hole is: a node that left mid-ring
        # is replaced in the middle, not appended at the end (which would shift every range after it).
        held = sorted(r for node, r in keep.items() if any(x.node_id == node for x in nodes))
        hole, covered = 0, held
        for start, end in covered:
            if start > hole:
                break
            hole = max(hole, end)
        order.sort(key=lambda x: (keep[x.node_id][0] if x.node_id in keep else hole, x.node_id))
    tokens = round_up(request.reserve_tokens or min(model.context_length, DEFAULT_RESERVE_TOKENS))
    kv_layer = model.kv_bytes_per_token_per_layer * tokens * request.sequences
    c = _Costs(model, [0, *accumulate(model.layer_bytes)], kv_layer, request.activation_bytes)
    n = model.layers
    fastest = max(order, key=lambda x: x.compute_score, default=None)
    hop = request.hop_cost_fraction * c.time(fastest, 0, n) if fastest else 0.0
    singles = [(c.time(x, 0, n), x.node_id, x) for x in order if c.need(0, n) <= x.available_bytes]
    single = min(singles, default=None)
    # Architectures whose layers hand on more than hidden states run on one stage (compute/pipeline_limits).
    one_stage = pipeline_refusal(model.model_type, 2)
    kmax = 1 if one_stage else min(len(order), n, request.max_stages or n)
    bottleneck = _min_bottleneck(c, order, kmax) if kmax >= 2 else math.inf
    if single is not None and single[0] <= bottleneck + hop:
        stages, hop = [(single[2], 0, n)], 0.0
    elif bottleneck < math.inf:
        stages = _balanced(c, order, bottleneck * (1 + keep_slack) if keep else bottleneck, keep)
    else:
        error = _no_fit(c, order, request, tokens, kmax)
        if one_stage:
            error.args = (f"{error.args[0]}; {one_stage}", *error.args[1:])
        raise error
    assignments = [
        StageAssignment(
            node_id=x.node_id,
            start=s,
            end=e,
            weight_bytes=c.weights(s, e),
            kv_bytes=kv_layer * (e - s),
            need_bytes=c.need(s, e),
            available_bytes=x.available_bytes,
            est_time=c.time(x, s, e) + hop,
        )
        for x, s, e in stages
    ]
    used = {a.node_id for a in assignments}
    return Placement(
        model=model.name,
        stages=assignments,
        est_step_time=max(a.est_time for a in assignments),
        hop_cost=hop,
        reserve_tokens=tokens,
        sequences=request.sequences,
        need_bytes=sum(a.need_bytes for a in assignments),
        unused_nodes=[x.node_id for x in order if x.node_id not in used],
    )


def split_for_stages(model: ModelFootprint, stages: int) -> list[tuple[int, int]]:
    """Exactly `stages` contiguous layer ranges for equal, unbounded stages (one machine's cores), the slowest
    stage as fast as it can be: the stages holding the head get fewer layers. Ties go to the earliest cuts."""
    n = model.layers
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    c = _Costs(model, [0, *accumulate(model.layer_bytes)], 0, 0)
    node = NodeCapacity("equal", 0, 1.0)
    # best[k][e]: (slowest stage, cuts) for layers [0, e) on k stages
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    for k in range(1, stages + 1):
        row: dict[int, tuple[float, tuple[int, ...]]] = {}
        for e in range(k, n - (stages - k) + 1):
            row[e] = min(
                (max(t, c.time(node, s, e)), (*cuts, s)) for s, (t, cuts) in best[k - 1].items() if s < e
            )
        best.append(row)
    bounds = [*best[stages][n][1][1:], n]
    return list(zip([0, *bounds[:-1]], bounds, strict=True))


def preview(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], request: PlacementRequest | None = None
) -> Placement | PlacementError:
    """place(), returning the PlacementError instead of raising it (for dashboards and dry runs)."""
    try:
        return place(model, nodes, request)
    except PlacementError as e:
        return e


def _most_layers(c: _Costs, node: NodeCapacity) -> int:
    """The longest layer range this node could hold as some stage (0 if none)."""
    n, most = c.model.layers, 0
    for s in range(n):
        for e in range(s + most + 1, n + 1):
            if c.need(s, e) > node.available_bytes:
                break
            most = e - s
    return most


def _no_fit(
    c: _Costs, order: Sequence[NodeCapacity], request: PlacementRequest, tokens: int, kmax: int
) -> PlacementError:
    m, n = c.model, c.model.layers
    need, offered = c.need(0, n), sum(x.available_bytes for x in order)
    head = (
        f"{m.name} needs {need / GB:.2f} GB (weights {c.weights(0, n) / GB:.2f} GB + KV "
        f"{c.kv_per_layer * n / GB:.2f} GB for {request.sequences} x {tokens} tokens + activations "
        f"{c.activation_bytes / GB:.2f} GB per stage)"
    )
    if not order:
        return PlacementError(f"{head} but the cluster has no nodes", need, {})
    if offered < need:
        why = f"but the cluster offers {offered / GB:.2f} GB"
    else:
        why = (
            f"and the cluster offers {offered / GB:.2f} GB in all, but no split into at most {kmax} "
            "contiguous stages fits"
        )
    nodes = ", ".join(
        f"{x.node_id} {x.available_bytes / GB:.2f} GB (holds at most {_most_layers(c, x)} of {n} layers)"
        for x in order
    )
    return PlacementError(f"{head} {why}: {nodes}", need, {x.node_id: x.available_bytes for x in order})
