"""GGUF blocks -> MLX affine quantization: exact where models/gguf_quant.py's table says so, checked against
gguf's own dequantization through MLX's own dequantize; the packing against mx.quantize; the writer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from shardline.models.gguf_quant import (
    FLOAT32,
    Form,
    check_rows,
    float16_exact,
    form_for,
    pack,
    requantize,
    to_affine,
    unpack,
)
from shardline.models.safetensors_stream import write_safetensors

T = GGMLQuantizationType
ROWS, COLS = 6, 512  # two K-quant super-blocks per row
EXACT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K]
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
# Byte offsets of each type's float16 fields (d, and m or dmin): random bytes there could be NaN or inf.
F16_FIELDS = {
    T.Q4_0: [0], T.Q8_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
    T.Q6_K: [208],
}  # fmt: skip


def raw_blocks(qtype: GGMLQuantizationType, seed: int, scale: float = 0.02) -> np.ndarray:
    """A (ROWS, bytes per row) tensor of random blocks: every bit pattern of the quants and sub-block scales,
    with finite random float16 block scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n = ROWS * COLS // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        blocks[:, at : at + 2] = (rng.standard_normal((n, 1)) * scale).astype("<f2").view(np.uint8)
    return blocks.reshape(ROWS, -1)


def mlx_dequantized(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What MLX computes from the stored form: scales and biases as stored (float16 where that is exact),
    widened to float32 as a float32 activation makes quantized_matmul do."""
    a = to_affine(data, qtype, (ROWS, COLS))
    stored = np.float16 if float16_exact(a.scales, a.biases) else np.float32
    scales = mx.array(a.scales.astype(stored)).astype(mx.float32)
    biases = mx.array(a.biases.astype(stored)).astype(mx.float32)
    w = mx.dequantize(mx.array(a.weight), scales, biases, group_size=32, bits=a.bits)
    assert w.dtype == mx.float32
    return np.array(w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("qtype", EXACT, ids=lambda t: t.name)
def test_exact_types_dequantize_to_what_gguf_does(qtype: GGMLQuantizationType) -> None:
    """Random raw blocks, and for the types gguf-py can quantize, blocks quantized from random weights."""
    sources = [raw_blocks(qtype, seed) for seed in range(3)]
    try:
        sources.append(
            quantize(np.random.default_rng(9).standard_normal((ROWS, COLS)).astype(np.float32), qtype)
        )
    except NotImplementedError:  # gguf-py quantizes neither Q4_K nor Q5_K
        pass
    assert form_for(qtype, (ROWS, COLS)) == Form(bits=BITS[qtype])
    for data in sources:
        want = dequantize(data, qtype).reshape(ROWS, COLS)
        got = mlx_dequantized(data, qtype)
        # Equal values (a zero may differ in sign: gguf's d * (q - 8) is -0.0 where d < 0 and q = 8).
        np.testing.assert_array_equal(got, want)
        assert check_rows(data, qtype, to_affine(data, qtype, (ROWS, COLS))) == 0.0


@pytest.mark.timeout(60)
def test_block_scales_are_stored_as_float16_where_that_is_exact() -> None:
    # d (and m) are float16 in the GGUF, and -8d, -16d, -128d stay float16 numbers.
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        a = to_affine(raw_blocks(qtype, 1), qtype, (ROWS, COLS))
        assert float16_exact(a.scales, a.biases), qtype.name
    # d * sc needs up to 17 significant bits: float32.
    a = to_affine(raw_blocks(T.Q4_K, 1), T.Q4_K, (ROWS, COLS))
    assert not float16_exact(a.scales, a.biases)
    # A d so large that -128 d overflows float16 is kept as float32.
    data = raw_blocks(T.Q8_0, 2)
    data.reshape(-1, 34)[0, 0:2] = np.array([1000.0], "<f2").view(np.uint8)
    a = to_affine(data, T.Q8_0, (ROWS, COLS))
    assert not float16_exact(a.scales, a.biases)
    np.testing.assert_array_equal(a.dequantized(), dequantize(data, T.Q8_0).reshape(ROWS, COLS))


@pytest.mark.timeout(60)
def test_q6_k_is_requantized_to_8_bits_within_its_stated_error() -> None:
    """Q6_K's 16-input sub-blocks have no exact MLX form: 8 bits in groups of 32, min/max affine with float16
    scale and bias. Stated bound per group: half a step (range / 255 / 2) plus the float16 rounding of the
    bias (|min| * 2**-11); overall a relative RMS error below 1%."""
    assert form_for(T.Q6_K, (ROWS, COLS)) == Form(bits=8, exact=False)
    for seed in range(3):
        data = raw_blocks(T.Q6_K, seed, scale=0.001)
        want = dequantize(data, T.Q6_K).reshape(ROWS, COLS)
        a = to_affine(data, T.Q6_K, (ROWS, COLS))
        assert a.bits == 8 and float16_exact(a.scales, a.biases)  # 36 bytes per 32 weights
        got = mlx_dequantized(data, T.Q6_K)
        groups = want.reshape(ROWS, -1, 32)
        lo, hi = groups.min(-1), groups.max(-1)
        bound = (hi - lo) / 255 / 2 * (1 + 2**-10) + np.abs(lo) * 2**-11
        err = np.abs(got - want).reshape(ROWS, -1, 32).max(-1)
        assert (err <= bound).all(), float((err / bound).max())
        rel_rms = float(np.sqrt(np.square(got - want).sum() / np.square(want).sum()))
        assert rel_rms < 0.01
        assert a.max_abs_error == pytest.approx(float(np.abs(got - want).max()))
        assert a.sq_error / a.sq_weight == pytest.approx(rel_rms**2, rel=1e-3)


@pytest.mark.timeout(30)
def test_forms_of_tensors_that_stay_float32() -> None:
    assert form_for(T.Q4_1, (576,)) == FLOAT32  # 1-D: a norm or a bias
    assert form_for(T.Q8_0, (64, 48)) == FLOAT32  # inputs not a multiple of 32
    assert form_for(T.F16, (64, 64)) == FLOAT32  # float in the GGUF already
    assert form_for(T.F32, (64, 64)).label == "float32"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_own(bits: int) -> None:
    w = mx.random.normal((5, 256), key=mx.random.key(bits))
    words, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    q = unpack(np.array(words), bits, 256)
    assert q.max() < 2**bits
    np.testing.assert_array_equal(pack(q, bits), np.array(words))
    back = (q.reshape(5, -1, 32) * np.array(scales)[..., None] + np.array(biases)[..., None]).reshape(5, 256)
    np.testing.assert_allclose(back, np.array(mx.dequantize(words, scales, biases, group_size=32, bits=bits)))


@pytest.mark.timeout(30)
def test_requantize_keeps_constant_groups_and_refuses_nothing() -> None:
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = 3.0
    a = requantize(w)
    np.testing.assert_array_equal(a.dequantized(), w)
    assert a.max_abs_error == 0.0


@pytest.mark.timeout(30)
def test_streamed_writer_holds_float32_float16_and_uint32(tmp_path: Path) -> None:
    arrays = {
        "a.weight": np.arange(12, dtype=np.uint32).reshape(3, 4) * 7919,
        "a.scales": np.array([[0.5], [1.5], [-2.0]], np.float16),
        "a.biases": np.array([[1e-3], [2.0], [3.0]], np.float32),
        "norm": np.ones(5, np.float32),
    }
    shapes = {k: v.shape for k, v in arrays.items()}
    path = tmp_path / "m.safetensors"
    write_safetensors(path, shapes, arrays.items(), metadata={"format": "mlx"})
    loaded = load_file(str(path))
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)
    # The header was sized for all-float32 offsets and padded with spaces; the data follows it at once.
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and raw[8 : 8 + n].rstrip(b" ") == raw[8 : 8 + n].rstrip()
    assert len(raw) == 8 + n + sum(a.nbytes for a in arrays.values())
    assert header["a.scales"]["dtype"] == "F16" and header["a.weight"]["dtype"] == "U32"
    loaded_mx = mx.load(str(path))
    assert loaded_mx["a.weight"].dtype == mx.uint32 and loaded_mx["a.scales"].dtype == mx.float16
    with pytest.raises(ValueError, match="is not float32, float16, uint32, uint8"):
        write_safetensors(tmp_path / "bad.safetensors", {"x": (2,)}, [("x", np.zeros(2, np.int64))])
