"""MLX-quantized model directories, as `mlx_lm.convert -q` writes them (4 and 8 bits, groups of 32, 64 and
128, float32 and bfloat16 scales): loaded stage by stage, split, placed by their stored bytes and served
with the same greedy text on 1, 2 and 3 stages as single-process mlx-lm. (Copies: tests/test_weights.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import QUANTIZED, STEP, random_prompt

from shardline.compute.shard import LayerRange, load_shard, split_layers
from shardline.models.footprint import footprint_from_dir
from shardline.testing.reference import QUANTIZED_LOGIT_TOLERANCE, Reference

MAX_TOKENS = 8
BLOCK = 16  # KV positions per cache block: small, so that a request's cache spans several


def _stage_bytes(path: Path, layers: LayerRange) -> int:
    """What placement counts for a stage: its layers' stored bytes, the embedding on the first stage (and on
    the last when tied), the final norm and untied head on the last."""
    fp = footprint_from_dir(path)
    total = sum(fp.layer_bytes[layers.start : layers.end])
    if layers.is_first or (layers.is_last and fp.tied):
        total += fp.embed_bytes
    return total + (fp.head_bytes if layers.is_last else 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_stages_of_a_quantized_model_compute_what_the_whole_model_does(
    tiny_quantized_models: dict[str, Path], name: str
) -> None:
    path = tiny_quantized_models[name]
    config = json.loads((path / "config.json").read_text())
    prompt = random_prompt(7, seed=3)
    whole = load_shard(path)
    # Quantized layers stay quantized (the embedding too, its as_linear is the tied head): never a float copy.
    assert "scales" in whole.embed and "scales" in whole.layers[0].mlp.up_proj
    assert whole.head_split == 0  # one stage: nothing to split
    want = whole.forward(mx.array([prompt]), whole.make_cache(BLOCK))
    ref = Reference(path).last_logits(prompt)
    # bfloat16 activations keep 8 bits of mantissa, rounded after different ops by the native kernel and
    # by MLX's: agreement to bfloat16's own noise over a few layers is what can be asked.
    tolerance = 0.1 if whole.embed["scales"].dtype == mx.bfloat16 else QUANTIZED_LOGIT_TOLERANCE
    assert float(mx.abs(want.astype(mx.float32) - ref).max() / mx.abs(ref).max()) < tolerance
    assert whole.weight_bytes() == _stage_bytes(path, whole.range)
    total = int(config["num_hidden_layers"])
    tied = bool(config.get("tie_word_embeddings", True))
    for stages in (2, 3):
        h = mx.array([prompt])
        shards = [load_shard(path, layers) for layers in split_layers(total, stages)]
        for shard in shards:
            # In memory, a stage holds exactly the stored bytes placement counted for it.
            assert shard.weight_bytes() == _stage_bytes(path, shard.range), f"{stages} stages, {shard.range}"
            # A tied (quantized) head splits between the first and the last stage, as a float one does.
            ends = shard.range.is_first or shard.range.is_last
            assert shard.head_split == (int(config["vocab_size"]) // 2 if tied and ends else 0)
            h = shard.forward(h, shard.make_cache(BLOCK))
        if shards[0].head_split:
            h = shards[0].finish_head(h)
        assert mx.array_equal(h, want).item(), f"{stages} stages"


@pytest.mark.timeout(120)
def test_quantized_footprints_count_stored_bytes_and_the_activation_dtype(
    tiny_quantized_models: dict[str, Path],
) -> None:
    from test_placement import tensor_bytes

    for name, (_, bits, group, dtype) in QUANTIZED.items():
        path = tiny_quantized_models[name]
        fp = footprint_from_dir(path)
        assert fp.weight_bytes == tensor_bytes(path), name
        assert fp.weight_format == f"mlx {bits}-bit g{group}", name
        # KV: 2 kv heads x head_dim (128 / 4 heads = 32, qwen3 16) x the activations' dtype, which is the
        # scales' (float32 here, bfloat16 for the bfloat16 model), never the packed uint32 weights'.
        head_dim = 16 if name.startswith("qwen3") else 32
        act = 4 if dtype is None else 2
        assert fp.kv_bytes_per_token_per_layer == 2 * 2 * head_dim * act, name
        # The quantized embedding: packed rows plus a scale and a bias per group.
        scale = 4 if dtype is None else 2
        assert fp.embed_bytes == 512 * (128 * bits // 8 + 2 * scale * 128 // group), name


# bfloat16 logits tie exactly too often for a greedy comparison; its stages are compared bit for bit above.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n, (*_, dtype) in QUANTIZED.items() if dtype is None])
def test_quantized_greedy_text_is_the_same_on_one_two_and_three_stages(
    tiny_quantized_models: dict[str, Path], start_engine, name: str
) -> None:
    path = tiny_quantized_models[name]
    ref = Reference(path)
    prompts = [random_prompt(n, seed=40 + n) for n in (1, STEP + 1, 3 * STEP + 2)]
    expected = []
    for prompt in prompts:
        tokens, margins = ref.greedy(prompt, MAX_TOKENS)
        assert min(margins) > 1e-3, f"reference has a near-tied logit (margins {margins})"
        expected.append(tokens)
    for stages in (1, 2, 3):
        engine = start_engine(path, stages)
        got = [engine.submit(p, max_tokens=MAX_TOKENS).tokens(timeout=120) for p in prompts]
        assert got == expected, f"{stages} stages"
        engine.shutdown()


@pytest.mark.timeout(30)
def test_weight_format_labels(tmp_path: Path) -> None:
    from shardline.models.store.formats import describe_weights

    mixed = {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "lm_head": {"group_size": 64, "bits": 8},
        "x": False,
    }
    assert describe_weights(tmp_path, {"quantization": mixed}, {"U32": 10}) == "mlx 4-bit g64 + 8-bit g64"
    mxfp4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert describe_weights(tmp_path, {"quantization": mxfp4}, {}) == "mlx mxfp4 g32"
    assert describe_weights(tmp_path, {}, {"BF16": 100, "F32": 10}) == "bfloat16"
    # A GGUF import says itself what it did.
    (tmp_path / "shardline_import.json").write_text(json.dumps({"weight_format": "q4_k→affine4/g32"}))
    assert describe_weights(tmp_path, {"quantization": mixed}, {}) == "q4_k→affine4/g32"
