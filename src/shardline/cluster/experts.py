"""Which member of an expert-parallel group holds each routed expert, and what a member reads: pure functions.

An expert group of k runners holds a stage's attention whole on every member and each MoE layer's routed
experts spread over the members, whole, E/k each (compute/expert_parallel.py runs it). The map is a list per
layer of the stage ([] for a dense layer) giving each expert's member. By bytes, the experts go in contiguous
equal blocks; by measured routing load, the hottest experts go to different members (equal counts either
way, so every member holds the same bytes: all experts of a layer are the same size).

A token reads the experts it routes to. Under uniform routing the members hold its `active` experts by a
multivariate hypergeometric draw, and the group waits for the busiest member: `expected_max_share` is that
member's expected share of the token's expert reads, which the placement estimate (cluster/parallelism.py)
charges each member.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from shardline.models.footprint import ModelFootprint

PIPELINE, TENSOR, EXPERT = "pipeline", "tensor", "expert"
# A recovery keeps the instance's map unless measured routing makes the busiest member this much less busy:
# a new map moves experts between machines, which costs their weights' load.
REMAP_GAIN = 0.1


def split_refusal(experts: int, members: int) -> str:
    """Why `experts` routed experts do not spread evenly over `members`, or ""."""
    if members < 1:
        return f"a group of {members} members"
    if experts < members:
        return f"{experts} experts a layer cannot give each of {members} members one"
    if experts % members:
        return f"{experts} experts a layer do not split evenly over {members} members"
    return ""


def owners_by_bytes(experts: int, members: int) -> list[int]:
    """Contiguous equal blocks: expert i to member i // (experts / members). Raises ValueError."""
    if why := split_refusal(experts, members):
        raise ValueError(why)
    per = experts // members
    return [i // per for i in range(experts)]


def member_loads(owners: Sequence[int], freq: Sequence[float], members: int) -> list[float]:
    loads = [0.0] * members
    for expert, member in enumerate(owners):
        loads[member] += freq[expert]
    return loads


def owners_by_load(freq: Sequence[float], members: int) -> list[int]:
    """Hot experts spread: by falling frequency, each expert to the least-loaded member that has room (equal
    counts per member); never busier at its busiest member than the contiguous blocks. Raises ValueError."""
    experts = len(freq)
    blocks = owners_by_bytes(experts, members)
    if any(not (math.isfinite(f) and f >= 0) for f in freq):
        raise ValueError("routing frequencies must be finite and >= 0")
    per = experts // members
    owners = [0] * experts
    loads, counts = [0.0] * members, [0] * members
    for expert in sorted(range(experts), key=lambda e: (-freq[e], e)):
        member = min((m for m in range(members) if counts[m] < per), key=lambda m: (loads[m], m))
        owners[expert] = member
        loads[member] += freq[expert]
        counts[member] += 1
    # Summed in one order for both, so that equal loads compare equal.
    if max(member_loads(owners, freq, members)) <= max(member_loads(blocks, freq, members)):
        return owners
    return blocks


def stage_owners(
    fp: ModelFootprint,
    start: int,
    end: int,
    members: int,
    load: Sequence[Sequence[float]] | None = None,
) -> list[list[int]]:
    """The map of layers [start, end) for a group of `members`: by measured load where `load` (per model
    layer, [] where unmeasured) has the layer's experts, else by bytes. Raises ValueError."""
    out: list[list[int]] = []
    for layer in range(start, end):
        if not fp.expert_at(layer):
            out.append([])
            continue
        measured = load[layer] if load is not None and layer < len(load) else []
        if len(measured) == fp.experts and sum(measured) > 0:
            out.append(owners_by_load(measured, members))
        else:
            out.append(owners_by_bytes(fp.experts, members))
    return out


def fits(owners: Sequence[Sequence[int]], fp: ModelFootprint, members: int) -> bool:
    """Whether a map over all of the model's layers (an instance's record) serves a group of `members`."""
    if len(owners) != fp.layers:
        return False
    for layer, row in enumerate(owners):
        if not fp.expert_at(layer):
            if row:
                return False
            continue
        if len(row) != fp.experts or any(not 0 <= m < members for m in row):
            return False
        if any(row.count(m) != fp.experts // members for m in range(members)):
            return False
    return True


def layout_owners(
    fp: ModelFootprint,
    ranges: Sequence[tuple[int, int]],
    members: int,
    previous: Sequence[Sequence[int]] = (),
    load: Sequence[Sequence[float]] | None = None,
) -> list[list[list[int]]]:
    """Each stage's map: the previous one over all layers (a recovery rebuilds the same map) where it serves
    this group size and measured `load` does not make a clearly better one (REMAP_GAIN), else a new one by
    load or bytes. Raises ValueError."""
    whole = [list(r) for r in previous]
    if not fits(whole, fp, members):
        whole = stage_owners(fp, 0, fp.layers, members, load)
    elif load is not None and any(load):  # measured routing may announce a new map, if it is clearly better
        by_load = stage_owners(fp, 0, fp.layers, members, load)
        if busiest(by_load, load, members) <= busiest(whole, load, members) * (1 - REMAP_GAIN):
            whole = by_load
    return [whole[s:e] for s, e in ranges]


def busiest(owners: Sequence[Sequence[int]], load: Sequence[Sequence[float]], members: int) -> float:
    """The busiest member's routed tokens, summed over the layers whose load was measured."""
    total = 0.0
    for row, freq in zip(owners, load, strict=False):
        if row and len(freq) == len(row):
            total += max(member_loads(row, freq, members))
    return total


def model_owners(stages: Sequence[tuple[int, int, list[list[int]]]]) -> list[list[int]]:
    """The map over all layers from stages' (start, end, map) in any order; [] when no stage has one."""
    if not any(owners for _, _, owners in stages):
        return []
    out: list[list[int]] = []
    for _, _, owners in sorted(stages, key=lambda x: x[0]):
        out.extend(list(r) for r in owners)
    return out


def expected_max_share(experts: int, active: int, members: int) -> float:
    """E[the most of a token's `active` experts any one member holds] / active, for `experts` experts in
    equal blocks over `members` and a uniformly random set of active experts (exact: the multivariate
    hypergeometric distribution, by counting the sets where no member holds more than m)."""
    if members <= 1 or active <= 0:
        return 1.0
    if why := split_refusal(experts, members):
        raise ValueError(why)
    if not 0 < active <= experts:
        raise ValueError(f"{active} active experts of {experts}")
    per = experts // members
    total = math.comb(experts, active)
    expected = Fraction(0)
    for m in range(min(per, active)):  # E[max] = sum over m >= 0 of P(max > m)
        at_most_m = _sets_with_at_most(m, per, members, active)
        expected += 1 - Fraction(at_most_m, total)
    return float(expected / active)


def _sets_with_at_most(m: int, per: int, members: int, active: int) -> int:
    """Sets of `active` experts with at most m in each member's block of `per`: [x^active] of
    (sum_{j<=m} C(per, j) x^j) ^ members."""
    block = [math.comb(per, j) for j in range(min(m, per) + 1)]
    poly = [1]
    for _ in range(members):
        nxt = [0] * min(len(poly) + len(block) - 1, active + 1)
        for i, a in enumerate(poly):
            for j, b in enumerate(block):
                if i + j <= active:
                    nxt[i + j] += a * b
        poly = nxt
    return poly[active] if active < len(poly) else 0


def layer_reads(fp: ModelFootprint, layer: int, mode: str, members: int) -> float:
    """Weight bytes one member reads for one token of one stream in `layer`: a dense layer whole (a tensor
    group's member 1/k of it); a MoE layer its replicated part and the token's experts (expected, uniform
    routing): all of them in a pipeline, 1/k in a tensor group (every expert split by columns), the busiest
    member's share in an expert group, whose shared experts split by columns."""
    total, routed, shared = fp.layer_bytes[layer], fp.expert_at(layer), fp.shared_at(layer)
    active = routed * fp.experts_active / fp.experts if routed and fp.experts else 0.0
    rest = total - routed - shared
    if mode == TENSOR:
        return (rest + shared + active) / members
    if mode == EXPERT and routed:
        share = expected_max_share(fp.experts, fp.experts_active, members)
        return rest + shared / members + share * active
    return rest + shared + active


def layer_memory(fp: ModelFootprint, layer: int, mode: str, members: int) -> float:
    """Weight bytes one member holds of `layer`."""
    total, routed, shared = fp.layer_bytes[layer], fp.expert_at(layer), fp.shared_at(layer)
    if mode == TENSOR:
        return total / members
    if mode == EXPERT and routed:
        return total - routed - shared + (routed + shared) / members
    return float(total)


def measured_load(faces: Sequence[tuple[int, Sequence[Sequence[int]]]]) -> list[list[float]]:
    """Tokens routed to each expert per model layer ([] where unmeasured), from expert groups' faces'
    reports: (the face's first layer, its heartbeat's `routed` rows)."""
    by_layer: dict[int, list[float]] = {}
    for start, rows in faces:
        for i, row in enumerate(rows):
            if row:
                by_layer[start + i] = [float(x) for x in row]
    return [by_layer.get(i, []) for i in range(max(by_layer, default=-1) + 1)]
