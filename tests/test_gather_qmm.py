"""The native gathered quantized product (csrc/qmm/gather.cpp, `_qmm.gather_qmm`) against the float64 product
of the dequantized weights of each selected expert, for every format and kernel path, the index layouts
mlx-lm's SwitchGLU makes (decode, sorted prefill, small unsorted batches, repeated experts) and the
broadcasting of mx.gather_qmm; CpuQuantizedSwitchLinear against mlx-lm's QuantizedSwitchLinear; and a
whole mixture-of-experts model made cpu-quantized against itself before the swap."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from shardline.compute import quantized
from shardline.compute.quantized import make_cpu_quantized
from shardline.compute.quantized_experts import CpuQuantizedSwitchLinear
from shardline.testing import arch_zoo

try:
    _qmm = quantized._import_native()
except ImportError as exc:  # the install builds it: a missing module is a broken build, not a skip
    pytest.fail(f"the native kernel is not built ({exc}): run `make native`", pytrace=False)

# The dense kernel's tolerances (tests/test_quantized_kernel.py): float32 paths differ from the exact
# product by their summation order only; the integer path by x's rounding to int16 per block of 32.
FLOAT_RTOL = 2e-6
SCALE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_qmm.set_integer(True)
PATHS = ["float", "gemm"] + (["int16"] if _qmm.integer() else [])


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    isa, integer, gemm = _qmm.isa(), _qmm.integer(), _qmm.gemm_rows()
    yield
    _qmm.set_isa(isa)
    _qmm.set_integer(integer)
    _qmm.set_gemm_rows(gemm)


def _use(path: str) -> bool:
    """Every product on one kernel path ("mixed": the default, by each expert's rows); True if x may be
    rounded to int16."""
    _qmm.set_integer(path in ("int16", "mixed"))
    _qmm.set_gemm_rows({"gemm": 1, "mixed": 16}.get(path, 0))
    return path in ("int16", "mixed") and _qmm.integer()


def _experts(e: int, n: int, k: int, bits: int, group_size: int, scale_dtype: mx.Dtype, seed: int):
    mx.random.seed(seed)
    w = mx.random.normal((e, n, k)) * 0.1
    q, s, b = mx.quantize(w.astype(scale_dtype), group_size=group_size, bits=bits)
    dense = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
    return q, s, b, np.array(dense, dtype=np.float64)


def _round_int16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as the integer path does (per block of 32, in float32), and each element's step."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.float32(32767) / np.where(amax > 0, amax, np.float32(1))
    step = (amax / np.float32(32767)).astype(np.float64)
    rounded = np.rint(blocks * inv).astype(np.float64) * step
    return rounded.reshape(x.shape), np.broadcast_to(step, blocks.shape).reshape(x.shape)


def _gathered(x: np.ndarray, dense: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's blocks and the selected experts' weights, both broadcast to the output's batch shape."""
    batch = np.broadcast_shapes(x.shape[:-2], idx.shape)
    return np.broadcast_to(x, batch + x.shape[-2:]), dense[np.broadcast_to(idx, batch)]


def _product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.einsum("...mk,...nk->...mn", x, w)


def _check(y: mx.array, x: np.ndarray, dense: np.ndarray, idx: np.ndarray, integer: bool) -> None:
    xs, ws = _gathered(x.astype(np.float64), dense, idx)
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    assert got.shape == (*xs.shape[:-1], ws.shape[-2])
    scale = _product(np.abs(xs), np.abs(ws)) + 1e-30  # the size of the sums rounding is measured against
    exact = _product(xs, ws)
    if not integer:
        assert np.all(np.abs(got - exact) <= FLOAT_RTOL * scale), np.abs(got - exact).max()
        return
    _, step = _round_int16(xs)
    # Each expert's rows on the integer path are the float product with the rounded x, so within
    # sum_k |w_k| * step_k / 2 of the exact one (rows on a float path are closer still).
    bound = _product(step / 2, np.abs(ws))
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-4) + FLOAT_RTOL * scale), np.abs(got - exact).max()


