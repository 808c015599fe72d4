"""GGUF imports that keep their blocks as stored (models/gguf_import.py, compute/gguf_linear.py): the bytes,
the layers they load into, the kernel that multiplies them, and the affine twins where it does not run."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors import safe_open

from shardline.compute import gguf_linear, tensor_parallel
from shardline.compute.layer_range import LayerRange
from shardline.compute.shard import load_shard
from shardline.models.gguf_import import import_gguf
from shardline.testing.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.timeout(300)

SHAPE = {"hidden": 256, "ffn": 512, "head_dim": 128, "layers": 2}
PROMPT = [[5, 17, 33, 2, 101, 7]]
Imported = tuple[Path, Path, Path, Path]


@pytest.fixture(scope="module", params=[T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1])
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Imported:
    """(GGUF, its imports as blocks, as MLX affine, as float32) of a tiny qwen2 in one block type."""
    d = tmp_path_factory.mktemp(request.param.name)
    src = d / "t.gguf"
    write_tiny_gguf(src, "qwen2", pre="qwen2", qtype=request.param, **SHAPE)
    blocks = import_gguf(src, d / "blocks", progress=False)
    affine = import_gguf(src, d / "affine", progress=False, weights="affine")
    floats = import_gguf(src, d / "float32", progress=False, weights="float32")
    return src, blocks, affine, floats


def test_blocks_are_the_gguf_bytes(imported: Imported) -> None:
    src, blocks, _, _ = imported
    config = json.loads((blocks / "config.json").read_text())
    reader = gguf.GGUFReader(src)
    by_name = {t.name: t for t in reader.tensors}
    named = config["gguf_quantization"]
    assert named["model.layers.1.mlp.down_proj"] == by_name["blk.1.ffn_down.weight"].tensor_type.name
    assert "quantization" not in config  # nothing else is quantized: mlx-lm's own quantize pass skips them
    with safe_open(str(blocks / "model.safetensors"), "np") as f:
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        gate = f.get_tensor("model.layers.0.mlp.gate_proj.weight")
    assert down.dtype == np.uint8
    assert down.tobytes() == np.asarray(by_name["blk.1.ffn_down.weight"].data).tobytes()
    assert gate.tobytes() == np.asarray(by_name["blk.0.ffn_gate.weight"].data).tobytes()
    stored = (blocks / "model.safetensors").stat().st_size
    assert stored <= 1.02 * src.stat().st_size


def test_layers_load_as_blocks(imported: Imported) -> None:
    _, blocks, _, _ = imported
    model, _ = gguf_linear.load_model(blocks, lazy=True)
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is gguf_linear.GGUFLinear
    assert "bias" in layer.self_attn.q_proj  # qwen2's q/k/v biases stay float beside the blocks
    assert type(model.model.embed_tokens) is gguf_linear.GGUFEmbedding


def test_affine_twins_equal_the_affine_import(imported: Imported, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel does not run (a GPU), the blocks become the affine import's layers, bit for bit."""
    _, blocks, affine, _ = imported
    monkeypatch.setattr(gguf_linear, "kernel_runs_here", lambda: False)
    twin, _ = gguf_linear.load_model(blocks)
    gguf_linear.to_affine_layers(twin)
    ref, _ = gguf_linear.load_model(affine)
    x = mx.array(PROMPT)
    assert mx.array_equal(twin(x), ref(x)).item()


def test_kernel_runs_the_blocks(imported: Imported) -> None:
    """The kernel's products (x rounded to int8 per block of 32, as llama.cpp rounds it) against float32
    products of the same weights: the logits agree to that rounding (a few percent of their range through
    two random layers; tests/test_gguf_kernel.py checks each product exactly against the rounded x)."""
    _, blocks, _, floats = imported
    assert gguf_linear.kernel_runs_here()
    model, _ = gguf_linear.load_model(blocks)
    ref, _ = gguf_linear.load_model(floats)
    x = mx.array(PROMPT)
    got, want = model(x), ref(x)
    err = float(mx.abs(got - want).max()) / float(mx.abs(want).max())
    assert err < 0.06, err
    assert (mx.argmax(got[0], -1) == mx.argmax(want[0], -1)).sum().item() >= len(PROMPT[0]) - 1


