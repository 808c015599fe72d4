"""Which path a stage takes, decided by checks, not by a list of names.

The fast path (compute/shard.py FastShard) computes llama-shaped blocks in native ops over paged KV; the
generic path (compute/generic.py) runs the model's own forward. A stage takes the fast path where its blocks
are llama-shaped (`fast_structure`) and a few positions through both agree (`fast_check`). The bounded,
tiled prefill attention (compute/attention.py) replaces the model's own where the same kind of check agrees
(`bounded_attention`): it bounds a long prompt's score memory and runs faster on CPU.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shardline.compute import attention
from shardline.compute.gguf_linear import is_gguf

FAST_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "rope", "q_norm", "k_norm"}


def fast_structure(model: nn.Module, blocks: list[Any]) -> str:
    """Why this model's blocks cannot take the fast path, from their structure ("" when they might: the
    numeric check against the generic path, `fast_check`, decides)."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "layers")):
        return "its model is not laid out as model.{embed_tokens, layers, norm}"
    if hasattr(model, "make_cache"):
        kinds = {type(c).__name__ for c in model.make_cache()}
        if kinds != {"KVCache"}:
            return f"its layers keep {', '.join(sorted(kinds))}, not one full-attention KV cache each"
    for block in blocks:
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if isinstance(attn, nn.Module) and isinstance(mlp, nn.Module):
            # Modules the fast block would skip (hunyuan's query_layernorm after rope, a gate's bias...).
            extra = set(attn.children()) - FAST_ATTENTION
            extra |= set(mlp.children()) - {"gate_proj", "up_proj", "down_proj"}
            if extra:
                return f"its blocks hold {', '.join(sorted(extra))}, which the fast block does not compute"
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            return "its blocks are not self_attn (q/k/v/o projections, rope) + mlp"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP is not gate/up/down"
        if not all(hasattr(block, n) for n in ("input_layernorm", "post_attention_layernorm")):
            return "its blocks do not normalise as input/post-attention norms"
        extra = set(block.children()) - {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        if extra:
            return f"its blocks hold {', '.join(sorted(extra))} besides attention and MLP"
    return ""


# Of the largest output, by the activations' dtype: the same functions in another order of ops (llama at
# 4 bits measured 1.1e-4 in float32, qwen3 in bfloat16 2.0e-2, a few units in the last place of 8 bits);
# a skipped scale or multiplier (gemma, granite) is off by O(1).
TOLERANCE = {mx.float32: 2e-3, mx.float16: 1e-2, mx.bfloat16: 6e-2}
# GGUF block products round x to int8 per block of 32 (compute/gguf_linear.py, as llama.cpp does): two
# orders of the same float ops can round an element of x one step apart, and the difference is the
# rounding's (the default model measured 2.1e-2 between the paths, bfloat16's order of magnitude).
ROUNDED_X_TOLERANCE = 6e-2


def _probe(shard: Any, block: int, prompt: int) -> list[mx.array]:
    """A stage's outputs for a prompt chunk of `prompt` positions, then two decode positions, from fresh
    caches: token ids on the first stage, fixed random hidden states elsewhere."""
    vocab = int(shard.config.get("vocab_size") or 2)
    keys = mx.random.split(mx.random.key(7), 3)
    cache = shard.make_cache(block)
    outs = []
    for salt, n in enumerate((prompt, 1, 1)):
        if shard.range.is_first:
            x = mx.array([[(31 * i + 7 * salt + 3) % vocab for i in range(n)]], dtype=mx.int32)
        else:
            dtype = getattr(shard, "activation_dtype", mx.float32)
            x = mx.random.normal((1, n, shard.hidden_size), key=keys[salt]).astype(dtype)
        y = shard.forward(x, cache)
        mx.eval(y)
        outs.append(y.astype(mx.float32))
    return outs


def _tolerance(generic: Any) -> float:
    dtype = TOLERANCE.get(generic.activation_dtype, TOLERANCE[mx.float32])
    if any(is_gguf(m) for m in generic.model.modules()):
        return max(dtype, ROUNDED_X_TOLERANCE)
    return dtype


def _gap(a: list[mx.array], b: list[mx.array]) -> float:
    """The largest difference between two probes' outputs, relative to b's largest output."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = max(float(mx.max(mx.abs(y)).item()), 1e-6)
        worst = max(worst, float(mx.max(mx.abs(x - y)).item()) / scale)
    return worst


def fast_check(fast: Any, generic: Any, block: int) -> str:
    """ "" when the fast path computes what the model's own forward computes on this stage (a prefill of a
    few positions, then two decode positions, from the same inputs), else how far apart they are."""
    split, fast.head_split = fast.head_split, 0  # compare whole logits
    try:
        worst = _gap(_probe(fast, block, 5), _probe(generic, block, 5))
    except Exception as e:  # a block that looks llama-shaped and takes other arguments (ministral3)
        return f"the fast path fails on its blocks ({type(e).__name__}: {e})"
    finally:
        fast.head_split = split
    if not worst <= _tolerance(generic):  # NaN included
        return f"the fast path differs from the model's own forward by {worst:.1e} of its largest output"
    return ""


def bounded_attention(block: nn.Module, generic: Any, score_budget: int) -> bool:
    """Route the attention of the module that defines the model's blocks through the bounded version where
    the generic stage computes the same with it (a prompt chunk crossing a tile, then decode positions);
    else leave the model's own."""
    module = sys.modules[type(block).__module__]
    if not callable(getattr(module, "scaled_dot_product_attention", None)):
        return False  # the model calls MLX's attention directly
    stock = module.scaled_dot_product_attention
    try:
        before = _probe(generic, 64, 70)
        attention.install(module, 64 * 8)  # tiles of 64 keys: the chunk of 70 crosses one
        after = _probe(generic, 64, 70)
        agrees = _gap(after, before) <= _tolerance(generic)
    except Exception:
        agrees = False
    if agrees:
        attention.install(module, score_budget)
    else:
        module.scaled_dot_product_attention = stock
    return agrees
