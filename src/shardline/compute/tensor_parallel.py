"""Tensor parallelism inside a stage: member r of a group of k holds 1/k of each layer.

As in Megatron: every member holds heads [r*H/k, (r+1)*H/k) of attention (KV heads too, so each member's KV
cache holds only its heads) and columns [r*I/k, (r+1)*I/k) of the MLP's intermediate size. q/k/v and
gate/up are split by output rows (column-parallel), the attention output and the MLP's down projection by
input columns (row-parallel): each member's product is a partial sum of the full one, and the group adds
the partials (`GroupSum`) twice a layer. Norms and rope run whole on every member. A bias of a row-parallel
product is added once, by member 0.

Slicing happens on mlx-lm's modules as loaded (float or affine-quantized), before any CPU layout change,
so each member materialises only its own slice of every weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from shardline.compute.gguf_linear import block_shape
from shardline.models.gguf_quant import largest_block

Reduce = Callable[[mx.array], mx.array]


class GroupSumError(ValueError):
    """A model that cannot be split this many ways (heads or columns that do not divide)."""


def _quantized(linear: Any) -> bool:
    return "scales" in linear


def _own(a: mx.array) -> mx.array:
    """A slice as an array of its own: a strided view would keep the whole tensor alive (twice the memory)
    and cost a copy at every product that needs it contiguous."""
    return mx.contiguous(a)


def rows(linear: Any, start: int, stop: int, axis: int = 0) -> None:
    """Keep output rows [start, stop) of a linear layer (float or affine-quantized); axis 1 for a switch
    layer's stacked experts (experts, out, in)."""
    cut = (slice(None),) * axis + (slice(start, stop),)
    for name in ("weight", "scales", "biases", "bias"):
        if name in linear:
            linear[name] = _own(linear[name][cut])