def test_stages_hold_their_blocks(imported: Imported) -> None:
    """Two stages of the blocks import compute what one does (the pipeline's split of a block model)."""
    _, blocks, _, _ = imported
    whole = load_shard(blocks, LayerRange(0, 2, 2))
    first, last = load_shard(blocks, LayerRange(0, 1, 2)), load_shard(blocks, LayerRange(1, 2, 2))
    x = mx.array(PROMPT)
    c_whole, c_first, c_last = whole.make_cache(16), first.make_cache(16), last.make_cache(16)
    one = whole.forward(x, c_whole)
    two = last.forward(first.forward(x, c_first), c_last)
    if last.head_split:  # a tied head: the first stage finishes the lower logits
        two = first.finish_head(two)
    assert mx.allclose(one, two, rtol=1e-4, atol=1e-4).item()


def test_tensor_parallel_columns_keep_whole_blocks(imported: Imported) -> None:
    _, blocks, _, _ = imported
    model, _ = gguf_linear.load_model(blocks)
    down = model.model.layers[0].mlp.down_proj
    elements = gguf_linear.block_shape(down.qtype)[0]
    x = mx.random.normal((3, 512), key=mx.random.key(1))
    whole = down(x)
    halves = []
    for start, stop in ((0, 256), (256, 512)):
        part, _ = gguf_linear.load_model(blocks)
        layer = part.model.layers[0].mlp.down_proj
        tensor_parallel.columns(layer, start, stop, keep_bias=True)
        halves.append(layer(x[:, start:stop]))
    assert mx.allclose(halves[0] + halves[1], whole, rtol=1e-3, atol=1e-3).item()
    if elements > 32:
        part, _ = gguf_linear.load_model(blocks)
        with pytest.raises(tensor_parallel.GroupSumError, match="split GGUF blocks"):
            tensor_parallel.columns(part.model.layers[0].mlp.down_proj, 0, 32, keep_bias=True)


def test_unknown_block_type_is_refused(imported: Imported, tmp_path: Path) -> None:
    _, blocks, _, _ = imported
    with pytest.raises(ValueError, match="is not one the kernel reads"):
        gguf_linear.qtype_of("IQ2_XXS")
    with pytest.raises(ValueError, match="does not have"):
        gguf_linear.install(gguf_linear.load_model(blocks, lazy=True)[0], {"model.nowhere": "Q4_K"})


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_a_row_gives_its_bits_whatever_rows_share_the_product(qtype: T) -> None:
    """Decode rows are batched as requests come and go: row i of a product must not depend on how many rows
    there are (a replay, or a request alone, gives the bits it gave in a batch), on every kernel set."""
    from shardline.compute import quantized
    from shardline.testing.tiny_gguf import random_blocks

    ops = quantized.native()
    rng = np.random.default_rng(3)
    n, k = 37, 512
    w = mx.array(np.ascontiguousarray(random_blocks(rng, qtype, (n, k))).reshape(n, -1))
    x = mx.random.normal((33, k), key=mx.random.key(4))
    try:
        for isa in ("auto", "avx2", "scalar"):
            if not ops.set_isa(isa):
                continue
            limit = 31  # below gguf_gemm_rows: the BLAS path's float sums are ordered by its tiles
            full = ops.gguf_matmul(x[:limit], w, int(qtype))
            for m in (1, 2, 3, 5, 8, 9, 16, 17):
                assert mx.array_equal(ops.gguf_matmul(x[:m], w, int(qtype)), full[:m]).item(), (isa, m)
    finally:
        ops.set_isa("auto")
