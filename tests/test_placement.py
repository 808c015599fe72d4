"""Placement: footprints read from model directories, and place() checked against brute force."""

from __future__ import annotations

import itertools
import json
import pickle
import random
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from shardline.cluster.placement import (
    GB,
    NodeCapacity,
    Placement,
    PlacementError,
    PlacementRequest,
    place,
    preview,
    split_for_stages,
)
from shardline.models.errors import CorruptModelError
from shardline.models.footprint import ModelFootprint, footprint_from_dir

U = 10**8  # hypothesis sizes are in units of 0.1 GB, so messages show non-zero GB figures
G = 10**9
TINY = PlacementRequest(reserve_tokens=256, sequences=1, activation_bytes=U)


def synthetic(
    layers: int, layer_gb: float, kv: int = 0, head_gb: float = 0.0, **kw: object
) -> ModelFootprint:
    fields: dict = dict(
        name="synthetic",
        layers=layers,
        layer_bytes=[int(layer_gb * G)] * layers,
        embed_bytes=int(head_gb * G),
        head_bytes=int(head_gb * G),
        tied=False,
        kv_bytes_per_token_per_layer=kv,
        context_length=131072,
        hidden_size=8192,
        vocab_size=128256,
    )
    return ModelFootprint(**{**fields, **kw})


def sizes(placement: Placement) -> dict[str, int]:
    return {s.node_id: s.end - s.start for s in placement.stages}


# ---- footprints -------------------------------------------------------------------------------------------


def tensor_bytes(model_dir: Path) -> int:
    """Independent of the header offsets: shape x dtype size, through the safetensors library."""
    itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1}
    total = 0
    for path in model_dir.glob("model*.safetensors"):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * itemsize[t.get_dtype()]
    return total


@pytest.mark.timeout(120)
def test_footprint_of_tiny_models(tiny_models: dict[str, Path]) -> None:
    for arch, model_dir in tiny_models.items():
        config = json.loads((model_dir / "config.json").read_text())
        fp = footprint_from_dir(model_dir)
        assert fp.name == arch and fp.layers == config["num_hidden_layers"] == len(fp.layer_bytes)
        assert fp.weight_bytes == tensor_bytes(model_dir)
        assert len(set(fp.layer_bytes)) == 1 and fp.embed_bytes == 512 * 64 * 4
        assert fp.tied is config["tie_word_embeddings"]
        # tied: only the final norm is left for the head; else lm_head as well
        assert fp.head_bytes == 64 * 4 + (0 if fp.tied else 512 * 64 * 4)
        assert fp.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4  # 2 kv heads, head_dim 16, float32
        assert fp.weight_format == "float32"
        assert (fp.context_length, fp.hidden_size, fp.vocab_size) == (4096, 64, 512)
        assert ModelFootprint.model_validate_json(fp.model_dump_json()) == fp


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_footprint_of_default_model_and_its_placements() -> None:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(None, progress=False)
    config = json.loads((model_dir / "config.json").read_text())
    fp = footprint_from_dir(model_dir)
    assert fp.layers == config["num_hidden_layers"] == 30
    assert fp.weight_bytes == tensor_bytes(model_dir)
    assert fp.tied is config["tie_word_embeddings"] is True
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    # Quantized weights with float16 scales, float32 norms and embedding scales: float32 activations.
    assert fp.kv_bytes_per_token_per_layer == 2 * kv_heads * head_dim * 4
    assert fp.weight_format == "q4_1 blocks, q8_0 blocks"
    two = place(fp, [NodeCapacity(f"node-{i}", 4 * G, 100.0) for i in range(2)])
    # The tied head splits between the first and the last stage, so equal nodes take equal layers; with
    # three, the middle stage takes more. The engine splits one machine's cores the same way.
    assert [(a.start, a.end) for a in two.stages] == split_for_stages(fp, 2) == [(0, 15), (15, 30)]
    three = place(fp, [NodeCapacity(f"node-{i}", 4 * G, 100.0) for i in range(3)])
    sizes3 = [a.end - a.start for a in three.stages]
    assert sizes3[1] > max(sizes3[0], sizes3[2]) and [
        (a.start, a.end) for a in three.stages
    ] == split_for_stages(fp, 3)
    for placement in (two, place(fp, [NodeCapacity(f"node-{i}", 4 * G, 100.0) for i in range(3)])):
        first, last = placement.stages[0], placement.stages[-1]
        assert first.weight_bytes >= fp.embed_bytes and last.weight_bytes >= fp.embed_bytes  # tied: both


