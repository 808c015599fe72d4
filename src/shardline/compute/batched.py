"""Decode positions of several requests through one stage at once: the weights are read once for all.

Each row is one position of its own request, with its own KV cache and position. The projections and the
MLP run on all rows together (one matmul each, where decode's cost is reading the weights); attention runs
per row, against that row's cache. `decode_block` follows mlx-lm's llama / qwen2 / qwen3 blocks op for op,
and attention is the function the model's own forward takes for one position (`attention.decode_attention`
on CPU), so a row computes what it computes alone, up to the BLAS kernel's choice for the number of rows
(measured by `shardline bench engine`). A stage's lone decode position takes this path too.

On CPU with the native module (compute/quantized.py), `decode_stack` runs a block's decode position in
about ten ops instead of about thirty: MLX runs rms_norm, rope and silu on CPU as graphs of a dozen generic
ops each (about 25, 60 and 20 us for a few hundred floats) and attention at one position as half a dozen,
while each is one native op here; quantized q/k/v projections run as one op, gate/up and silu as one, and
each residual sum rides with the norm after it. Per op, not per float, is what a decode position costs
once the matmuls run at memory speed. The native ops compute the same functions in float32 (not the same
bits: another rounding of cos/sin and exp, within 1e-6 relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shardline.compute import quantized
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


def _rms(layer: Any) -> bool:
    return type(layer) is nn.RMSNorm and layer["weight"].dtype == mx.float32


@dataclass(frozen=True)
class DecodePlan:
    """A block's decode position in native ops (None where the block has parts they do not cover)."""

    ops: Any  # the native module
    rope: tuple[int, bool, float, float]  # dims, traditional, base, scale
    qkv: Any = None  # x -> [q, k, v] in one op (quantized projections), else the layers one by one
    swiglu: Any = None  # x -> silu(gate(x)) * up(x) in one op (quantized), else native silu of the two

    @classmethod
    def of(cls, block: Any) -> DecodePlan | None:
        ops = quantized.native()
        if ops is None or mx.default_device() != mx.cpu:
            return None
        attn, mlp = block.self_attn, block.mlp
        norms = [block.input_layernorm, block.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        if type(attn.rope) is not nn.RoPE or not all(_rms(n) for n in norms):
            return None  # scaled rope variants, other norms: mlx-lm's ops (decode_block)
        rope = attn.rope
        return cls(
            ops=ops,
            rope=(rope.dims, rope.traditional, float(rope.base), float(rope.scale)),
            qkv=quantized.fused_projection(attn.q_proj, attn.k_proj, attn.v_proj),
            swiglu=quantized.fused_swiglu(mlp.gate_proj, mlp.up_proj),
        )


def decode_stack(
    blocks: list[Any], plans: list[DecodePlan | None], h: mx.array, caches: list[list[Any]]
) -> mx.array:
    """Every block over h (rows, 1, hidden); caches[j][i] is row i's cache of block j. Blocks with a plan
    run in native ops, the others as `decode_block`."""
    pending = None  # the last MLP's output, added to h by the next block's first norm
    offsets = mx.array([c.offset for c in caches[0]], dtype=mx.int32) if caches else None
    for block, plan, layer_caches in zip(blocks, plans, caches, strict=True):
        if plan is None or h.dtype != mx.float32:
            h = h if pending is None else h + pending
            pending = None
            h = decode_block(block, h, layer_caches)
        else:
            h, pending = _native_block(block, plan, h, pending, layer_caches, offsets)
    return h if pending is None else h + pending


def _native_block(
    block: Any, plan: DecodePlan, h: mx.array, pending: mx.array | None, caches: list[Any], offsets: mx.array
) -> tuple[mx.array, mx.array]:
    """(h, the MLP's output not yet added to it) after one block, h + pending coming in."""
    ops, attn, mlp = plan.ops, block.self_attn, block.mlp
    rows = h.shape[0]
    norm = block.input_layernorm
    if pending is None:
        x = ops.rms_norm(h, norm["weight"], norm.eps)
    else:
        h, x = ops.add_rms_norm(h, pending, norm["weight"], norm.eps)
    q, k, v = plan.qkv(x) if plan.qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    head_dim = q.shape[-1] // attn.n_heads
    if hasattr(attn, "q_norm"):  # qwen3 normalises queries and keys per head
        qn, kn = attn.q_norm, attn.k_norm
        q = ops.rms_norm(q.reshape(rows, 1, attn.n_heads, head_dim), qn["weight"], qn.eps)
        k = ops.rms_norm(k.reshape(rows, 1, attn.n_kv_heads, head_dim), kn["weight"], kn.eps)
    q = ops.rope_bthd(q, offsets, *plan.rope, head_dim)
    k = ops.rope_bthd(k, offsets, *plan.rope, head_dim)
    # One position per row: (rows, 1, heads * dim) is already (rows, heads, 1, dim), the cache's layout.
    k = k.reshape(rows, attn.n_kv_heads, 1, head_dim)
    v = v.reshape(rows, attn.n_kv_heads, 1, head_dim)
    qs, ks, vs = (mx.split(t, rows, axis=0) if rows > 1 else [t] for t in (q, k, v))
    outs = []
    for i, cache in enumerate(caches):
        keys, values = cache.update_and_fetch(ks[i], vs[i])
        outs.append(ops.decode_attention(qs[i], keys, values, attn.scale))  # (1, 1, heads * dim)
    o = mx.concatenate(outs, axis=0) if rows > 1 else outs[0]
    norm = block.post_attention_layernorm
    h, x = ops.add_rms_norm(h, attn.o_proj(o), norm["weight"], norm.eps)
    act = plan.swiglu(x) if plan.swiglu is not None else ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x))
    return h, mlp.down_proj(act)