def columns(linear: Any, start: int, stop: int, keep_bias: bool) -> None:
    """Keep input columns [start, stop) of a linear layer (or of every stacked expert of a switch layer);
    its bias only where keep_bias (added once)."""
    if hasattr(linear, "qtype"):  # GGUF blocks (compute/gguf_linear.py): whole blocks of each row
        elements, size = block_shape(linear.qtype)
        if start % elements or stop % elements:
            raise GroupSumError(f"columns [{start}, {stop}) split GGUF blocks of {elements}")
        linear["weight"] = _own(linear["weight"][..., start // elements * size : stop // elements * size])
        linear.input_dims = stop - start
    elif _quantized(linear):
        per_word = 32 // linear.bits
        gs = linear.group_size
        if start % gs or stop % gs or start % per_word:
            raise GroupSumError(f"columns [{start}, {stop}) split quantization groups of {gs}")
        linear["weight"] = _own(linear["weight"][..., start // per_word : stop // per_word])
        linear["scales"] = _own(linear["scales"][..., start // gs : stop // gs])
        if "biases" in linear:
            linear["biases"] = _own(linear["biases"][..., start // gs : stop // gs])
    else:
        linear["weight"] = _own(linear["weight"][..., start:stop])
    if "bias" in linear and not keep_bias:
        linear.pop("bias")


def check_split(config: dict, size: int) -> None:
    """Raise GroupSumError unless a model of this config splits `size` ways."""
    if size == 1:
        return
    heads = int(config.get("num_attention_heads") or 0)  # split_block checks the modules' own figures
    kv_heads = int(config.get("num_key_value_heads") or heads)
    inter = int(config.get("intermediate_size") or 0)
    if not heads or not inter:
        return
    for what, n in (("attention heads", heads), ("KV heads", kv_heads), ("MLP columns", inter)):
        if n % size:
            raise GroupSumError(f"{n} {what} do not split into {size} equal parts")
    group = largest_block(config)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    for what, n in (("attention output", heads // size * head_dim), ("MLP", inter // size)):
        if group and n % group:
            raise GroupSumError(f"a member's {n} {what} inputs split quantization groups of {group}")


HEADS = ("n_heads", "num_heads", "num_attention_heads")  # what attention modules call their head counts
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


def _count(attn: Any, names: tuple[str, ...]) -> int | None:
    return next((int(getattr(attn, n)) for n in names if isinstance(getattr(attn, n, None), int)), None)


def split_reason(blocks: list[Any]) -> str:
    """Why `split_block` cannot split these blocks ("" when it can): it slices self_attn's q/k/v/o
    projections by heads (n_heads, n_kv_heads) and mlp's gate/up/down by columns."""
    for block in blocks:
        if why := attention_split_reason(block) or mlp_split_reason(getattr(block, "mlp", None)):
            return why
    return ""


def attention_split_reason(block: Any) -> str:
    attn = getattr(block, "self_attn", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(hasattr(attn, n) for n in names):
        return "its attention is not self_attn with q/k/v/o projections"
    if _count(attn, HEADS) is None or _count(attn, KV_HEADS) is None:
        return "its attention keeps no head counts by a name a group can set"
    head_dim = int(attn.q_proj["weight"].shape[0]) // (_count(attn, HEADS) or 1)
    for norm in ("q_norm", "k_norm"):
        w = getattr(attn, norm, None)
        if isinstance(w, nn.Module) and "weight" in w and w["weight"].shape[-1] != head_dim:
            return f"its {norm} normalises all heads together, not each head"
    return ""


def mlp_split_reason(mlp: Any, what: str = "MLP", gated: bool = True) -> str:
    """Why `split_mlp` cannot split this MLP ("" when it can); `gated`: it must have a gate projection."""
    needs = MLP_PROJECTIONS if gated else MLP_PROJECTIONS[1:]
    if mlp is None or not all(isinstance(getattr(mlp, n, None), nn.Module) for n in needs):
        return f"its {what} is not {'gate/' if gated else ''}up/down projections"
    return ""


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def split_block(block: Any, rank: int, size: int) -> None:
    """Keep member `rank`'s share of a dense transformer block (in place), of a group of `size`."""
    if size == 1:
        return
    split_attention(block.self_attn, rank, size)
    split_mlp(block.mlp, rank, size)


def split_attention(attn: Any, rank: int, size: int) -> None:
    """Keep member `rank`'s heads of an attention module (q/k/v by output rows, o by input columns)."""
    heads, kv_heads = _count(attn, HEADS) or 0, _count(attn, KV_HEADS) or 0
    if heads % size or kv_heads % size:
        raise GroupSumError(f"{heads} heads and {kv_heads} KV heads do not split into {size}")
    dim = int(attn.q_proj["weight"].shape[0]) // heads
    hq, hkv = heads // size, kv_heads // size
    rows(attn.q_proj, rank * hq * dim, (rank + 1) * hq * dim)
    rows(attn.k_proj, rank * hkv * dim, (rank + 1) * hkv * dim)
    rows(attn.v_proj, rank * hkv * dim, (rank + 1) * hkv * dim)
    columns(attn.o_proj, rank * hq * dim, (rank + 1) * hq * dim, keep_bias=rank == 0)
    if "sinks" in attn:  # one learned sink logit per query head (gpt-oss)
        attn["sinks"] = _own(attn["sinks"][rank * hq : (rank + 1) * hq])
    for names, n in ((HEADS, hq), (KV_HEADS, hkv)):  # every name the module may read
        for name in names:
            if isinstance(getattr(attn, name, None), int):
                setattr(attn, name, n)


def split_mlp(mlp: Any, rank: int, size: int) -> None:
    """Keep member `rank`'s columns of a gate/up/down MLP."""
    inter = int(mlp.up_proj["weight"].shape[0])
    if inter % size:
        raise GroupSumError(f"{inter} MLP columns do not split into {size}")
    part = inter // size
    if isinstance(getattr(mlp, "gate_proj", None), nn.Module):  # an ungated MLP (relu2) has none
        rows(mlp.gate_proj, rank * part, (rank + 1) * part)
    rows(mlp.up_proj, rank * part, (rank + 1) * part)
    columns(mlp.down_proj, rank * part, (rank + 1) * part, keep_bias=rank == 0)


def split_head(head: Any, rank: int, size: int) -> None:
    """Keep member `rank`'s rows of an untied output head (vocabulary-parallel): its logits are a slice of
    the whole, which the face gathers in member order."""
    part = int(head["weight"].shape[0]) // size
    rows(head, rank * part, (rank + 1) * part)


class GroupSum(nn.Module):
    """A row-parallel product followed by the group's sum: what every member gets is the whole product."""

    def __init__(self, inner: Any, reduce: Reduce) -> None:
        super().__init__()
        self.inner = inner
        self._reduce = reduce

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return self._reduce(self.inner(x, *args, **kwargs))


def reduced(fn: Callable[[mx.array], mx.array], reduce: Reduce) -> Callable[[mx.array], mx.array]:
    """A native plan's row-parallel product followed by the group's sum."""

    def call(x: mx.array) -> mx.array:
        return reduce(fn(x))

    return call
