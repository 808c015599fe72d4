"""Expert parallelism inside a stage: member r of a group holds whole routed experts, not a slice of each.

A mixture-of-experts layer's output is a sum over the experts a token is routed to, each weighted by its
router score, plus any shared experts. So the layer splits by experts: every member runs the router (which
is small and replicated, so every member routes every token the same way), computes the experts it holds
for the tokens routed to them, and leaves zeros where a token went to another member's expert; its shared
experts run split by columns (as tensor parallelism splits an MLP). The MoE module's output on each member
is then a partial sum of the whole, and the group adds the partials (`GroupSum`, in member order, so every
member gets the same bits). Attention, norms and dense layers run whole on every member, each with its own
KV cache: one sum a MoE layer instead of tensor parallelism's two, and a token's expert reads divide between
the members that hold its experts.

The same seam serves tensor-parallel groups of MoE models (`split_experts_by_columns`): every expert split by
columns, as mlx-lm and exo split them, with the same one-sum-per-MoE-module wrapping.

Slicing happens on mlx-lm's modules as loaded, before any CPU layout change (compute/quantized.py swaps the
sliced switch layers for the native gather kernel), so each member materialises only the experts it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from shardline.compute import tensor_parallel as tp
from shardline.compute.tensor_parallel import GroupSum, GroupSumError, Reduce, columns, rows

SWITCHES = (SwitchGLU, SwitchMLP)
# What MoE modules call their shared experts: MLPs with gate/up/down projections, split by columns.
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp", "share_expert")


@dataclass(frozen=True)
class MoeSite:
    """Where a transformer block keeps its mixture of experts: `parent[key]` is the MoE module (router,
    switch of routed experts, shared experts), `moe[switch]` the routed experts."""

    parent: Any
    key: str
    switch: str
    shared: tuple[str, ...]

    @property
    def moe(self) -> Any:
        return self.parent[self.key]

    @property
    def experts(self) -> int:
        return _num_experts(self.moe[self.switch])


def _modules(m: Any) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in m.items() if isinstance(v, nn.Module)]


def moe_site(block: Any) -> MoeSite | None:
    """The block's MoE module, found as the child (or grandchild) that holds an mlx-lm switch of experts;
    None for a dense block."""
    for parent in [block] + [v for _, v in _modules(block)]:
        for key, moe in _modules(parent):
            for name, child in _modules(moe):
                if isinstance(child, (*SWITCHES, HeldExperts)):
                    shared = tuple(n for n in SHARED_NAMES if isinstance(moe.get(n), nn.Module))
                    return MoeSite(parent, key, name, shared)
    return None


_OUTPUT = ("down_proj", "fc2")  # a switch's last product, by input columns in a tensor group


def _switch_linears(switch: Any) -> list[Any]:
    """A switch's stacked-expert products, its last one (down_proj, fc2) last."""
    found = [(k in _OUTPUT, k, v) for k, v in _modules(switch) if "weight" in v]
    return [v for _, _, v in sorted(found, key=lambda t: t[0])]


def _num_experts(switch: Any) -> int:
    return int(_switch_linears(switch)[0]["weight"].shape[0])


def _own(a: mx.array) -> mx.array:
    return mx.contiguous(a)


def _keep_experts(switch: Any, held: list[int]) -> None:
    """Keep only the experts `held` (ascending) of every switch linear, along the expert axis."""
    first, last = held[0], held[-1] + 1
    contiguous = held == list(range(first, last))
    index = mx.array(held)
    for linear in _switch_linears(switch):
        for name in ("weight", "scales", "biases", "bias", "global_scale"):
            if name in linear and linear[name] is not None and linear[name].ndim >= 1:
                a = linear[name]
                linear[name] = _own(a[first:last] if contiguous else mx.take(a, index, axis=0))


def shared_split_reason(site: MoeSite) -> str:
    for name in site.shared:
        if why := tp.mlp_split_reason(site.moe[name], f"shared expert {name}", gated=False):
            return why
    return ""


def _split_shared(site: MoeSite, rank: int, size: int) -> None:
    if why := shared_split_reason(site):
        raise GroupSumError(why)
    for name in site.shared:
        tp.split_mlp(site.moe[name], rank, size)


def group_split_reason(blocks: list[Any], experts: bool) -> str:
    """Why a group cannot split these blocks ("" when it can). An expert group keeps attention and dense
    layers whole and splits MoE layers by experts; a tensor group splits attention by heads, MLPs by
    columns, and a MoE layer's every expert by columns."""
    for block in blocks:
        site = moe_site(block)
        if experts:
            why = shared_split_reason(site) if site is not None else ""
        else:
            why = tp.attention_split_reason(block) or (
                tp.mlp_split_reason(getattr(block, "mlp", None))
                if site is None
                else shared_split_reason(site)
            )
        if why:
            return why
    return ""


def split_member(block: Any, rank: int, size: int, owners: list[int] | None, heads: bool = False) -> bool:
    """Member `rank`'s share of a block, in a group of `size`: by experts where `owners` is given (an expert
    group: [] for a dense layer, kept whole; its attention by heads too where `heads` and it splits), else
    by heads and columns (a tensor group). Returns whether its attention was split by heads."""
    if size == 1:
        return False
    if owners is not None:
        split_by_experts(block, rank, size, owners)
        if heads and not tp.attention_split_reason(block):
            tp.split_attention(block.self_attn, rank, size)
            return True
        return False
    site = moe_site(block)
    if site is None:
        tp.split_block(block, rank, size)
        return True
    tp.split_attention(block.self_attn, rank, size)
    split_experts_by_columns(site, rank, size)
    return True


