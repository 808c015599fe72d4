"""Attention whose scratch memory does not grow with the context it attends to.

A prefill chunk of n queries over L keys materialises n*L scores per head in the stock kernel on CPU, so
long prompts blow the memory up (the failure this project grew from). Above a budget we walk the keys in
blocks with an online softmax: the same result, with scratch bounded by n * block instead of n * L.

On CPU every prefill chunk takes the tiled path, in base 2 with a polynomial exp2: MLX's CPU `exp` runs one
element at a time and was about 60% of the stock kernel's time at a few thousand keys, while the
multiply-adds of a polynomial vectorise (`bench attention` measures the two side by side).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import mlx.core as mx

from shardline.compute.fastmath import exp2_nonpositive
from shardline.compute.paged_kv import BlockSeq

# Scores per head above which the tiled path is taken; also the tile size in keys for a chunk of n queries.
DEFAULT_SCORE_BUDGET = 256 * 1024
# Keys per tile for a runner's chunk: large tiles keep the matmuls big and the syncs few (one per tile).
# 1,024-key tiles peaked about a fifth above the stock kernel's scratch at a 1,024-token context; 768-key
# tiles keep any longer prompt at a short one's scratch (`bench engine` measures the two).
TILE_KEYS = 768


def score_budget(prefill_step: int) -> int:
    """A runner's budget: a chunk of prefill_step queries walks the keys in tiles of TILE_KEYS."""
    return max(1, prefill_step) * TILE_KEYS


def whole(x: mx.array | BlockSeq) -> mx.array:
    """Keys or values as one array: a paged cache's blocks joined, a contiguous cache's view as it is."""
    return x.concat() if isinstance(x, BlockSeq) else x


def _positions(x: mx.array | BlockSeq, start: int, stop: int) -> mx.array:
    """Positions [start, stop) of keys or values (B, Hkv, L, D), joining only the blocks they lie in."""
    return x.slice(start, stop) if isinstance(x, BlockSeq) else x[:, :, start:stop, :]


def _exp_base2(x: mx.array) -> mx.array:
    return mx.exp(x * math.log(2.0))


def decode_queries(q: mx.array, scale: float, kv_heads: int) -> mx.array:
    """Decode queries (B, H, 1, D) -> scaled and grouped by KV head, (B, Hkv, H / Hkv, D)."""
    b, h, _, d = q.shape
    return (q * scale).reshape(b, kv_heads, h // kv_heads, d)


def decode_attention(qg: mx.array, keys: mx.array | BlockSeq, values: mx.array | BlockSeq) -> mx.array:
    """One decode position of one request on CPU: qg (1, Hkv, rep, D) from `decode_queries` over its
    cache's keys and values (1, Hkv, L, D) -> (1, Hkv, rep, D).

    The stock kernel falls back to the same math on CPU in about twice the ops; ops, not arithmetic, are
    what a decode position's attention costs, once per request in a batch. The lone path and the batched
    one (`batched.decode_block`) both come here, so a request computes the same bits in either. A paged
    cache's blocks are joined first (the native op, `batched._native_block`, reads them where they lie)."""
    scores = qg @ whole(keys).swapaxes(-1, -2)
    return mx.softmax(scores, axis=-1, precise=True) @ whole(values)


def tiled_causal_attention(
    q: mx.array,
    k: mx.array | BlockSeq,
    v: mx.array | BlockSeq,
    scale: float,
    key_block: int,
    fast_exp: bool = False,
) -> mx.array:
    """Causal attention of the last n positions (q) over all L keys, walking keys in blocks.

    q: (B, H, n, D); k, v: (B, Hkv, L, D) with H a multiple of Hkv (grouped-query attention), as arrays
    or as a paged cache's BlockSeq (each tile then joins only the cache blocks it spans, so no copy of the
    whole context is ever made). Scores are kept in base 2 (log2(e) folded into the scale); `fast_exp`
    takes exp2 from `exp2_nonpositive`.
    """
    b, h, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = h // hkv
    exp2 = exp2_nonpositive if fast_exp else _exp_base2
    qg = (q * (scale * math.log2(math.e))).reshape(b, hkv, rep, n, d)
    q_pos = mx.arange(length - n, length).reshape(n, 1)
    m = mx.full((b, hkv, rep, n, 1), -math.inf, dtype=mx.float32)
    denom = mx.zeros((b, hkv, rep, n, 1), dtype=mx.float32)
    acc = mx.zeros((b, hkv, rep, n, v.shape[-1]), dtype=mx.float32)
    for start in range(0, length, key_block):
        stop = min(start + key_block, length)
        kb = _positions(k, start, stop)[:, :, None]
        vb = _positions(v, start, stop)[:, :, None]
        scores = (qg @ kb.swapaxes(-1, -2)).astype(mx.float32)
        if stop > length - n:  # only blocks reaching into the chunk itself need the causal mask
            k_pos = mx.arange(start, stop).reshape(1, -1)
            # An additive mask of one (n, block) plane: cheaper than a select over every head's scores.
            scores = scores + mx.where(k_pos <= q_pos, 0.0, -math.inf)
        m_new = mx.maximum(m, scores.max(axis=-1, keepdims=True))
        p = exp2(scores - m_new)
        correction = exp2(m - m_new)
        denom = denom * correction + p.sum(axis=-1, keepdims=True)
        acc = acc * correction + p @ vb.astype(mx.float32)
        m = m_new
        # Evaluate as we go: a lazy graph of all blocks may run breadth first and hold them all.
        mx.eval(m, denom, acc)
    out = (acc / denom).astype(q.dtype)
    return out.reshape(b, h, n, -1)


class BoundedAttention:
    """Drop-in for mlx-lm's `scaled_dot_product_attention` that switches to tiles above a score budget,
    and on CPU takes the tiled path for every prefill chunk (see the module's note)."""

    def __init__(self, original: Any, score_budget: int = DEFAULT_SCORE_BUDGET) -> None:
        self.original = original
        self.score_budget = score_budget

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):  # type: ignore[no-untyped-def]
        n, length = queries.shape[2], keys.shape[2]
        on_cpu = mx.default_device() == mx.cpu
        masked = mask is not None and not isinstance(mask, str)  # an explicit mask array: not causal alone
        if masked or sinks is not None or hasattr(cache, "bits"):
            return self._stock(queries, keys, values, cache, scale, mask, sinks)
        if n == 1:
            if not on_cpu or queries.shape[0] != 1:
                return self._stock(queries, keys, values, cache, scale, mask, sinks)
            qg = decode_queries(queries, scale, keys.shape[1])
            return decode_attention(qg, keys, values).reshape(queries.shape)
        if n * length <= self.score_budget and not on_cpu:
            return self._stock(queries, keys, values, cache, scale, mask, sinks)
        key_block = max(64, self.score_budget // n)
        return tiled_causal_attention(queries, keys, values, scale, key_block, fast_exp=on_cpu)

    def _stock(
        self,
        queries: mx.array,
        keys: mx.array | BlockSeq,
        values: mx.array | BlockSeq,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any,
    ) -> mx.array:
        # The stock kernel reads one array: a paged cache's blocks are joined for it.
        k, v = whole(keys), whole(values)
        return self.original(queries, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model_module: ModuleType, score_budget: int = DEFAULT_SCORE_BUDGET) -> None:
    """Route one mlx-lm model module's attention through the bounded version (idempotent)."""
    current = model_module.scaled_dot_product_attention
    original = current.original if isinstance(current, BoundedAttention) else current
    model_module.scaled_dot_product_attention = BoundedAttention(original, score_budget)
