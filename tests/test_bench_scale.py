"""`shardline bench scale`'s pure parts: node limits no single node fits the model in, and its report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardline.bench.scale import BENCH_SPEC, REQUEST, _nodes_report, kv_bytes, node_limit
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
    stages = [
        SimpleNamespace(node_id="n0", start=0, end=10, weight_bytes=300, need_bytes=400),
        SimpleNamespace(node_id="n1", start=10, end=20, weight_bytes=300, need_bytes=400),
        SimpleNamespace(node_id="n2", start=20, end=32, weight_bytes=400, need_bytes=500),
    ]
    peaks = {"n0": {11: 450}, "n1": {12: 700}, "n2": {13: 100, 14: 200}}
    nodes = _nodes_report(SimpleNamespace(stages=stages), peaks, limit=600, weights=1000)
    assert [n["rss_over_limit"] for n in nodes] == [False, True, False]
    assert nodes[2]["runner_peak_rss_bytes"] == 300 and nodes[2]["weight_share"] == 0.4
    assert nodes[0]["layers"] == [0, 10]


def test_weight_sizes_count_packed_weights_as_parameters(tmp_path):
    spec = SynthSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=320, bits=4)
    sizes = weight_sizes(write_synth_model(tmp_path / "m", spec))
    f32 = weight_sizes(
        write_synth_model(tmp_path / "f", SynthSpec(**{**spec.__dict__, "bits": 0, "dtype": "float32"}))
    )
    assert sizes["parameters"] == f32["parameters"] and sizes["float32_bytes"] == f32["stored_bytes"]
    assert sizes["stored_bytes"] < f32["stored_bytes"] / 3