class HeldExperts(nn.Module):
    """A switch of routed experts that holds some of them: a token's slots routed to another member's
    experts come out zero, so the MoE module's weighted sum over slots is this member's partial sum.

    The routing (a few integers a token) is read on the host to pick the rows to compute: a decode step
    runs only the experts this member holds, and a prompt chunk only its rows for them."""

    def __init__(self, switch: Any, held: list[int], total: int) -> None:
        super().__init__()
        self.inner = switch
        self.total = total
        lut = np.full(total, -1, dtype=np.int64)
        lut[np.asarray(held, dtype=np.int64)] = np.arange(len(held))
        self._lut = lut
        # Tokens routed to each expert since load (all experts, on every member): the routing figures that
        # placement spreads hot experts by.
        self.routed = np.zeros(total, dtype=np.int64)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        idx = np.asarray(indices).astype(np.int64)
        self.routed += np.bincount(idx.reshape(-1), minlength=self.total)
        dim = int(x.shape[-1])
        k = int(idx.shape[-1])
        flat = idx.reshape(-1, k)
        local = self._lut[flat]
        tokens, slots = np.nonzero(local >= 0)
        out_dim = _output_dims(self.inner)
        if len(tokens) == 0:
            return mx.zeros((*idx.shape, out_dim), dtype=x.dtype)
        xs = x.reshape(-1, dim)[mx.array(tokens)]
        ys = self.inner(xs, mx.array(local[tokens, slots])[:, None])[:, 0]
        if len(tokens) == flat.size:  # every slot is held here (a group of one, or a lucky token)
            return ys.reshape(*idx.shape, out_dim)
        out = mx.zeros((flat.size, out_dim), dtype=ys.dtype)
        out[mx.array(tokens * k + slots)] = ys
        return out.reshape(*idx.shape, out_dim)


def _output_dims(switch: Any) -> int:
    last = _switch_linears(switch)[-1]
    return int(last["weight"].shape[1])


def split_by_experts(block: Any, rank: int, size: int, owners: list[int]) -> None:
    """Keep member `rank`'s experts of a MoE block (in place): those `owners` gives it, whole; its shared
    experts split by columns. Attention and everything else stays whole."""
    site = moe_site(block)
    if site is None:
        if owners:
            raise GroupSumError("a layer given experts to hold has no mixture of experts")
        return
    total = site.experts
    if len(owners) != total:
        raise GroupSumError(f"an expert map of {len(owners)} experts for a layer of {total}")
    held = [e for e, o in enumerate(owners) if o == rank]
    if not held:
        raise GroupSumError(f"member {rank} holds none of the layer's {total} experts")
    if any(not 0 <= o < size for o in owners):
        raise GroupSumError(f"an expert map names members outside a group of {size}")
    switch = site.moe[site.switch]
    _keep_experts(switch, held)
    _split_shared(site, rank, size)
    site.moe[site.switch] = HeldExperts(switch, held, total)


def split_experts_by_columns(site: MoeSite, rank: int, size: int) -> None:
    """Tensor parallelism of a MoE module: every routed expert (and shared expert) split by columns."""
    switch = site.moe[site.switch]
    linears = _switch_linears(switch)
    first, last = linears[:-1], linears[-1]  # gate/up (or fc1), then down (or fc2)
    inter = int(first[0]["weight"].shape[1])
    if inter % size:
        raise GroupSumError(f"{inter} expert columns do not split into {size}")
    part = inter // size
    for linear in first:
        rows(linear, rank * part, (rank + 1) * part, axis=1)
    columns(last, rank * part, (rank + 1) * part, keep_bias=rank == 0)
    _split_shared(site, rank, size)


def join_block(block: Any, reduce: Reduce, experts: bool, heads: bool) -> None:
    """A member's block ends its partial sums in the group's sum: the MoE module's output (both kinds of
    group), the attention output where `split_member` split it by heads, and in a tensor group a dense
    MLP's down projection."""
    site = moe_site(block)
    if site is not None:
        site.parent[site.key] = GroupSum(site.moe, reduce)
    if heads:
        block.self_attn.o_proj = GroupSum(block.self_attn.o_proj, reduce)
    if not experts and site is None:
        block.mlp.down_proj = GroupSum(block.mlp.down_proj, reduce)


def routed_counts(blocks: list[Any]) -> list[list[int]]:
    """Tokens routed to each expert of each held block since load ([] for a dense block)."""
    found = []
    for block in blocks:
        site = moe_site(block)
        switch = site.moe[site.switch] if site is not None else None
        found.append(switch.routed.tolist() if isinstance(switch, HeldExperts) else [])
    return found


def expert_bytes(blocks: list[Any]) -> int:
    """Bytes of the routed experts these blocks hold."""
    total = 0
    for block in blocks:
        site = moe_site(block)
        if site is not None:
            switch = site.moe[site.switch]
            inner = switch.inner if isinstance(switch, HeldExperts) else switch
            total += sum(v.nbytes for lin in _switch_linears(inner) for _, v in _arrays(lin))
    return total


def _arrays(m: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return [(k, v) for k, v in tree_flatten(m.parameters()) if isinstance(v, mx.array)]
