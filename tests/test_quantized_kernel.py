"""The native CPU kernel for MLX's affine-quantized matmul (csrc/qmm, shardline.compute._qmm) against the
float32 product of the dequantized weights, for every format and kernel path; the quantized layers that
`load_shard` installs on CPU against MLX's own op; and the fallback when the module is missing or stale."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from shardline.compute import quantized
from shardline.compute.quantized import CpuQuantizedEmbedding, CpuQuantizedLinear
from shardline.compute.shard import Shard, load_shard
from shardline.testing.reference import Reference
from shardline.testing.tiny import make_tiny_quantized_model

try:
    _qmm = quantized._import_native()
except ImportError as exc:  # the install builds it: a missing module is a broken build, not a skip
    pytest.fail(f"the native kernel is not built ({exc}): run `make native`", pytrace=False)

ISAS = [isa for isa in ("avx512_vnni", "avx512", "avx2", "neon", "scalar") if _qmm.set_isa(isa)]
_qmm.set_isa("auto")
BEST = _qmm.isa()
SCALE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Float32 paths: the kernels sum in another order than a plain dot product, nothing else.
FLOAT_RTOL = 2e-6
BLOCK = 16  # KV positions per cache block: small, so that a request's cache spans several


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    isa, integer, gemm = _qmm.isa(), _qmm.integer(), _qmm.gemm_rows()
    yield
    _qmm.set_isa(isa)
    _qmm.set_integer(integer)
    _qmm.set_gemm_rows(gemm)


def _weights(n: int, k: int, bits: int, group_size: int, scale_dtype: mx.Dtype, seed: int):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)) * 0.1
    q, s, b = mx.quantize(w.astype(scale_dtype), group_size=group_size, bits=bits)
    # The float32 dequantized weights: what every path multiplies (up to x's rounding on the integer path).
    dense = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
    return q, s, b, np.array(dense, dtype=np.float64)


def _round_int16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the integer path does, in float32 as it does (per block of 32: x * (32767 / max|x|) to
    the nearest integer, times the step max|x| / 32767), and the steps."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.float32(32767) / np.where(amax > 0, amax, np.float32(1))
    step = (amax / np.float32(32767)).astype(np.float64)
    rounded = np.rint(blocks * inv).astype(np.float64) * step
    return rounded.reshape(x.shape), np.broadcast_to(step, blocks.shape).reshape(x.shape)


def _check(y: mx.array, x: np.ndarray, dense: np.ndarray, integer: bool) -> None:
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    scale = np.abs(x) @ np.abs(dense).T + 1e-30  # the size of the sums, against which rounding is measured
    exact = x @ dense.T
    if not integer:
        assert np.all(np.abs(got - exact) <= FLOAT_RTOL * scale), np.abs(got - exact).max()
        return
    rounded, step = _round_int16(x)
    # The integer path is the float product of the dequantized weights with the rounded x ...
    assert np.all(np.abs(got - rounded @ dense.T) <= FLOAT_RTOL * scale)
    # ... so it is off the exact one by at most sum_k |w_k| * step_k / 2.
    bound = (step / 2) @ np.abs(dense).T
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-4) + FLOAT_RTOL * scale)


def _has_integer(isa: str) -> bool:
    _qmm.set_isa(isa)
    _qmm.set_integer(True)
    return _qmm.integer()


def _use(isa: str, path: str) -> bool:
    """Set the kernel path; True if it rounds x to int16."""
    _qmm.set_isa(isa)
    _qmm.set_integer(path == "int16")
    _qmm.set_gemm_rows(1 if path == "gemm" else 0)
    return path == "int16"


PATHS = [(isa, p) for isa in ISAS for p in ("float", "gemm", "int16") if p != "int16" or _has_integer(isa)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("isa", "path"), PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", list(SCALE_DTYPES))
def test_every_format_matches_the_dequantized_product(isa, path, bits, group_size, scale_dtype):
    # 3 * 128 columns: an odd number of 32-blocks; 37 outputs: not a multiple of any vector width.
    q, s, b, dense = _weights(37, 384, bits, group_size, SCALE_DTYPES[scale_dtype], seed=bits + group_size)
    integer = _use(isa, path)
    for rows in (1, 3, 8):
        x = np.random.default_rng(rows).standard_normal((rows, 384)).astype(np.float32)
        y = _qmm.quantized_matmul(mx.array(x), q, s, b, group_size, bits)
        assert y.shape == (rows, 37) and y.dtype == mx.float32
        _check(y, x.astype(np.float64), dense, integer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("isa", "path"), PATHS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (5, 96), (17, 160), (64, 576), (300, 1536)])
def test_odd_shapes_and_row_counts(isa, path, n, k):
    q, s, b, dense = _weights(n, k, 4, 32, mx.float16, seed=n + k)
    integer = _use(isa, path)
    for rows in (1, 2, 5, 9, 16, 33, 64):
        x = np.random.default_rng(rows + k).standard_normal((rows, k)).astype(np.float32)
        _check(_qmm.quantized_matmul(mx.array(x), q, s, b, 32, 4), x.astype(np.float64), dense, integer)


@pytest.mark.parametrize(("isa", "path"), PATHS)
def test_leading_batch_dims_and_strided_x(isa, path):
    q, s, b, dense = _weights(24, 128, 8, 64, mx.bfloat16, seed=3)
    integer = _use(isa, path)
    x = np.random.default_rng(0).standard_normal((2, 3, 128)).astype(np.float32)
    y = _qmm.quantized_matmul(mx.array(x), q, s, b, 64, 8)
    assert y.shape == (2, 3, 24)
    _check(y.reshape(6, 24), x.reshape(6, 128).astype(np.float64), dense, integer)
    # A transposed view (not row-contiguous) gives what its contiguous copy gives.
    xt = mx.array(np.ascontiguousarray(x.transpose(1, 0, 2))).transpose(1, 0, 2)
    assert mx.array_equal(_qmm.quantized_matmul(xt, q, s, b, 64, 8), y)


@pytest.mark.parametrize("x_dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_half_precision_x_gives_mlx_output_dtype(x_dtype, scale_dtype):
    q, s, b, dense = _weights(16, 64, 4, 32, scale_dtype, seed=5)
    _use(BEST, "float")
    x = mx.random.normal((4, 64)).astype(x_dtype)
    y = _qmm.quantized_matmul(x, q, s, b, 32, 4)
    want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4)
    assert y.dtype == want.dtype
    exact = np.array(x.astype(mx.float32), dtype=np.float64) @ dense.T
    tol = 1e-2 if y.dtype == mx.bfloat16 else 2e-3  # the output's own rounding
    assert np.allclose(np.array(y.astype(mx.float32)), exact, rtol=tol, atol=tol)


def test_bad_arguments_raise_value_error():
    q, s, b, _ = _weights(8, 64, 4, 32, mx.float16, seed=1)
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="bits"):
        _qmm.quantized_matmul(x, q, s, b, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        _qmm.quantized_matmul(x, q, s, b, 16, 4)
    with pytest.raises(ValueError, match="columns"):
        _qmm.quantized_matmul(mx.zeros((1, 96)), q, s, b, 32, 4)
    with pytest.raises(ValueError, match="scales"):
        _qmm.quantized_matmul(x, q, s[:4], b[:4], 32, 4)
    with pytest.raises(ValueError, match="x must be"):
        _qmm.quantized_matmul(x.astype(mx.int32), q, s, b, 32, 4)


def test_unsupported_formats_use_mlx_op():
    mx.random.seed(2)
    w = mx.random.normal((8, 128))
    x = mx.random.normal((2, 128))
    for bits, group_size in ((3, 32), (5, 64), (6, 128), (2, 32)):
        q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group_size, bits=bits)
        assert mx.array_equal(quantized.quantized_matmul(x, q, s, b, group_size, bits), want)


# --- integration: the layers load_shard installs ---------------------------------------------------------


def _shard_greedy(shard: Shard, prompt: list[int], n: int) -> list[int]:
    cache = shard.make_cache(BLOCK)
    logits = shard.forward(mx.array([prompt]), cache)
    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(logits)))
        logits = shard.forward(mx.array([[tokens[-1]]]), cache)
    return tokens


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-quantized")
    return {
        "llama": make_tiny_quantized_model(root / "llama", "llama", bits=4, group_size=32),  # untied head
        "qwen2": make_tiny_quantized_model(root / "qwen2", "qwen2", bits=8, group_size=64),  # tied head
    }


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def missing() -> types.ModuleType:
        raise ImportError("no module named shardline.compute._qmm")

    monkeypatch.setattr(quantized, "_import_native", missing)
    quantized.reset_native()
    yield
    monkeypatch.undo()
    quantized.reset_native()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_model_greedy_tokens_match_mlx(quantized_models, arch):
    quantized.reset_native()
    shard = load_shard(quantized_models[arch])
    layer = shard.layers[0]
    assert type(layer.self_attn.q_proj) is CpuQuantizedLinear
    assert type(layer.mlp.down_proj) is CpuQuantizedLinear
    head = shard.embed if shard.tied else shard.model.lm_head
    assert type(head) is (CpuQuantizedEmbedding if shard.tied else CpuQuantizedLinear)
    ref = Reference(quantized_models[arch])  # mlx-lm's model: MLX's quantized_matmul
    for seed in range(3):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 512, 5 + 7 * seed)]
        expected, margins = ref.greedy(prompt, 12)
        assert min(margins) > 1e-3, "the reference has a near tie"
        assert _shard_greedy(shard, prompt, 12) == expected
    # The first stage's embedding lookup is the stock dequantizing gather.
    ids = mx.array([[1, 7, 300]])
    assert mx.array_equal(shard.embed(ids), ref.model.model.embed_tokens(ids))


@pytest.mark.timeout(120)
def test_missing_extension_falls_back_to_mlx_with_one_warning(quantized_models, no_native, caplog):
    with caplog.at_level(logging.WARNING, logger="shardline.compute"):
        shard = load_shard(quantized_models["llama"])
        assert quantized.native() is None
        load_shard(quantized_models["llama"])
    warnings = [r for r in caplog.records if "native quantized kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert type(shard.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    assert type(shard.model.lm_head) is nn.QuantizedLinear
    ref = Reference(quantized_models["llama"])
    prompt = [3, 14, 15, 92, 65]
    assert _shard_greedy(shard, prompt, 8) == ref.greedy(prompt, 8)[0]


def test_extension_built_for_another_mlx_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(quantized, "_import_native", lambda: types.SimpleNamespace(MLX_VERSION="0.0.1"))
    quantized.reset_native()
    try:
        with caplog.at_level(logging.WARNING, logger="shardline.compute"):
            assert quantized.native() is None
        assert "built against MLX 0.0.1" in caplog.text
    finally:
        monkeypatch.undo()
        quantized.reset_native()
    assert quantized.native() is _qmm


@pytest.mark.timeout(240)
def test_engine_stages_run_the_kernel_and_keep_greedy_tokens(quantized_models, start_engine):
    """Runners are fresh processes: they import the module, and split across stages nothing changes."""
    model = quantized_models["qwen2"]
    ref = Reference(model)
    engine = start_engine(model, 2)
    for seed in range(2):
        prompt = [int(t) for t in np.random.default_rng(10 + seed).integers(0, 512, 9 + 13 * seed)]
        expected, margins = ref.greedy(prompt, 10)
        assert min(margins) > 1e-3
        assert engine.submit(prompt, max_tokens=10).tokens(timeout=120) == expected


# --- the native ops of a decode position (batched.decode_stack) ------------------------------------------


def test_fused_projections_equal_separate_ones_bitwise():
    mx.random.seed(4)
    x = mx.random.normal((5, 1, 576))
    parts = [mx.quantize(mx.random.normal((n, 576)) * 0.05, group_size=32, bits=4) for n in (576, 193, 7)]
    for rows in (1, 2, 5):
        xs = x[:rows]
        outs = _qmm.quantized_matmul_many(xs, *(list(t) for t in zip(*parts, strict=True)), 32, 4)
        for out, (q, s, b) in zip(outs, parts, strict=True):
            assert mx.array_equal(out, _qmm.quantized_matmul(xs, q, s, b, 32, 4))
    (qg, sg, bg), (qu, su, bu) = (
        mx.quantize(mx.random.normal((1536, 576)) * 0.05, group_size=32, bits=4) for _ in "gu"
    )
    y = _qmm.quantized_swiglu(x, qg, sg, bg, qu, su, bu, 32, 4)
    gate, up = _qmm.quantized_matmul(x, qg, sg, bg, 32, 4), _qmm.quantized_matmul(x, qu, su, bu, 32, 4)
    assert mx.allclose(y, nn.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rms_norm_and_add_rms_norm_match_mlx():
    mx.random.seed(5)
    a, b, w = mx.random.normal((3, 1, 576)) * 4, mx.random.normal((3, 1, 576)), mx.random.normal((576,))
    assert mx.allclose(_qmm.rms_norm(a, w, 1e-5), mx.fast.rms_norm(a, w, 1e-5), rtol=1e-5, atol=1e-6)
    total, normed = _qmm.add_rms_norm(a, b, w, 1e-5)
    assert mx.array_equal(total, a + b)
    assert mx.allclose(normed, mx.fast.rms_norm(a + b, w, 1e-5), rtol=1e-5, atol=1e-6)
    strided = mx.random.normal((576, 3)).T.reshape(3, 1, 576)  # a transposed view
    assert mx.allclose(
        _qmm.rms_norm(strided, w, 1e-6), mx.fast.rms_norm(strided, w, 1e-6), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("dims", "head_dim", "base", "scale"), [(64, 64, 100000.0, 1.0), (16, 32, 10000.0, 0.5)]
)
def test_rope_matches_mlx(traditional, dims, head_dim, base, scale):
    mx.random.seed(6)
    x = mx.random.normal((3, 1, 4, head_dim)) * 2
    for offsets in (mx.array([0, 17, 300], dtype=mx.int32), mx.array(41, dtype=mx.int32)):
        want = mx.fast.rope(
            x.transpose(0, 2, 1, 3), dims, traditional=traditional, base=base, scale=scale, offset=offsets
        ).transpose(0, 2, 1, 3)
        got = _qmm.rope_bthd(x, offsets, dims, traditional, base, scale, head_dim)
        assert mx.allclose(got, want, rtol=1e-5, atol=2e-5)
        # The projections' own layout, (B, T, heads * dim), gives the same.
        flat = _qmm.rope_bthd(x.reshape(3, 1, -1), offsets, dims, traditional, base, scale, head_dim)
        assert mx.array_equal(flat.reshape(x.shape), got)


@pytest.mark.parametrize("length", [1, 5, 300])
def test_decode_attention_matches_mlx_on_cache_views(length):
    mx.random.seed(7)
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    q = mx.random.normal((1, 1, heads * dim))
    buffer_k, buffer_v = (mx.random.normal((1, kv_heads, 512, dim)) for _ in "kv")
    keys, values = buffer_k[:, :, :length, :], buffer_v[:, :, :length, :]  # as a KVCache hands them out
    got = _qmm.decode_attention(q, [keys], [values], scale)
    qh = q.reshape(1, heads, 1, dim)
    want = mx.fast.scaled_dot_product_attention(qh, keys, values, scale=scale).reshape(1, 1, -1)
    assert got.shape == (1, 1, heads * dim)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_greedy_pick_matches_argmax_and_log_softmax():
    for seed in range(3):
        logits = mx.random.normal((49152,), key=mx.random.key(seed)) * 6
        token, logprob = _qmm.greedy(logits)
        values = np.array(logits, dtype=np.float64)
        want = values.max() - values.max() - np.log(np.exp(values - values.max()).sum())
        assert int(token) == int(np.argmax(values))
        assert abs(float(logprob) - want) < 1e-5
    tie = mx.array([1.0, 3.0, 3.0, -2.0])
    assert int(_qmm.greedy(tie)[0]) == 1  # the first of equal maxima, as argmax


@pytest.mark.timeout(120)
def test_quantized_batched_decode_rows_equal_each_alone_bitwise(quantized_models):
    """The integer path computes every row of x alone, so a batched decode step gives each request the bits
    it gets alone (below the BLAS threshold of rows)."""
    quantized.reset_native()
    shard = load_shard(quantized_models["llama"])
    assert shard.fast_decode
    from test_decode_rows import assert_rows_equal_each_alone

    assert_rows_equal_each_alone(shard, "quantized llama")