def _cases(e: int, k_in: int, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
    """(x, indices, sorted) in the layouts mlx-lm makes, and mx.gather_qmm's broadcasting."""

    def top(rows: int, k: int) -> np.ndarray:  # k distinct experts per row, as a router's top-k
        return np.stack([rng.permutation(e)[:k] for _ in range(rows)]).astype(np.uint32)

    def x(*shape: int) -> np.ndarray:
        return rng.standard_normal((*shape, k_in)).astype(np.float32)

    for k in range(1, 9):
        yield x(1, 1, 1, 1), top(1, k).reshape(1, 1, k), False  # decode: gate and up
        yield x(1, 1, k, 1), top(1, k).reshape(1, 1, k), False  # decode: down, one x block per expert
    for rows in (2, 5, 7):  # a small batch: experts repeat across rows, unsorted
        yield x(rows, 1, 1, 1), top(rows, 4).reshape(rows, 1, 4), False
    # Repeated experts within a row.
    yield x(3, 1, 6, 1), rng.integers(0, 2, (3, 1, 6)).astype(np.uint32), False
    for rows, k in ((8, 8), (64, 1), (64, 8)):  # prefill: flattened pairs sorted by expert
        yield x(rows * k, 1), np.sort(top(rows, k).reshape(-1)), True
    # Several rows per block (M = 3), x's batch broadcast against the indices', int32 indices.
    yield x(2, 3), rng.integers(0, e, (4, 1)).astype(np.int32), False
    yield x(3), rng.integers(0, e, (5,)).astype(np.uint32), False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", [*PATHS, "mixed"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_every_format_matches_each_experts_dequantized_product(path, bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    # In sizes: one group, an odd number of 32-blocks, a longer row; 13 and 37 outputs: no vector width.
    for k_in, n_out, scale_dtype in (
        (group_size, 13, "float16"),
        (3 * group_size, 37, "bfloat16"),
        (640, 37, "float32"),
    ):
        q, s, b, dense = _experts(9, n_out, k_in, bits, group_size, SCALE_DTYPES[scale_dtype], seed=k_in)
        integer = _use(path)
        for x, idx, is_sorted in _cases(9, k_in, rng):
            y = _qmm.gather_qmm(mx.array(x), q, s, b, mx.array(idx), group_size, bits, is_sorted)
            assert y.dtype == mx.float32
            _check(y, x, dense, idx, integer)


@pytest.mark.parametrize("path", PATHS)
def test_shapes_and_dtypes_are_mlx_gather_qmms(path):
    integer = _use(path)
    q, s, b, dense = _experts(6, 24, 128, 4, 64, mx.float16, seed=1)
    rng = np.random.default_rng(0)
    for x_dtype in (mx.float32, mx.float16, mx.bfloat16):
        for x_shape, idx_shape in (((2, 3, 1, 1), (2, 3, 4)), ((2, 3, 4, 2), (2, 3, 4)), ((5, 2), (3, 1))):
            x = mx.array(rng.standard_normal((*x_shape, 128)).astype(np.float32)).astype(x_dtype)
            idx = mx.array(rng.integers(0, 6, idx_shape).astype(np.uint32))
            want = mx.gather_qmm(x, q, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)
            y = _qmm.gather_qmm(x, q, s, b, idx, 64, 4)
            assert y.shape == want.shape and y.dtype == want.dtype
            x32 = np.array(x.astype(mx.float32))
            if x_dtype == mx.float32:
                _check(y, x32, dense, np.array(idx), integer)
            else:  # against the exact product, up to the output's own rounding, as the dense kernel's test
                exact = _product(*_gathered(x32.astype(np.float64), dense, np.array(idx)))
                tol = 1e-2 if y.dtype == mx.bfloat16 else 2e-3
                assert np.allclose(np.array(y.astype(mx.float32)), exact, rtol=tol, atol=tol)
    # Strided x and indices (views) give what their contiguous copies give.
    x = mx.array(rng.standard_normal((4, 3, 1, 128)).astype(np.float32))
    idx = mx.array(rng.integers(0, 6, (4, 3)).astype(np.uint32))
    strided = _qmm.gather_qmm(x.transpose(1, 0, 2, 3), q, s, b, idx.T, 64, 4)
    x_copy = mx.array(np.ascontiguousarray(np.array(x).transpose(1, 0, 2, 3)))
    idx_copy = mx.array(np.array(idx).T.copy())
    assert mx.array_equal(strided, _qmm.gather_qmm(x_copy, q, s, b, idx_copy, 64, 4))


def test_out_of_range_indices_give_zeros_and_bad_arguments_raise():
    q, s, b, _ = _experts(4, 8, 64, 4, 32, mx.float16, seed=2)
    y = _qmm.gather_qmm(mx.ones((1, 1, 64)), q, s, b, mx.array([[1, 4]], dtype=mx.uint32), 32, 4)
    assert y.shape == (1, 2, 1, 8) and mx.all(y[0, 1] == 0).item() and not mx.all(y[0, 0] == 0).item()
    x, idx = mx.zeros((1, 1, 64)), mx.array([0], dtype=mx.uint32)
    with pytest.raises(ValueError, match="bits"):
        _qmm.gather_qmm(x, q, s, b, idx, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        _qmm.gather_qmm(x, q, s, b, idx, 16, 4)
    with pytest.raises(ValueError, match="3-D"):
        _qmm.gather_qmm(x, q[0], s, b, idx, 32, 4)
    with pytest.raises(ValueError, match="columns"):
        _qmm.gather_qmm(mx.zeros((1, 1, 96)), q, s, b, idx, 32, 4)
    with pytest.raises(ValueError, match="integers"):
        _qmm.gather_qmm(x, q, s, b, idx.astype(mx.float32), 32, 4)


def _switch_linear(bits: int, group_size: int, bias: bool) -> QuantizedSwitchLinear:
    mx.random.seed(bits + group_size)
    layer = QuantizedSwitchLinear(128, 40, 8, bias=bias, group_size=group_size, bits=bits)
    if bias:
        layer.bias = mx.random.normal((8, 40))
    mx.eval(layer.parameters())
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (8, 32)])
def test_cpu_switch_linear_computes_mlx_lms_layer(bits, group_size, bias):
    layer = _switch_linear(bits, group_size, bias)
    quantized.reset_native()
    twin = quantized.cpu_quantized(layer)
    assert type(twin) is CpuQuantizedSwitchLinear
    assert (twin.input_dims, twin.output_dims, twin.num_experts) == (128, 40, 8)
    assert twin["weight"] is layer["weight"]  # shared, not copied
    rng = np.random.default_rng(bits)
    x = mx.array(rng.standard_normal((3, 1, 1, 1, 128)).astype(np.float32))
    idx = mx.array(rng.integers(0, 8, (3, 1, 2)).astype(np.uint32))
    want, got = layer(x, idx), twin(x, idx)
    assert got.shape == want.shape
    # MLX's op sums in another order and the integer path rounds x: a few units in the fourth digit.
    assert np.allclose(np.array(got), np.array(want), rtol=1e-3, atol=1e-3 * float(mx.abs(want).max()))


