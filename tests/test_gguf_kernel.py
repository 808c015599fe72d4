"""The native kernel's products on GGUF block formats (csrc/qmm/gguf_*, shardline.compute._qmm.gguf_*) against
gguf's own numpy dequantization, for every supported type, odd shapes, 1 to 64 rows, every kernel set this
CPU runs, one thread and two."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from shardline.compute import quantized

try:
    _qmm = quantized._import_native()
except ImportError as exc:  # the install builds it: a missing module is a broken build, not a skip
    pytest.fail(f"the native kernel is not built ({exc}): run `make native`", pytrace=False)

pytestmark = pytest.mark.timeout(60)

ISAS = [isa for isa in ("avx512_vnni", "avx512", "avx2", "neon", "scalar") if _qmm.set_isa(isa)]
_qmm.set_isa("auto")
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
ROWS = (1, 2, 3, 7, 8, 16, 17, 64)
# (N, K in blocks): odd row counts, one block to several.
SHAPES = ((1, 1), (3, 2), (5, 3), (67, 2))
# float32 summation over at most a few thousand terms, relative to the sum of |terms|.
SUM_RTOL = 2e-6


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    isa, gemm, threads = _qmm.isa(), _qmm.gguf_gemm_rows(), _qmm.threads()
    yield
    _qmm.set_isa(isa)
    _qmm.set_gguf_gemm_rows(gemm)
    _qmm.set_threads(threads)


def _half(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def _weights(qtype: T, n: int, blocks: int, seed: int) -> np.ndarray:
    """(n, blocks * block_bytes) uint8: quantized from random floats where gguf's numpy code quantizes the
    type, else random bytes with sane half-precision scales (K-quants)."""
    rng = np.random.default_rng(seed)
    elements, nbytes = _qmm.gguf_block(int(qtype))
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        w = rng.normal(0.0, 0.05, (n, blocks * elements)).astype(np.float32)
        return quants.quantize(w, qtype)
    raw = rng.integers(0, 256, (n, blocks, nbytes), dtype=np.uint8)
    if qtype == T.Q6_K:
        raw[..., 208:210] = _half(rng, (n, blocks), 1e-4, 2e-3)
    else:  # Q4_K, Q5_K: d, dmin
        raw[..., 0:2] = _half(rng, (n, blocks), 1e-4, 2e-3)
        raw[..., 2:4] = _half(rng, (n, blocks), 1e-4, 2e-3)
    return raw.reshape(n, blocks * nbytes)


def _rounded(x: np.ndarray) -> np.ndarray:
    """x as the integer kernels see it: int8 per block of 32, step max|x| / 127, to the nearest, ties even."""
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    step = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(step != 0, np.float32(1) / step, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    return (q.astype(np.float64) * step.astype(np.float64)).reshape(x.shape)


def _check(y: np.ndarray, x: np.ndarray, wf: np.ndarray, integer: bool, what: str) -> None:
    """y against x @ wf.T: exactly the rounded x's product up to float32 sums on the integer path, and within
    the rounding's bound (half a step per element) of the float product either way."""
    x64, w64 = x.astype(np.float64), wf.astype(np.float64)
    xr = _rounded(x) if integer else x64
    want = xr @ w64.T
    scale = np.abs(xr) @ np.abs(w64).T
    err = np.abs(y - want)
    assert np.all(err <= SUM_RTOL * scale + 1e-30), f"{what}: max error {err.max()} over {scale.max()}"
    half_step = np.abs(x64 - _rounded(x)).max() if integer else 0.0
    bound = half_step * np.abs(w64).sum(axis=1) + SUM_RTOL * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(y - x64 @ w64.T) <= bound * 1.001 + 1e-30), f"{what}: beyond the rounding bound"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_against_gguf_dequantize(qtype: T, isa: str) -> None:
    assert _qmm.set_isa(isa)
    assert _qmm.gguf_supported(int(qtype))
    elements, _ = _qmm.gguf_block(int(qtype))
    rng = np.random.default_rng(int(qtype))
    for n, blocks in SHAPES:
        w = _weights(qtype, n, blocks, seed=n * 100 + blocks)
        wf = quants.dequantize(w, qtype).reshape(n, -1)
        k = blocks * elements
        for m in ROWS:
            x = rng.normal(0.0, 1.0, (m, k)).astype(np.float32)
            x[0, : k // 3] *= 20.0  # blocks of very different magnitudes
            for dtype in (mx.float32, mx.float16):
                xm = mx.array(x).astype(dtype)
                xs = np.array(xm.astype(mx.float32))
                y = _qmm.gguf_matmul(xm, mx.array(w), int(qtype))
                assert y.dtype == mx.float32 and y.shape == (m, n)
                # BLAS (from gguf_gemm_rows rows) multiplies the rounded x too: one function of x either way
                _check(np.array(y), xs, wf, True, f"{qtype.name} {isa} n={n} k={k} m={m} {dtype}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_threads_give_the_same_bits(qtype: T) -> None:
    elements, _ = _qmm.gguf_block(int(qtype))
    w = mx.array(_weights(qtype, 203, 2, seed=7))
    x = mx.random.normal((64, 2 * elements), key=mx.random.key(1))
    for isa in ISAS:
        assert _qmm.set_isa(isa)
        for m in (1, 3, 8, 17, 64):
            _qmm.set_threads(1)
            one = np.array(_qmm.gguf_matmul(x[:m], w, int(qtype)))
            _qmm.set_threads(2, 1)
            two = np.array(_qmm.gguf_matmul(x[:m], w, int(qtype)))
            assert np.array_equal(one, two), f"{isa} m={m}"


def test_affine_products_are_the_same_bits_on_two_threads() -> None:
    wf = mx.random.normal((203, 256), key=mx.random.key(2)) * 0.1
    q, s, b = mx.quantize(wf, group_size=32, bits=4)
    x = mx.random.normal((64, 256), key=mx.random.key(3))
    for m in (1, 5, 17, 64):
        _qmm.set_threads(1)
        one = np.array(_qmm.quantized_matmul(x[:m], q, s, b, 32, 4))
        _qmm.set_threads(2, 1)
        two = np.array(_qmm.quantized_matmul(x[:m], q, s, b, 32, 4))
        assert np.array_equal(one, two), f"m={m}"


def test_many_and_swiglu_equal_single_products() -> None:
    # A Q4_K_M layer: q and k in Q4_K, v in Q6_K, one x.
    wq, wk, wv = (mx.array(_weights(t, 37, 2, seed=i)) for i, t in enumerate((T.Q4_K, T.Q4_K, T.Q6_K)))
    types = [int(T.Q4_K), int(T.Q4_K), int(T.Q6_K)]
    for m in (1, 8, 20):
        x = mx.random.normal((1, m, 512), key=mx.random.key(m))
        many = _qmm.gguf_matmul_many(x, [wq, wk, wv], types)
        for y, w, t in zip(many, (wq, wk, wv), types, strict=True):
            assert y.shape == (1, m, 37)
            assert np.array_equal(np.array(y), np.array(_qmm.gguf_matmul(x, w, t)))
        g = np.array(_qmm.gguf_matmul(x, wq, types[0]))
        u = np.array(_qmm.gguf_matmul(x, wv, types[2]))
        want = g / (1.0 + np.exp(-g)) * u
        got = np.array(_qmm.gguf_swiglu(x, wq, types[0], wv, types[2]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_bit_equal_to_gguf_dequantize(qtype: T) -> None:
    w = _weights(qtype, 11, 3, seed=5)
    wf = quants.dequantize(w, qtype).reshape(11, -1)
    ids = np.array([[0, 10, 3], [3, 7, 1]], dtype=np.int32)
    got = np.array(_qmm.gguf_rows(mx.array(w), mx.array(ids), int(qtype)))
    assert got.dtype == np.float32 and got.shape == (2, 3, wf.shape[1])
    assert np.array_equal(got.view(np.uint32), wf[ids].view(np.uint32))


def test_bad_input_is_a_readable_value_error() -> None:
    w = mx.array(_weights(T.Q4_K, 4, 2, seed=0))
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match="GGUF type 10 is not supported"):
        _qmm.gguf_matmul(x, w, 10)
    with pytest.raises(ValueError, match="not supported"):
        _qmm.gguf_block(1)
    assert not _qmm.gguf_supported(1)
    with pytest.raises(ValueError, match="x has 256 columns, w's rows hold 512"):
        _qmm.gguf_matmul(mx.zeros((1, 256)), w, int(T.Q4_K))
    with pytest.raises(ValueError, match="whole number of 144-byte blocks"):
        _qmm.gguf_matmul(x, w[:, :100], int(T.Q4_K))
    with pytest.raises(ValueError, match="2-D uint8"):
        _qmm.gguf_matmul(x, w.astype(mx.int32), int(T.Q4_K))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _qmm.gguf_matmul(x.astype(mx.int32), w, int(T.Q4_K))
    with pytest.raises(ValueError, match="one type per weight"):
        _qmm.gguf_matmul_many(x, [w, w], [int(T.Q4_K)])
    with pytest.raises(ValueError, match="integer"):
        _qmm.gguf_rows(w, mx.zeros((2,)), int(T.Q4_K))
