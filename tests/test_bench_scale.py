"""`shardline bench scale`'s pure parts: node limits no single node fits the model in, and its report."""

from __future__ import annotations

import pytest

from shardline.bench.scale import (
    BENCH_SPEC,
    MOE_SPEC,
    REQUEST,
    _mode,
    _nodes_report,
    kv_bytes,
    node_limit,
    runner_bytes,
)
from shardline.cluster.messages import StageRecord
from shardline.cluster.parallelism import LOOPBACK, arrange
from shardline.cluster.placement import NodeCapacity, PlacementError, PlacementRequest, place
from shardline.models.footprint import footprint_from_dir
from shardline.models.synth import SynthSpec, weight_sizes, write_synth_model
from shardline.models.synth import footprint as synth_footprint

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("bits,dtype", [(4, "float16"), (4, "float32"), (0, "float32"), (8, "bfloat16")])
def test_the_footprint_helper_matches_a_written_model(tmp_path, bits, dtype):
    spec = SynthSpec(
        layers=3, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=320, bits=bits, dtype=dtype
    )
    written = footprint_from_dir(write_synth_model(tmp_path / "m", spec))
    assert written.model_copy(update={"name": "synth"}) == synth_footprint(spec)


@pytest.mark.parametrize("bits,dtype", [(4, "float32"), (0, "float32"), (8, "float16")])
def test_no_single_node_admits_the_bench_model_and_three_nodes_do(bits, dtype):
    spec = SynthSpec(**{**BENCH_SPEC.__dict__, "bits": bits, "dtype": dtype})
    fp = synth_footprint(spec)
    limit = node_limit(fp, REQUEST, nodes=3)
    assert fp.weight_bytes > limit  # model_bytes > largest_node_limit_bytes
    assert limit == int(0.5 * fp.weight_bytes) + kv_bytes(fp, REQUEST) + REQUEST.activation_bytes
    with pytest.raises(PlacementError):
        place(fp, [NodeCapacity("one", limit, 1.0)], REQUEST)
    placed = place(fp, [NodeCapacity(f"n{i}", limit, 1.0) for i in range(3)], REQUEST)
    assert len(placed.stages) >= 2 and all(a.need_bytes <= limit for a in placed.stages)
    assert sum(a.weight_bytes for a in placed.stages) == fp.weight_bytes
    if bits == 0:  # the float32 model is at least 3 GB, as the bench promises
        assert fp.weight_bytes >= 3e9


def test_limits_that_would_not_prove_anything_are_refused():
    fp = synth_footprint(SynthSpec(**{**BENCH_SPEC.__dict__, "bits": 4, "dtype": "float16", "layers": 8}))
    # A small model: its KV and activation headroom alone pass half its weights.
    with pytest.raises(ValueError, match="not below the weights"):
        node_limit(fp, REQUEST)
    small_headroom = PlacementRequest(sequences=1, reserve_tokens=256, activation_bytes=1 << 20)
    with pytest.raises(ValueError, match="cannot hold the model"):
        node_limit(fp, small_headroom, nodes=1, fraction=0.5)
    assert node_limit(fp, small_headroom, nodes=3) < fp.weight_bytes


def test_node_report_counts_runners_over_their_limit():
    fp = synth_footprint(BENCH_SPEC)
    caps = [NodeCapacity(f"n{i}", node_limit(fp, REQUEST), 1.0) for i in range(3)]
    placed = place(fp, caps, REQUEST)
    assert len(placed.stages) == 3
    runners = [StageRecord(node_id=a.node_id, start=a.start, end=a.end) for a in placed.stages]
    # A pipeline's runners count what placement's stages count, KV and headroom included.
    assert runner_bytes(fp, runners, REQUEST) == [(a.weight_bytes, a.need_bytes) for a in placed.stages]
    third = fp.weight_bytes // 3
    peaks = {"n0": {11: third // 2}, "n1": {12: 5 * third}, "n2": {13: third // 4, 14: third // 4}}
    nodes = _nodes_report(fp, runners, REQUEST, peaks, limit=2 * third)
    assert [n["rss_over_limit"] for n in nodes] == [False, True, False]
    assert nodes[2]["runner_peak_rss_bytes"] == 2 * (third // 4)
    assert nodes[0]["runners"] == [{"layers": [0, placed.stages[0].end], "member": 0}]
    assert sum(n["weight_bytes"] for n in nodes) == fp.weight_bytes
    assert _mode(runners) == "pipeline"


def test_the_moe_bench_model_outgrows_a_node_and_an_expert_group_of_three_holds_it():
    """The MoE bench model: no node of its limit holds it; placement keeps a 3-stage pipeline (groups of 2, 4
    or 8 do not arrange 3 machines); asked for expert groups of 3 (--ep 3), each member holds 16 of the 48
    experts and the attention whole, within the limit."""
    fp = synth_footprint(MOE_SPEC)
    assert fp.experts == 48 and fp.experts_active == 8 and fp.expert_split == ""
    assert 1.2e9 < fp.weight_bytes < 1.6e9
    limit = node_limit(fp, REQUEST, nodes=3)
    caps = [NodeCapacity(f"n{i}", limit, 1.0) for i in range(3)]
    pipeline = place(fp, caps, REQUEST)
    choice, laid = arrange(fp, caps, pipeline, LOOPBACK, REQUEST)
    assert choice.group == 1 and len(laid) == 3 and choice.explanation.startswith("pipeline")
    asked = REQUEST.model_copy(update={"expert_parallel": 3})
    choice, laid = arrange(fp, caps, pipeline, LOOPBACK, asked)
    assert choice.experts and choice.group == 3 and choice.explanation.startswith("expert groups: asked for")
    owners = [list(choice.owners[k]) if m == 0 else [] for _, k, m, _, _ in laid]
    runners = [
        StageRecord(node_id=n, start=s, end=e, member=m, expert_owners=o)
        for (n, _, m, s, e), o in zip(laid, owners, strict=True)
    ]
    assert _mode(runners) == "expert"
    nodes = _nodes_report(fp, runners, asked, {}, limit)
    assert [x["runners"][0]["experts_held_per_layer"] for x in nodes] == [16, 16, 16]
    assert all(x["placement_need_bytes"] <= limit for x in nodes)
    assert all(x["weight_bytes"] < fp.weight_bytes / 2 for x in nodes)  # a third of the experts


def test_weight_sizes_count_packed_weights_as_parameters(tmp_path):
    spec = SynthSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=320, bits=4)
    sizes = weight_sizes(write_synth_model(tmp_path / "m", spec))
    f32 = weight_sizes(
        write_synth_model(tmp_path / "f", SynthSpec(**{**spec.__dict__, "bits": 0, "dtype": "float32"}))
    )
    assert sizes["parameters"] == f32["parameters"] and sizes["float32_bytes"] == f32["stored_bytes"]
    assert sizes["stored_bytes"] < f32["stored_bytes"] / 3
