"""Placement of expert-parallel groups: the expert maps, the estimate that chooses them, the plumbing."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from shardline.cluster import experts as ex
from shardline.cluster import layouts
from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.parallelism import (
    ETHERNET_1G,
    LOOPBACK,
    Choice,
    LinkFigures,
    arrange,
    choose,
    estimate,
)
from shardline.cluster.placement import NodeCapacity, PlacementRequest, place
from shardline.models.footprint import NO_EXPERTS, ModelFootprint, footprint_from_dir
from shardline.testing import arch_zoo

SLOW_LINK = LinkFigures(rtt_s=3e-3, bytes_per_s=30e6)
READ = 10e9


LATENT = "layers hold tensors a tensor-parallel group does not split (self_attn.embed_q)"


def moe_footprint(
    layers: int = 48, experts: int = 128, active: int = 8, dense: int = 0, latent: bool = False
) -> ModelFootprint:
    """Qwen3-30B-A3B's shapes at 4 bits (0.5625 bytes a weight with its scales): 128 experts of 768 columns,
    8 routed a token, 32 query and 4 key/value heads of 128; the first `dense` layers dense. `latent`: its
    attention does not split by heads (as deepseek's latent attention), so no tensor group can split it."""
    hidden, bpw = 2048, 0.5625
    routed = int(experts * 3 * hidden * 768 * bpw)
    attention = int((hidden * 32 * 128 * 2 + hidden * 4 * 128 * 2) * bpw) + experts * hidden * 2
    mlp = int(3 * hidden * 6144 * bpw)
    return ModelFootprint(
        name="qwen3-moe",
        layers=layers,
        layer_bytes=[attention + (mlp if i < dense else routed) for i in range(layers)],
        embed_bytes=int(151936 * hidden * bpw),
        head_bytes=int(151936 * hidden * bpw),
        tied=False,
        kv_bytes_per_token_per_layer=2 * 4 * 128 * 2,
        context_length=40960,
        hidden_size=hidden,
        vocab_size=151936,
        layer_overhead_bytes=1 << 20,
        heads=32,
        kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        quant_group=64,
        tensor_split=LATENT if latent else "",
        expert_columns=768,
        model_type="qwen3_moe",
        experts=experts,
        experts_active=active,
        expert_bytes=[0 if i < dense else routed for i in range(layers)],
        shared_expert_bytes=[0] * layers,
        expert_split="",
    )


def nodes(n: int, gb: float) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", int(gb * 1e9), 100.0, READ) for i in range(n)]


def decide(fp: ModelFootprint, count: int, gb: float, link: LinkFigures) -> Choice:
    caps, request = nodes(count, gb), PlacementRequest()
    return choose(fp, caps, place(fp, caps, request), link, request)


# ---- the maps ------------------------------------------------------------------------------------------


def test_by_bytes_is_contiguous_equal_blocks_and_says_why_not():
    assert ex.owners_by_bytes(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ex.owners_by_bytes(8, 1) == [0] * 8
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        ex.owners_by_bytes(8, 3)
    assert "cannot give each of 4" in ex.split_refusal(2, 4)


@settings(max_examples=200, deadline=None)
@given(
    hs.sampled_from([(4, 2), (8, 2), (8, 4), (16, 4), (64, 8), (12, 3)]).flatmap(
        lambda ek: hs.tuples(
            hs.just(ek[1]), hs.lists(hs.floats(0, 1e6, allow_nan=False), min_size=ek[0], max_size=ek[0])
        )
    )
)
def test_by_load_owns_every_expert_once_in_equal_counts_never_busier_than_blocks(case):
    members, freq = case
    owners = ex.owners_by_load(freq, members)
    assert len(owners) == len(freq) and all(0 <= m < members for m in owners)
    assert [owners.count(m) for m in range(members)] == [len(freq) // members] * members  # equal bytes
    blocks = ex.owners_by_bytes(len(freq), members)
    assert max(ex.member_loads(owners, freq, members)) <= max(ex.member_loads(blocks, freq, members))


def test_load_spreads_hot_experts_where_blocks_pile_them_on_one_member():
    freq = [100.0] * 4 + [1.0] * 12  # the first four experts take most tokens
    blocks = ex.owners_by_bytes(16, 4)
    spread = ex.owners_by_load(freq, 4)
    assert max(ex.member_loads(blocks, freq, 4)) == 400
    assert max(ex.member_loads(spread, freq, 4)) == 103  # one hot expert and three cold ones each
    with pytest.raises(ValueError, match="finite"):
        ex.owners_by_load([1.0, math.nan], 2)


@pytest.mark.parametrize(("experts", "active", "members"), [(4, 2, 2), (8, 3, 2), (8, 2, 4), (12, 4, 3)])
def test_expected_max_share_is_exact(experts: int, active: int, members: int):
    blocks = ex.owners_by_bytes(experts, members)
    sets = list(itertools.combinations(range(experts), active))
    busiest = sum(max(sum(blocks[e] == m for e in s) for m in range(members)) for s in sets)
    assert ex.expected_max_share(experts, active, members) == pytest.approx(busiest / len(sets) / active)


def test_expected_max_share_falls_with_members_and_is_whole_alone():
    assert ex.expected_max_share(4, 2, 2) == pytest.approx(2 / 3)
    assert ex.expected_max_share(128, 8, 1) == 1.0
    shares = [ex.expected_max_share(128, 8, k) for k in (2, 4, 8)]
    assert 1.0 > shares[0] > shares[1] > shares[2] > 1 / 8


def test_stage_maps_skip_dense_layers_use_measured_load_and_survive_a_recovery():
    fp = moe_footprint(layers=4, experts=8, dense=1)
    assert ex.stage_owners(fp, 0, 2, 2) == [[], [0, 0, 0, 0, 1, 1, 1, 1]]
    load = [[], [8.0, 7, 6, 5, 0, 0, 0, 0], [], []]
    by_load = ex.stage_owners(fp, 0, 4, 2, load)
    assert by_load[1] != ex.owners_by_bytes(8, 2) and by_load[2] == ex.owners_by_bytes(8, 2)
    # A recovery keeps the map it had, cut at the new stages' ranges; another group size gets a new one.
    previous = [list(r) for r in by_load]
    assert ex.layout_owners(fp, [(0, 2), (2, 4)], 2, previous) == [previous[:2], previous[2:]]
    assert ex.layout_owners(fp, [(0, 4)], 4, previous) == [ex.stage_owners(fp, 0, 4, 4)]
    # Measured routing that makes the busiest member clearly less busy announces a new map.
    blocks = ex.stage_owners(fp, 0, 4, 2)
    assert ex.layout_owners(fp, [(0, 4)], 2, blocks, load) == [by_load]
    assert ex.model_owners([(2, 4, previous[2:]), (0, 2, previous[:2])]) == previous
    assert ex.model_owners([(0, 4, [])]) == []


# ---- the estimate --------------------------------------------------------------------------------------


def test_a_latent_attention_moe_over_two_nodes_on_loopback_is_one_expert_group_and_says_why():
    choice = decide(moe_footprint(latent=True), 2, 12.0, LOOPBACK)
    assert (choice.stages, choice.group, choice.experts) == (1, 2, True), choice.explanation
    assert choice.explanation.startswith(
        "expert groups: 1 stage x expert groups (attention whole) of 2 decode one stream"
    )
    assert "64 of every MoE layer's 128 experts and the attention whole" in choice.explanation
    assert "2 stages (pipeline): " in choice.explanation
    # Tensor groups of the same machines are costed too and said why they are out: the attention.
    tensor = next(c for c in choice.candidates if c.group == 2 and not c.experts)
    assert tensor.why_not == LATENT
    assert f"1 stage x groups of 2: {tensor.token_s * 1e3:.2f} ms" in choice.explanation


def test_where_attention_splits_tensor_groups_read_less_and_are_made():
    """Every expert split by columns reads 1/k of a token's experts; an expert group's busiest member reads
    63% of them (`bench moe` measured tensor groups of 2 at 1.6x expert groups of 2 on loopback): placement
    makes tensor groups, and costs the expert groups with attention split by heads, their faster arrangement
    where the link is fast."""
    choice = decide(moe_footprint(), 2, 12.0, LOOPBACK)
    assert (choice.stages, choice.group, choice.experts) == (1, 2, False), choice.explanation
    expert = next(c for c in choice.candidates if c.group == 2 and c.experts)
    assert expert.fits and expert.heads and expert.token_s > choice.candidates[1].token_s
    assert "1 stage x expert groups (attention by heads) of 2" in choice.explanation
    tensor = next(c for c in choice.candidates if c.group == 2 and not c.experts)
    assert tensor.sums_s == pytest.approx(expert.sums_s)  # two a layer either way


def test_four_nodes_make_two_stages_of_expert_groups_where_the_replicated_attention_and_kv_allow():
    fp = moe_footprint(latent=True)
    choice = decide(fp, 4, 6.5, LOOPBACK)
    assert (choice.stages, choice.group, choice.experts) == (2, 2, True), choice.explanation
    assert "2 stages x expert groups (attention whole) of 2 decode one stream" in choice.explanation
    # One group of four would read less, but every member would hold the whole attention and its KV.
    four = next(c for c in choice.candidates if c.group == 4 and c.experts)
    assert not four.fits and "needs" in four.why_not
    assert decide(fp, 4, 9.0, LOOPBACK).group == 4  # where they fit, it does


@pytest.mark.parametrize("count", [2, 4])
def test_slow_links_keep_the_pipeline(count: int):
    gb = 12.0 if count == 2 else 6.5
    for link in (ETHERNET_1G, SLOW_LINK):
        choice = decide(moe_footprint(latent=True), count, gb, link)
        assert choice.group == 1 and not choice.experts, choice.explanation
        assert "expert groups (attention whole) of 2" in choice.explanation


def test_an_expert_group_is_charged_its_busiest_members_share_and_one_sum_a_moe_layer():
    fp = moe_footprint(layers=8, dense=2, latent=True)
    pipeline = estimate(fp, nodes(1, 64), 1, 1, LOOPBACK, PlacementRequest())
    grouped = estimate(fp, nodes(2, 64), 1, 2, LOOPBACK, PlacementRequest(), experts=True)
    assert (
        grouped.fits
        and grouped.experts
        and grouped.describe().startswith("1 stage x expert groups (attention whole) of 2")
    )
    share = ex.expected_max_share(128, 8, 2)
    routed = fp.expert_bytes[-1] * 8 / 128
    saved = 6 * (1 - share) * routed / READ  # six MoE layers, each reading the busiest member's share
    assert pipeline.compute_s - grouped.compute_s == pytest.approx(saved)
    per_sum = LOOPBACK.rtt_s + 2 * fp.hidden_size * 4 / LOOPBACK.bytes_per_s + 60e-6
    assert grouped.sums_s == pytest.approx(6 * per_sum)
    refused = estimate(fp, nodes(3, 64), 1, 3, LOOPBACK, PlacementRequest(), experts=True)
    assert not refused.fits and "do not split evenly over 3" in refused.why_not


def test_a_dense_model_gets_no_expert_candidates():
    fp = moe_footprint(layers=8, dense=8).model_copy(
        update={"experts": 0, "experts_active": 0, "expert_bytes": [], "expert_split": NO_EXPERTS}
    )
    choice = decide(fp, 2, 64, LOOPBACK)
    assert not any(c.experts for c in choice.candidates) and "expert" not in choice.explanation


def test_the_request_forces_expert_groups_as_it_forces_tensor_groups():
    fp = moe_footprint()
    caps, request = nodes(4, 64), PlacementRequest(expert_parallel=2, max_stages=2)
    choice, runners = arrange(fp, caps, place(fp, caps, request), SLOW_LINK, request)
    assert (choice.stages, choice.group, choice.experts) == (2, 2, True)
    assert choice.explanation.startswith(
        "expert groups: asked for; 2 stages x expert groups (attention whole) of 2"
    )
    assert [(n, s, m) for n, s, m, _, _ in runners] == [
        ("n0", 0, 0),
        ("n2", 1, 0),
        ("n1", 0, 1),
        ("n3", 1, 1),
    ]
    assert [len(o) for o in choice.owners] == [e - s for _, _, m, s, e in runners if m == 0]
    assert choice.owners[0][0] == ex.owners_by_bytes(128, 2)
    # Too few machines: the instance lives on as it can, and the reason says so.
    choice, _ = arrange(fp, caps[:3], place(fp, caps[:3], request), SLOW_LINK, request)
    assert choice.explanation.startswith("2 stage(s) x expert groups of 2 asked for, not possible: needs 4")
    pipeline = PlacementRequest(expert_parallel=1)
    assert arrange(fp, caps, place(fp, caps, pipeline), LOOPBACK, pipeline)[0].group == 1
    both = PlacementRequest(tensor_parallel=2, expert_parallel=2, max_stages=2)
    # The older field's groups where both are asked for: tensor groups, every expert split by columns.
    choice, _ = arrange(fp, caps, place(fp, caps, both), LOOPBACK, both)
    assert (choice.stages, choice.group, choice.experts) == (2, 2, False), choice.explanation
    # Columns that would split quantization groups do not split.
    odd = fp.model_copy(update={"expert_columns": 96})
    assert "do not split 2 ways" in estimate(odd, caps, 1, 2, LOOPBACK, PlacementRequest()).why_not


# ---- the footprint's figures ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_footprints_of_tiny_moe_models(tmp_path: Path):
    qwen = footprint_from_dir(arch_zoo.write("qwen3_moe", tmp_path / "qwen3_moe"))
    assert (qwen.experts, qwen.experts_active, qwen.expert_split) == (4, 2, "")
    assert qwen.expert_bytes == [3 * 4 * 32 * 64 * 4] * 4  # gate, up, down: 4 experts of 32 x 64 float32
    assert qwen.shared_expert_bytes == [0] * 4 and qwen.moe_layers(0, 4) == 4
    assert (qwen.tensor_split, qwen.expert_columns) == ("", 32)  # its experts split by columns too
    deepseek = footprint_from_dir(arch_zoo.write("deepseek_v3", tmp_path / "deepseek_v3"))
    assert (deepseek.experts, deepseek.experts_active, deepseek.expert_split) == (4, 2, "")
    assert deepseek.expert_bytes == [0] + [3 * 4 * 32 * 64 * 4] * 3  # first_k_dense_replace: 1
    assert deepseek.shared_expert_bytes == [0] + [3 * 32 * 64 * 4] * 3
    assert "self_attn.embed_q" in deepseek.tensor_split  # latent attention does not split by heads
    dense = footprint_from_dir(arch_zoo.write("llama", tmp_path / "llama"))
    assert (dense.experts, dense.expert_bytes, dense.expert_split) == (0, [], NO_EXPERTS)
    # An old report without the figures stays valid and never forms expert groups.
    old = ModelFootprint.model_validate(
        {k: v for k, v in qwen.model_dump().items() if not k.startswith(("expert", "shared_expert"))}
    )
    assert old.expert_split and old.expert_at(0) == 0


# ---- the plumbing --------------------------------------------------------------------------------------

FP = moe_footprint(layers=8, experts=8, active=2, dense=1)
RES = cm.Resources(memory_total=64 << 30, memory_available=32 << 30, compute_score=50.0, device="cpu", cpus=2)


def master() -> ms.MasterState:
    s = cs.ClusterState(me="a")
    for n in "abcd":
        report = cm.NodeReport(
            node_id=n,
            name=n,
            endpoint="tcp/127.0.0.1:7447",
            started_at=0.0,
            resources=RES,
            models={"m": cm.LocalModel(full=True, footprint=FP, digest="d" * 64)},
        )
        s, _ = cs.apply(s, cs.Alive(n))
        s, _ = cs.apply(s, cs.ReportIn(report, at=0.0))
    return ms.initial(ms.MasterConfig(me="a"), 1, ms.snapshot(s, 0.0, 1000.0))


@pytest.mark.timeout(30)
def test_the_map_reaches_every_member_and_survives_a_recovery_unless_routing_is_measured():
    request = PlacementRequest(sequences=1, reserve_tokens=64, expert_parallel=2, max_stages=2)
    s = master()
    s, out = ms.apply(s, ms.QueryIn(0, cm.Place(model="m", request=request, dry_run=True), at=1.0))
    dry = next(c for c in out if isinstance(c, ms.Reply)).reply
    assert dry.layout.startswith("expert groups: asked for") and len(dry.runners) == 4
    assert [len(r.expert_owners) for r in dry.runners] == [
        r.end - r.start if not r.member else 0 for r in dry.runners
    ]
    s, out = ms.apply(s, ms.QueryIn(1, cm.Place(model="m", request=request), salt="x", at=1.0))
    instance = next(c for c in out if isinstance(c, ms.Reply)).reply.instance.instance
    stages, launches, _ = layouts.layout(s, instance, 0, keep={}, avoid=set())
    specs = [x.spec for _, x in launches]
    # Every member runs its face's map: layer 0 is dense, each MoE layer in two contiguous blocks.
    assert [sp.expert_owners for sp in specs] == [
        ex.stage_owners(FP, sp.layer_start, sp.layer_end, 2) for sp in specs
    ]
    assert specs[0].expert_owners[0] == [] and specs[0].expert_owners[1] == ex.owners_by_bytes(8, 2)
    s, _ = ms.apply(s, ms.Laid(instance, 0, stages))
    assert layouts.expert_map(s.records[instance]) == ex.stage_owners(FP, 0, 8, 2)
    # A recovery rebuilds the same map, even one placement would not make anew.
    custom = [[], *([[1, 0] * 4] * 7)]
    kept = [
        st.model_copy(update={"expert_owners": custom[st.start : st.end] if not st.member else []})
        for st in stages
    ]
    s, _ = ms.apply(s, ms.Laid(instance, 0, tuple(kept)))
    _, launches, _ = layouts.layout(s, instance, 1, keep={}, avoid=set())
    assert launches[0][1].spec.expert_owners + launches[1][1].spec.expert_owners == custom
    # Measured routing that the kept map serves badly announces a new one.
    load = [[], *([[9.0, 0, 9, 0, 0, 0, 0, 0]] * 7)]
    rec = s.records[instance].model_copy(update={"expert_load": load})
    s = dataclasses.replace(s, records={**s.records, instance: rec})
    _, launches, _ = layouts.layout(s, instance, 2, keep={}, avoid=set())
    remapped = launches[0][1].spec.expert_owners + launches[1][1].spec.expert_owners
    assert remapped == ex.stage_owners(FP, 0, 8, 2, load) and remapped != custom


def test_measured_load_gathers_each_faces_rows_by_model_layer() -> None:
    from shardline.cluster.experts import measured_load

    # Two stages' faces: layers [0, 2) and [2, 4); a dense layer reports [].
    got = measured_load([(2, [[5, 1], []]), (0, [[1, 2], [3, 4]])])
    assert got == [[1.0, 2.0], [3.0, 4.0], [5.0, 1.0]]  # up to the last layer measured
    assert measured_load([]) == []
