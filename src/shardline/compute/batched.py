"""Decode positions of several requests through one stage at once: the weights are read once for all.

Each row is one position of its own request, with its own KV cache and position. The projections and the
MLP run on all rows together (one matmul each, where decode's cost is reading the weights); attention runs
per row, against that row's cache. The code follows mlx-lm's llama / qwen2 / qwen3 blocks op for op, and
attention is the function the model's own forward takes for one position (`attention.decode_attention` on
CPU), so a row computes what it computes alone, up to the BLAS kernel's choice for the number of rows
(measured by `shardline bench engine`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from shardline.compute.attention import decode_attention, decode_queries


def decode_block(block: Any, h: mx.array, caches: list[Any]) -> mx.array:
    """One transformer block over h: (rows, 1, hidden), row i at caches[i].offset."""
    attn = block.self_attn
    rows = h.shape[0]
    x = block.input_layernorm(h)
    q = attn.q_proj(x).reshape(rows, 1, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(rows, 1, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(rows, 1, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3 normalises queries and keys per head
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    offsets = mx.array([c.offset for c in caches])
    q = attn.rope(q, offset=offsets)
    k = attn.rope(k, offset=offsets)
    on_cpu = mx.default_device() == mx.cpu
    # The queries scaled and grouped once for every row, and each tensor split into rows by one op: the loop
    # keeps only what is per request.
    qq = decode_queries(q, attn.scale, attn.n_kv_heads) if on_cpu else q
    qs, ks, vs = (mx.split(t, rows, axis=0) if rows > 1 else [t] for t in (qq, k, v))
    outs = []
    for i, cache in enumerate(caches):
        keys, values = cache.update_and_fetch(ks[i], vs[i])
        if on_cpu:
            outs.append(decode_attention(qs[i], keys, values))  # (1, Hkv, rep, D)
        else:
            o = mx.fast.scaled_dot_product_attention(qs[i], keys, values, scale=attn.scale)
            outs.append(o.transpose(0, 2, 1, 3))  # (1, 1, H, D)
    o = mx.concatenate(outs, axis=0) if rows > 1 else outs[0]  # either way a row's heads lie in order
    h = h + attn.o_proj(o.reshape(rows, 1, -1))
    return h + block.mlp(block.post_attention_layernorm(h))