@pytest.mark.timeout(30)
def test_footprint_rejects_bad_files(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptModelError, match="no model"):
        footprint_from_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CorruptModelError, match="header"):
        footprint_from_dir(tmp_path)
    header = json.dumps({"model.layers.3.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(CorruptModelError, match="num_hidden_layers is 1"):
        footprint_from_dir(tmp_path)
    with pytest.raises(ValueError, match="layer_bytes"):
        synthetic(3, 1.0, layer_bytes=[1, 2])


# ---- place() against brute force ---------------------------------------------------------------------------


def need(fp: ModelFootprint, req: PlacementRequest, s: int, e: int) -> int:
    """The spec, written out again: weights (+embed first, +head last, +embed last if tied) + KV + scratch."""
    w = sum(fp.layer_bytes[s:e])
    if s == 0:
        w += fp.embed_bytes
    if e == fp.layers:
        w += fp.head_bytes + (fp.embed_bytes if fp.tied and s > 0 else 0)
    assert req.reserve_tokens is not None
    return (
        w
        + fp.kv_bytes_per_token_per_layer * (e - s) * req.reserve_tokens * req.sequences
        + req.activation_bytes
    )


def head_work(fp: ModelFootprint, s: int, e: int) -> float:
    """The spec: the head's work on stage [s, e); a tied head splits between the first and the last stage."""
    n = fp.layers
    if (s, e) == (0, n):
        return fp.head_bytes + (fp.embed_bytes if fp.tied else 0)
    shared = fp.embed_bytes / 2 if fp.tied and (s == 0 or e == n) else 0
    return shared + (fp.head_bytes if e == n else 0)


def brute_force(
    fp: ModelFootprint, nodes: list[NodeCapacity], req: PlacementRequest
) -> list[tuple[float, int]]:
    """(slowest stage time, stages) of every valid placement with stages in node_id order."""
    n, order = fp.layers, sorted(nodes, key=lambda x: x.node_id)
    head = fp.head_bytes + (fp.embed_bytes if fp.tied else 0)
    per = fp.layer_overhead_bytes

    hop = (
        req.hop_cost_fraction
        * (sum(fp.layer_bytes) + per * n + head)
        / (max(x.compute_score for x in nodes) * 1e9)
    )
    found = []
    for k in range(1, min(len(order), n, req.max_stages or n) + 1):
        for chosen in itertools.combinations(order, k):
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                stages = list(zip(chosen, itertools.pairwise(bounds), strict=True))
                if all(need(fp, req, s, e) <= x.available_bytes for x, (s, e) in stages):
                    times = [
                        (sum(fp.layer_bytes[s:e]) + per * (e - s) + head_work(fp, s, e))
                        / (x.compute_score * 1e9)
                        + (hop if k > 1 else 0.0)
                        for x, (s, e) in stages
                    ]
                    found.append((max(times), k))
    return found


footprints = st.builds(
    lambda layer_units, embed, head, tied, kv, per: synthetic(
        len(layer_units),
        0.0,
        layer_bytes=[u * U for u in layer_units],
        embed_bytes=embed * U,
        head_bytes=head * U,
        tied=tied,
        kv_bytes_per_token_per_layer=kv * U // 256,
        layer_overhead_bytes=per * U,
    ),
    st.lists(st.integers(0, 30), min_size=1, max_size=7),
    st.integers(0, 30),
    st.integers(0, 10),
    st.booleans(),
    st.integers(0, 10),
    st.integers(0, 3),
)
node_sets = st.lists(
    st.tuples(st.integers(0, 200), st.sampled_from([0.5, 1.0, 2.0, 3.0])), min_size=0, max_size=4
).map(lambda caps: [NodeCapacity(f"node-{i}", a * U, score) for i, (a, score) in enumerate(caps)])
requests = st.builds(
    lambda seqs, act, max_stages, hop: PlacementRequest(
        reserve_tokens=256,
        sequences=seqs,
        activation_bytes=act * U,
        max_stages=max_stages,
        hop_cost_fraction=hop,
    ),
    st.integers(1, 2),
    st.integers(0, 3),
    st.none() | st.integers(1, 4),
    st.sampled_from([0.0, 0.05, 0.5]),
)


@pytest.mark.timeout(60)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(footprints, node_sets, requests, st.randoms(use_true_random=False))
def test_place_is_valid_optimal_and_deterministic(
    fp: ModelFootprint, nodes: list[NodeCapacity], req: PlacementRequest, rng: random.Random
) -> None:
    found = brute_force(fp, nodes, req) if nodes else []
    result = preview(fp, nodes, req)
    shuffled = nodes[:]
    rng.shuffle(shuffled)
    again = preview(fp, shuffled, req)  # node order in the input must not matter
    if isinstance(result, PlacementError):
        assert not found, f"a valid placement exists: {min(found)}"
        assert isinstance(again, PlacementError) and str(again) == str(result)
        assert result.needed_bytes == need(fp, req, 0, fp.layers)
        assert result.available == {x.node_id: x.available_bytes for x in nodes}
        for x in nodes:
            assert f"{x.node_id} {x.available_bytes / GB:.2f} GB" in str(result)
        assert f"needs {result.needed_bytes / GB:.2f} GB" in str(result)
        return
    assert again == result
    stages = result.stages
    # every layer once, contiguous, in layer order; one stage per node; memory respected
    assert stages[0].start == 0 and stages[-1].end == fp.layers
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert all(s.start < s.end for s in stages)
    assert len({s.node_id for s in stages}) == len(stages)
    assert [s.node_id for s in stages] == sorted(s.node_id for s in stages)
    capacity = {x.node_id: x.available_bytes for x in nodes}
    for s in stages:
        assert s.need_bytes == need(fp, req, s.start, s.end) <= capacity[s.node_id] == s.available_bytes
        assert s.need_bytes == s.weight_bytes + s.kv_bytes + req.activation_bytes
    assert req.max_stages is None or len(stages) <= req.max_stages
    assert set(result.unused_nodes) == set(capacity) - {s.node_id for s in stages}
    # optimal: no valid placement has a faster slowest stage, none as fast uses fewer stages
    best = min(t for t, _ in found)
    assert result.est_step_time == pytest.approx(best, rel=1e-9, abs=1e-15)
    fewest = min(k for t, k in found if t <= best * (1 + 1e-9) + 1e-15)
    assert len(stages) == fewest


# ---- the shapes the brief names ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_memory_bound_pair_gets_shares_proportional_to_memory() -> None:
    # 32 layers of 1.75 GB + 64 MB KV each nearly fill 36 + 24 GB: memory decides the split.
    fp = synthetic(32, 1.75, kv=4096, head_gb=0.1)
    req = PlacementRequest(reserve_tokens=4096, sequences=4)
    p = place(fp, [NodeCapacity("mac-36", 36 * G, 100.0), NodeCapacity("mac-24", 24 * G, 100.0)], req)
    share = sizes(p)
    assert abs(share["mac-36"] - 32 * 36 / 60) <= 1 and abs(share["mac-24"] - 32 * 24 / 60) <= 1
    assert all(s.need_bytes <= s.available_bytes for s in p.stages)


@pytest.mark.timeout(30)
def test_bigger_node_gets_more_layers_when_model_fills_most_of_the_pair() -> None:
    # 48 GB of weights in 60 GB: equal speed wants 16/16, which the 24 GB node cannot hold.
    fp = synthetic(32, 1.5, kv=4096, head_gb=1.05)
    p = place(fp, [NodeCapacity("a-36", 36 * G, 50.0), NodeCapacity("b-24", 24 * G, 50.0)])
    share = sizes(p)
    assert share["a-36"] > share["b-24"] and sum(share.values()) == 32


@pytest.mark.timeout(30)
def test_model_that_fits_one_node_stays_there_unless_splitting_pays_for_the_hop() -> None:
    fp = synthetic(10, 1.0)
    fast, slow = NodeCapacity("fast", 64 * G, 20.0), NodeCapacity("slow", 64 * G, 1.0)
    p = place(fp, [slow, fast])
    assert [(s.node_id, s.start, s.end) for s in p.stages] == [("fast", 0, 10)]
    assert p.hop_cost == 0 and p.unused_nodes == ["slow"]
    # equal nodes: half the time + a hop of exactly half is no faster, so one stage (on the first node_id)
    pair = [NodeCapacity("b", 64 * G, 1.0), NodeCapacity("a", 64 * G, 1.0)]
    one = place(synthetic(2, 1.0), pair, PlacementRequest(hop_cost_fraction=0.5))
    assert [s.node_id for s in one.stages] == ["a"]
    two = place(synthetic(2, 1.0), pair, PlacementRequest(hop_cost_fraction=0.49))
    assert [s.node_id for s in two.stages] == ["a", "b"]
    assert two.est_step_time < one.est_step_time


@pytest.mark.timeout(30)
def test_equal_nodes_split_evenly() -> None:
    for layers, count in ((32, 2), (31, 3), (30, 4), (80, 8)):
        nodes = [NodeCapacity(f"n{i}", 40 * G, 10.0) for i in range(count)]
        p = place(synthetic(layers, 1.0, kv=1024, head_gb=0.001), nodes)
        counts = [s.end - s.start for s in p.stages]
        assert len(counts) == count and max(counts) - min(counts) <= 1, counts


@pytest.mark.timeout(30)
def test_faster_node_gets_more_layers() -> None:
    p = place(synthetic(30, 0.5), [NodeCapacity("a", 64 * G, 1.0), NodeCapacity("b", 64 * G, 2.0)])
    assert sizes(p) == {"a": 10, "b": 20}


@pytest.mark.timeout(30)
def test_too_big_for_the_cluster_raises_with_numbers() -> None:
    fp = synthetic(32, 1.5, kv=4096, head_gb=1.0, name="big-model")
    nodes = [NodeCapacity("node-a", 16 * G, 1.0), NodeCapacity("node-b", 8 * G, 1.0)]
    with pytest.raises(PlacementError) as info:
        place(fp, nodes)
    e = info.value
    msg = str(e)
    assert msg.startswith(f"big-model needs {e.needed_bytes / GB:.2f} GB (weights 50.00 GB + KV 2.15 GB")
    assert (
        "the cluster offers 24.00 GB: node-a 16.00 GB (holds at most 10 of 32 layers), node-b 8.00 GB" in msg
    )
    assert e.available == {"node-a": 16 * G, "node-b": 8 * G}
    copy = pickle.loads(pickle.dumps(e))
    assert str(copy) == msg and copy.needed_bytes == e.needed_bytes and copy.available == e.available
    assert isinstance(preview(fp, nodes), PlacementError)
    assert "no nodes" in str(preview(fp, []))


@pytest.mark.timeout(30)
def test_stage_cap_says_so() -> None:
    fp = synthetic(8, 1.0)
    nodes = [NodeCapacity(f"n{i}", int(3.5 * G), 1.0) for i in range(4)]
    assert len(place(fp, nodes).stages) == 4  # 3 would do, 4 are faster
    with pytest.raises(PlacementError, match=r"offers 14\.00 GB in all, but no split into at most 2"):
        place(fp, nodes, PlacementRequest(max_stages=2))


@pytest.mark.timeout(30)
def test_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="score"):
        NodeCapacity("x", G, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        place(synthetic(2, 1.0), [NodeCapacity("x", G, 1.0), NodeCapacity("x", G, 1.0)])
    wire = synthetic(2, 1.0).model_dump() | {"added_later": 1}
    assert ModelFootprint.model_validate(wire) == synthetic(2, 1.0)  # newer peers' fields are ignored
    assert PlacementRequest().reserve_tokens is None
    short, one = synthetic(2, 0.001, context_length=1000), [NodeCapacity("x", G, 1.0)]
    assert place(short, one, TINY).reserve_tokens == 256
    assert place(short, one).reserve_tokens == 1024  # min(context, 4096), rounded up to the KV cache's step


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(footprints, st.integers(1, 7))
def test_split_for_stages_is_the_least_slowest_stage_of_exactly_that_many(
    fp: ModelFootprint, stages: int
) -> None:
    """The engine's split of one machine's cores: exactly `stages` ranges, none better by brute force."""
    if stages > fp.layers:
        with pytest.raises(ValueError, match="cannot split"):
            split_for_stages(fp, stages)
        return
    n = fp.layers

    def slowest(ranges: list[tuple[int, int]]) -> float:
        return max(
            sum(fp.layer_bytes[s:e]) + fp.layer_overhead_bytes * (e - s) + head_work(fp, s, e)
            for s, e in ranges
        )

    got = split_for_stages(fp, stages)
    assert len(got) == stages and got[0][0] == 0 and got[-1][1] == n
    assert all(s < e for s, e in got) and all(a[1] == b[0] for a, b in itertools.pairwise(got))
    best = min(
        slowest(list(itertools.pairwise([0, *cuts, n])))
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    assert slowest(got) == best
