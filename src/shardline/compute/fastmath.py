"""Elementwise exponentials from vectorised ops: MLX's CPU `exp` runs one element at a time.

Attention's softmax over thousands of keys and sampling's log-normaliser over the vocabulary each spend
most of their time in `exp` otherwise (`bench attention` measures the first).
"""

from __future__ import annotations

import math

import mlx.core as mx

# 2 * 2**f on (-1, 0]: a degree-5 fit for relative error, within 3e-7 of exp2 when evaluated in float32.
_EXP2_POLY = tuple(
    2 * c
    for c in (
        0.9999999250699043,
        0.693142252645196,
        0.24017218924347988,
        0.05527972204224485,
        0.00918861075187588,
        0.000938787840926214,
    )
)


def exp2_nonpositive(x: mx.array) -> mx.array:
    """2**x for float32 x <= 0 (-inf included), from vectorised ops only.

    The result is exactly 0 at or below 2**-126 and a normal float above it, never a subnormal: real
    attention has many keys far below the row's maximum, and subnormal arithmetic is many times slower on
    x86. The value is (2 * 2**frac) * 2**(whole - 1), the second factor written straight into the exponent
    bits, where an exponent field of 0 reads as 0.0."""
    x = mx.maximum(x, -126.0)
    whole = x.astype(mx.int32)  # rounds toward zero, so the fraction lies in (-1, 0]
    frac = x - whole.astype(mx.float32)
    p = _EXP2_POLY[-1]
    for c in _EXP2_POLY[-2::-1]:
        p = p * frac + c
    return p * mx.left_shift(whole + 126, 23).view(mx.float32)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over a 1-D float32 array, as a scalar; -inf for an all -inf x."""
    m = mx.max(x)
    m = mx.where(mx.isinf(m), 0.0, m)  # all -inf: sum 0, log -inf
    return m + mx.log(exp2_nonpositive((x - m) * math.log2(math.e)).sum())
