"""GGUF quantized blocks -> MLX affine quantization (`mx.quantize` layout), without going through float.

MLX's affine form is, per group of `group_size` consecutive inputs of a row, w = scale * q + bias with q an
unsigned `bits`-bit integer, packed little-endian into uint32 words (element i of a row at bits
[i*bits, (i+1)*bits) of the row's bit stream). Most GGUF block types are that form already, in groups of 32:

| GGUF | q (unsigned)      | scale        | bias          | exact                                        |
|------|-------------------|--------------|---------------|----------------------------------------------|
| Q4_0 | 4 bits            | d            | -8 d          | yes                                          |
| Q4_1 | 4 bits            | d            | m             | yes                                          |
| Q5_0 | 5 bits            | d            | -16 d         | yes                                          |
| Q5_1 | 5 bits            | d            | m             | yes                                          |
| Q8_0 | 8 bits (int8+128) | d            | -128 d        | yes                                          |
| Q4_K | 4 bits            | d * sc[j]    | -dmin * m[j]  | yes (32-input sub-blocks j of a 256 block)   |
| Q5_K | 5 bits            | d * sc[j]    | -dmin * m[j]  | yes                                          |

"Exact" means bit for bit what `gguf.quants.dequantize` computes in float32: d, m, dmin are float16 and sc, m
are 6-bit, so every scale and bias above is a float32 without rounding, scale * q is exact too, and the one
addition rounds as gguf's does.

Every other block type (Q6_K, Q2_K, Q3_K, the IQ types, ...) has sub-blocks of 16 inputs with their own
scales, or non-uniform grids, which no MLX group of 32 (its smallest) holds exactly. Those are requantized
from gguf's float32 dequantization to 8 bits in groups of 32 (min/max affine, float16 scale and bias): the
8-bit grid is 4x finer than Q6_K's 6 bits over the same range, so the error added is a fraction of the
error Q6_K itself carries (on Gaussian weights: a relative RMS error of 0.46% against Q6_K's own 2.2%), for
36 bytes per 32 weights against Q6_K's 26.25. 6 bits in groups of 32 (30 bytes) would add about as much
error as Q6_K has already. The error is measured and reported per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GROUP = 32
FALLBACK_BITS = 8
FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F64}
)
_F16_MAX = float(np.finfo(np.float16).max)

# q (blocks, block_size) uint8; scales and biases (blocks, groups of 32) float32
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]


# GGUF block types the CPU kernel reads as stored (csrc/qmm/gguf_*): a matrix of one of these keeps its
# GGUF bytes, and costs them, where the import keeps blocks (import_gguf's weights="quantized").
BLOCK_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


def block_elements(name: str) -> int:
    """The weights in one block of the GGUF type `name` ("Q4_K": 256); KeyError for a type gguf lacks."""
    return int(GGML_QUANT_SIZES[GGMLQuantizationType[name]][0])


def largest_block(config: dict[str, Any]) -> int:
    """The largest quantization block of a model's matrices: its affine group size, or the largest GGUF
    block its config's `gguf_quantization` names (0: float weights). A split of the inputs must keep these
    whole."""
    group = int((config.get("quantization") or {}).get("group_size") or 0)
    blocks = config.get("gguf_quantization") or {}
    return max([group, *(block_elements(name) for name in set(blocks.values()))])


@dataclass(frozen=True)
class Form:
    """What one GGUF tensor becomes: float32, MLX affine with `bits` in groups of 32, or its GGUF blocks."""

    bits: int = 0  # 0: float32 (or blocks)
    exact: bool = True
    blocks: str = ""  # a BLOCK_TYPES name: the rows' GGUF bytes, kept as stored

    @property
    def quantized(self) -> bool:
        """MLX affine (weight, scales, biases)."""
        return self.bits > 0

    @property
    def label(self) -> str:
        if self.blocks:
            return f"{self.blocks.lower()} blocks"
        return f"affine{self.bits}/g{GROUP}" if self.bits else "float32"


FLOAT32 = Form()


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (blocks, 2) as float32 (blocks, 1)."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: byte i holds element i (low nibble) and element i + n/2 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits, bit i of a little-endian uint32 for element i -> (blocks, 32) of 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return q, d, -16 * d


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, 0:2])
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d  # int8 + 128, as unsigned


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 sub-blocks' scales d * sc and biases -dmin * m (blocks, 8), float32 exact."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]  # the 12 bytes hold 8 six-bit scales and 8 six-bit mins
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> Unpacked:
    scales, biases = _k_scales(b)
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return q, scales, biases


def _q5_k(b: np.ndarray) -> Unpacked:
    scales, biases = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32)
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit j: sub-block j's fifth bit
    return (low | (high << 4)).reshape(-1, 256), scales, biases


_EXACT: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], Unpacked]]] = {
    GGMLQuantizationType.Q4_0: (4, _q4_0),
    GGMLQuantizationType.Q4_1: (4, _q4_1),
    GGMLQuantizationType.Q5_0: (5, _q5_0),
    GGMLQuantizationType.Q5_1: (5, _q5_1),
    GGMLQuantizationType.Q8_0: (8, _q8_0),
    GGMLQuantizationType.Q4_K: (4, _q4_k),
    GGMLQuantizationType.Q5_K: (5, _q5_k),
}


def form_for(qtype: GGMLQuantizationType, shape: tuple[int, ...], blocks: bool = False) -> Form:
    """The form a GGUF tensor of `qtype` and HF `shape` takes: only matrices (2-D, or 3-D stacks of experts'
    matrices) whose input dimension divides into groups of 32 are quantized (norms, biases and odd shapes
    stay float32). With `blocks`, a 2-D matrix of a BLOCK_TYPES type stays as stored (expert stacks stay
    affine: mlx-lm's switch layers gather them)."""
    if qtype in FLOAT_TYPES or len(shape) not in (2, 3) or shape[-1] % GROUP:
        return FLOAT32  # float GGUF tensors are already exact as float32 (float16 matmul ran slower on CPU)
    if blocks and qtype in BLOCK_TYPES and len(shape) == 2 and shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
        return Form(blocks=qtype.name)
    if qtype in _EXACT:
        return Form(bits=_EXACT[qtype][0])
    return Form(bits=FALLBACK_BITS, exact=False)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) unsigned values < 2**bits -> MLX's packed (rows, n * bits / 32) uint32 words."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    rows, n = q.shape
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    else:  # the general little-endian bit stream (the fast paths above are special cases of it)
        stream = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(stream.reshape(rows, n * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").reshape(rows, n * bits // 32)


def unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of `pack`: (rows, n * bits / 32) uint32 -> (rows, n) uint8."""
    raw = np.ascontiguousarray(words, dtype="<u4").view(np.uint8)
    stream = np.unpackbits(raw, axis=-1, bitorder="little").reshape(raw.shape[0], n, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


@dataclass
class Affine:
    """One matrix in MLX's affine form, scales and biases still float32 (the writer picks their dtype)."""

    weight: np.ndarray  # (rows, cols * bits / 32) uint32
    scales: np.ndarray  # (rows, cols / 32) float32
    biases: np.ndarray
    bits: int
    max_abs_error: float = 0.0  # against gguf's float32 dequantization (0 for the exact forms)
    sq_error: float = 0.0  # sum of squared errors, and of squared weights: relative RMS over many tensors
    sq_weight: float = 0.0

    def dequantized(self) -> np.ndarray:
        """scale * q + bias in float32, as MLX computes it."""
        rows = self.weight.shape[0]
        cols = self.scales.shape[1] * GROUP
        q = unpack(self.weight, self.bits, cols).reshape(rows, -1, GROUP).astype(np.float32)
        return (q * self.scales[..., None] + self.biases[..., None]).reshape(rows, cols)

    def rows(self, order: Callable[[np.ndarray], np.ndarray]) -> Affine:
        """The same matrix with its rows reordered by `order` (whole rows move: exact)."""
        return Affine(
            order(self.weight), order(self.scales), order(self.biases), self.bits,
            self.max_abs_error, self.sq_error, self.sq_weight,
        )  # fmt: skip


def _exact(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> Affine:
    bits, unpacker = _EXACT[qtype]
    rows, cols = shape
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    q, scales, biases = unpacker(blocks)
    return Affine(
        pack(q.reshape(rows, cols), bits),
        np.ascontiguousarray(scales.reshape(rows, cols // GROUP), dtype=np.float32),
        np.ascontiguousarray(biases.reshape(rows, cols // GROUP), dtype=np.float32),
        bits,
    )


def _f16_up(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (x >= 0), as float32."""
    h = x.astype(np.float16)
    below = h.astype(np.float32) < x
    h[below] = np.nextafter(h[below], np.float16(np.inf))
    return h.astype(np.float32)


def requantize(w: np.ndarray, bits: int = FALLBACK_BITS) -> Affine:
    """Min/max affine quantization of a float32 (rows, cols) matrix in groups of 32, with scales and biases
    chosen as float16 values (so they are stored in 2 bytes without further loss), errors measured."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    top = (1 << bits) - 1
    if max(float(np.abs(lo).max(initial=0)), float((hi - lo).max(initial=0)) / top) < _F16_MAX / 2:
        scales, biases = _f16_up((hi - lo) / top), lo.astype(np.float16).astype(np.float32)
    else:  # beyond float16's range: float32 scales (the writer keeps them so)
        scales, biases = (hi - lo) / top, lo
    safe = np.where(scales > 0, scales, 1.0)
    q = np.clip(np.rint((g - biases[..., None]) / safe[..., None]), 0, top).astype(np.uint8)
    out = Affine(pack(q.reshape(rows, cols), bits), scales, biases, bits)
    err = out.dequantized() - w
    out.max_abs_error = float(np.abs(err).max(initial=0))
    out.sq_error = float(np.square(err, dtype=np.float64).sum())
    out.sq_weight = float(np.square(w, dtype=np.float64).sum())
    return out


def to_affine(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Affine:
    """A GGUF tensor's raw blocks (as GGUFReader gives them) in MLX's affine form (see `form_for`).

    A 3-D stack [experts, out, in] comes back as its (experts * out, in) rows: GGUF quantizes each row on
    its own, so every expert's [out, in] slice is quantized as MLX's QuantizedSwitchLinear reads it once
    the caller reshapes weight, scales and biases to [experts, out, ...]."""
    shape = (math.prod(shape[:-1]), shape[-1])
    if qtype in _EXACT:
        return _exact(data, qtype, shape)
    w = np.ascontiguousarray(dequantize(data, qtype).reshape(shape), dtype=np.float32)
    if not np.isfinite(w).all():  # min/max of a group would be meaningless
        raise ValueError("non-finite weights")
    return requantize(w)


def check_rows(data: np.ndarray, qtype: GGMLQuantizationType, affine: Affine, rows: int = 4) -> float:
    """Max abs difference of the first `rows` rows against gguf's own dequantization: a cheap guard that an
    exact form is exact (0.0), run at every import."""
    n = min(rows, affine.weight.shape[0])
    rows_data = data.reshape(-1, data.shape[-1])  # a 3-D expert stack's rows, as to_affine reads them
    want = dequantize(np.ascontiguousarray(rows_data[:n]), qtype).reshape(n, -1)
    got = Affine(affine.weight[:n], affine.scales[:n], affine.biases[:n], affine.bits).dequantized()
    # Equal values (infinities included) and NaN where gguf has NaN (a broken file, kept as it is) agree.
    with np.errstate(invalid="ignore"):
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        diff = np.where(same, 0.0, np.nan_to_num(np.abs(got - want), nan=np.inf))
    return float(diff.max(initial=0))


def float16_exact(*arrays: np.ndarray) -> bool:
    """True when every value survives a float16 round trip (then 2 bytes store it without loss)."""
    for a in arrays:
        with np.errstate(over="ignore"):
            if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
                return False
    return True
