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
from shardline.compute.attention import decode_attention, decode_queries, whole
from shardline.compute.paged_kv import PagedKV


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
            o = mx.fast.scaled_dot_product_attention(qs[i], whole(keys), whole(values), scale=attn.scale)
            outs.append(o.transpose(0, 2, 1, 3))  # (1, 1, H, D)
    o = mx.concatenate(outs, axis=0) if rows > 1 else outs[0]  # either way a row's heads lie in order
    h = h + attn.o_proj(o.reshape(rows, 1, -1))
    return h + block.mlp(block.post_attention_layernorm(h))


def _rms(layer: Any) -> bool:
    return type(layer) is nn.RMSNorm and layer["weight"].dtype == mx.float32


@dataclass(frozen=True)
class DecodePlan:
    """A block's decode position in native ops, with every weight and setting looked up once at load: a
    module's attribute lookups cost microseconds each, and a decode position makes hundreds."""

    ops: Any  # the native module
    rope: tuple[int, bool, float, float]  # dims, traditional, base, scale
    heads: int
    kv_heads: int
    scale: float
    norms: tuple[Any, float, Any, float]  # input and post-attention RMSNorms: weight, eps, weight, eps
    qk_norms: tuple[Any, float, Any, float] | None  # qwen3's per-head query and key norms
    qkv: Any  # x -> [q, k, v] (one op for quantized projections)
    o_proj: Any
    act: Any  # x -> silu(gate(x)) * up(x) (one op for quantized projections)
    down: Any

    @classmethod
    def of(cls, block: Any) -> DecodePlan | None:
        ops = quantized.native()
        if ops is None or mx.default_device() != mx.cpu:
            return None
        attn, mlp = block.self_attn, block.mlp
        norms = [block.input_layernorm, block.post_attention_layernorm]
        qk = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []
        if type(attn.rope) is not nn.RoPE or not all(_rms(n) for n in norms + qk):
            return None  # scaled rope variants, other norms: mlx-lm's ops (decode_block)
        rope = attn.rope
        qkv = quantized.fused_projection(attn.q_proj, attn.k_proj, attn.v_proj)
        if qkv is None:
            q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj

            def qkv(x: mx.array) -> list[mx.array]:
                return [q_proj(x), k_proj(x), v_proj(x)]

        act = quantized.fused_swiglu(mlp.gate_proj, mlp.up_proj)
        if act is None:
            gate, up = mlp.gate_proj, mlp.up_proj

            def act(x: mx.array) -> mx.array:
                return ops.silu_mul(gate(x), up(x))

        return cls(
            ops=ops,
            rope=(rope.dims, rope.traditional, float(rope.base), float(rope.scale)),
            heads=attn.n_heads,
            kv_heads=attn.n_kv_heads,
            scale=float(attn.scale),
            norms=tuple(v for n in norms for v in (n["weight"], n.eps)),
            qk_norms=tuple(v for n in qk for v in (n["weight"], n.eps)) or None,
            qkv=qkv,
            o_proj=quantized.direct(attn.o_proj),
            act=act,
            down=quantized.direct(mlp.down_proj),
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
            h, pending = _native_block(plan, h, pending, layer_caches, offsets)
    return h if pending is None else h + pending


def _native_block(
    plan: DecodePlan, h: mx.array, pending: mx.array | None, caches: list[Any], offsets: mx.array
) -> tuple[mx.array, mx.array]:
    """(h, the MLP's output not yet added to it) after one block, h + pending coming in."""
    ops = plan.ops
    rows = h.shape[0]
    in_w, in_eps, post_w, post_eps = plan.norms
    if pending is None:
        x = ops.rms_norm(h, in_w, in_eps)
    else:
        h, x = ops.add_rms_norm(h, pending, in_w, in_eps)
    q, k, v = plan.qkv(x)
    head_dim = q.shape[-1] // plan.heads
    if plan.qk_norms is not None:  # qwen3 normalises queries and keys per head
        qw, q_eps, kw, k_eps = plan.qk_norms
        q = ops.rms_norm(q.reshape(rows, 1, plan.heads, head_dim), qw, q_eps)
        k = ops.rms_norm(k.reshape(rows, 1, plan.kv_heads, head_dim), kw, k_eps)
    q = ops.rope_bthd(q, offsets, *plan.rope, head_dim)
    k = ops.rope_bthd(k, offsets, *plan.rope, head_dim)
    # One position per row: (rows, 1, heads * dim) is already (rows, heads, 1, dim), the cache's layout.
    k = k.reshape(rows, plan.kv_heads, 1, head_dim)
    v = v.reshape(rows, plan.kv_heads, 1, head_dim)
    qs, ks, vs = (mx.split(t, rows, axis=0) if rows > 1 else [t] for t in (q, k, v))
    outs = []
    for i, cache in enumerate(caches):
        if isinstance(cache, PagedKV):  # the op reads the blocks where they lie: no join, no copy
            cache.append(ks[i], vs[i])
            keys, values = cache.segments()
        else:  # a contiguous cache (mlx-lm's): one segment
            keys, values = ([a] for a in cache.update_and_fetch(ks[i], vs[i]))
        outs.append(ops.decode_attention(qs[i], keys, values, plan.scale))  # (1, 1, heads * dim)
    o = mx.concatenate(outs, axis=0) if rows > 1 else outs[0]
    h, x = ops.add_rms_norm(h, plan.o_proj(o), post_w, post_eps)
    return h, plan.down(plan.act(x))
