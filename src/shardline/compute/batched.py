"""Decode positions of several requests through one stage at once: the weights are read once for all.

Each row is one position of its own request, with its own KV cache and position. The projections and the
MLP run on all rows together (one matmul each, where decode's cost is reading the weights); attention runs
per row, against that row's cache. The code follows mlx-lm's llama / qwen2 / qwen3 blocks op for op, and
attention is the function the model's own forward takes for one position (`attention.decode_attention` on
CPU), so a row computes what it computes alone, up to the BLAS kernel's choice for the number of rows
(measured by `shardline bench engine`). A stage's lone decode position takes this path too.

On CPU with the native kernel module (compute/quantized.py), a block's `DecodePlan` swaps the ops that
dominate a decode position once the matmuls are fast: MLX runs rms_norm, rope and silu on CPU as graphs of
a dozen generic ops each (about 25, 60 and 20 us for a few hundred floats), the native ones are one op
each; quantized q/k/v and gate/up projections run as one op per group. The native ops compute the same
functions in float32 (not the same bits: another rounding of cos/sin and exp, within 1e-6 relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shardline.compute import quantized
from shardline.compute.attention import decode_attention, decode_queries


@dataclass(frozen=True)
class DecodePlan:
    """What the native ops take over in one block; None fields keep mlx-lm's own op."""

    ops: Any  # the native module
    qkv: Any = None  # x -> [q, k, v]
    gate_up: Any = None  # x -> [gate, up]
    rope: tuple[int, bool, float, float] | None = None  # dims, traditional, base, scale
    norms: bool = False  # the block's RMSNorms are float32 nn.RMSNorm

    @classmethod
    def of(cls, block: Any) -> DecodePlan | None:
        ops = quantized.native()
        if ops is None or mx.default_device() != mx.cpu:
            return None
        attn, mlp = block.self_attn, block.mlp
        rope = attn.rope
        norms = [block.input_layernorm, block.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        return cls(
            ops=ops,
            qkv=quantized.fused_projection(attn.q_proj, attn.k_proj, attn.v_proj),
            gate_up=quantized.fused_projection(mlp.gate_proj, mlp.up_proj),
            rope=(rope.dims, rope.traditional, float(rope.base), float(rope.scale))
            if type(rope) is nn.RoPE
            else None,
            norms=all(_native_norm(n) for n in norms),
        )

    def norm(self, layer: nn.Module, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, layer["weight"], layer.eps) if self.norms else layer(x)


def _native_norm(layer: nn.Module) -> bool:
    return type(layer) is nn.RMSNorm and layer["weight"].dtype == mx.float32


def norm(plan: DecodePlan | None, layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x) for an RMSNorm, as one native op where the plan allows (and x is float32)."""
    if plan is not None and plan.norms and x.dtype == mx.float32:
        return plan.norm(layer, x)
    return layer(x)


def decode_block(block: Any, h: mx.array, caches: list[Any], plan: DecodePlan | None = None) -> mx.array:
    """One transformer block over h: (rows, 1, hidden), row i at caches[i].offset."""
    attn = block.self_attn
    rows = h.shape[0]
    fast = plan is not None and h.dtype == mx.float32
    p = plan if fast else None
    x = norm(p, block.input_layernorm, h)
    if fast and plan.qkv is not None:
        q, k, v = plan.qkv(x)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.reshape(rows, 1, attn.n_heads, -1)
    k = k.reshape(rows, 1, attn.n_kv_heads, -1)
    v = v.reshape(rows, 1, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3 normalises queries and keys per head
        q, k = norm(p, attn.q_norm, q), norm(p, attn.k_norm, k)
    offsets = mx.array([c.offset for c in caches], dtype=mx.int32)
    if fast and plan.rope is not None:  # rotated in (rows, 1, heads, dim): the layout q and k come in
        q, k = (plan.ops.rope_bthd(t, offsets, *plan.rope) for t in (q, k))
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    else:
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
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
    if not fast:
        return h + block.mlp(block.post_attention_layernorm(h))
    x = norm(p, block.post_attention_layernorm, h)
    if plan.gate_up is None:
        return h + block.mlp(x)
    gate, up = plan.gate_up(x)
    return h + block.mlp.down_proj(plan.ops.silu_mul(gate, up))