def test_a_layer_of_a_subset_of_experts_and_rows_works_as_given():
    layer = _switch_linear(4, 64, bias=True)
    # The experts 2, 5 and 7, rows 8:32 of each: contiguous copies, as an expert-parallel member holds them.
    keep = mx.array([2, 5, 7])
    part = QuantizedSwitchLinear(128, 24, 3, bias=True, group_size=64, bits=4)
    for name in ("weight", "scales", "biases", "bias"):
        setattr(part, name, mx.contiguous(layer[name][keep][:, 8:32]))
    quantized.reset_native()
    twin = quantized.cpu_quantized(part)
    assert type(twin) is CpuQuantizedSwitchLinear
    x = mx.random.normal((2, 1, 1, 1, 128))
    idx = mx.array([[[0, 2]], [[1, 0]]], dtype=mx.uint32)
    want = layer(x, keep[idx])[..., 8:32]
    span = float(mx.abs(want).max())
    assert np.allclose(np.array(twin(x, idx)), np.array(want), rtol=1e-3, atol=1e-3 * span)


def test_without_the_module_the_switch_layer_stays_mlxs(monkeypatch):
    layer = _switch_linear(4, 64, bias=False)
    monkeypatch.setenv("SHARDLINE_QMM", "0")
    quantized.reset_native()
    try:
        assert quantized.cpu_quantized(layer) is layer
    finally:
        monkeypatch.delenv("SHARDLINE_QMM")
        quantized.reset_native()
    # Formats the kernel lacks keep MLX's op too.
    two_bits = _switch_linear(2, 64, bias=False)
    assert quantized.cpu_quantized(two_bits) is two_bits


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 32)])
def test_a_mixture_of_experts_model_gives_its_logits_after_the_swap(tmp_path: Path, bits, group_size):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(arch_zoo.write("qwen3_moe", tmp_path / "moe")))
    nn.quantize(model, group_size=group_size, bits=bits)
    prompt = mx.array([list(range(3, 43))])  # 40 tokens x 2 experts: mlx-lm sorts them (prefill)
    step = mx.array([[7]])  # then one decode row (unsorted)

    def logits() -> tuple[mx.array, mx.array]:
        cache = make_prompt_cache(model)
        first = model(prompt, cache=cache)
        return first, model(step, cache=cache)

    before = logits()
    quantized.reset_native()
    make_cpu_quantized(model)
    switches = [m for _, m in model.named_modules() if isinstance(m, CpuQuantizedSwitchLinear)]
    assert len(switches) == 3 * len(model.layers)  # gate, up and down of every layer's experts
    after = logits()
    for want, got in zip(before, after, strict=True):
        # The whole model's drift from x's int16 rounding and the summation order, every quantized layer
        # swapped: measured at 2e-5 to 4e-5 of the logits' range; 2e-4 allowed.
        span = float(mx.abs(want).max())
        assert float(mx.abs(got - want).max()) <= 2e-4 * span, (float(mx.abs(got - want).max()), span)
