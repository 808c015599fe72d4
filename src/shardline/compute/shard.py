"""A pipeline stage's slice of a model: a contiguous layer range, plus embedding (first) and head (last)."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as kv_cache
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import load_config

from shardline.compute import attention, expert_parallel, gguf_linear, quantized, tensor_parallel, tied_head
from shardline.compute.batched import DecodePlan, decode_stack
from shardline.compute.generic import GenericShard, ZeroEmbedding
from shardline.compute.layer_range import LayerRange, split_layers
from shardline.compute.linear import InputMajorLinear, make_input_major
from shardline.compute.paged_kv import PagedKV
from shardline.compute.path_check import bounded_attention, fast_check, fast_structure
from shardline.compute.quantized import cpu_quantized, make_cpu_quantized
from shardline.models.errors import CorruptModelError
from shardline.models.footprint import NO_EXPERT_GROUPS, TENSOR_PARALLEL_ARCHITECTURES
from shardline.models.store.files import SHARD_MANIFEST
from shardline.models.store.verify import missing_tensors
from shardline.models.validate import mlx_lm_architecture

__all__ = ["FastShard", "GenericShard", "LayerRange", "Shard", "load_shard", "split_layers"]


class UnsupportedArchitectureError(ValueError):
    pass


class Shard(Protocol):
    """A stage's slice of a model, as runner/stage.py drives it: `FastShard` (llama-shaped blocks in
    native ops over paged KV) or `GenericShard` (any mlx-lm architecture through its own forward)."""

    path: str  # "fast" or "generic"
    prefix_reason: str  # why the prefix cache cannot share its blocks ("" when it can)
    range: LayerRange
    config: dict
    member: int
    face: bool
    emits: bool
    head_split: int
    hidden_size: int
    layers: list[Any]

    def make_cache(self, block: int, shared: list[list[tuple[mx.array, mx.array]]] | None = None) -> Any: ...
    def forward(self, x: mx.array, cache: Any) -> mx.array: ...
    def forward_rows(self, x: mx.array, caches: list[Any]) -> mx.array: ...
    def finish_head(self, packed: mx.array) -> mx.array: ...
    def join_group(self, reduce: Any, gather: Any = None) -> None: ...
    def weight_bytes(self) -> int: ...


class PagedCaches(list):
    """A request's paged caches on a fast stage, one per layer, with what a stage asks of any request's
    caches (its position, a block's arrays, the arrays it holds)."""

    @property
    def offset(self) -> int:
        return self[0].offset

    def seal(self, index: int, block: int) -> list[tuple[mx.array, mx.array]]:
        return [c.block_pair(index) for c in self]

    def arrays(self) -> Iterator[mx.array]:
        for c in self:
            yield from c.blocks_held()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)

    def bytes_per_token(self) -> int:
        return self.nbytes // self[0].block if self else 0


def check_architecture(config: dict) -> None:
    """Refuse a model_type the installed mlx-lm has no architecture for, in one line."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or mlx_lm_architecture(model_type) is None:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not an architecture of mlx-lm")


class FastShard:
    """Llama-shaped blocks (compute/batched.py) over paged KV: runs chunks of one request through this
    stage's layers with that request's KV cache, and decode rows of several requests at once."""

    path = "fast"
    prefix_reason = ""
    why_generic = ""

    def __init__(
        self,
        model: nn.Module,
        layers: LayerRange,
        config: dict,
        member: int,
        blocks: list[Any],
        tied: bool,
    ) -> None:
        self.model = model
        # The head is the embedding: read off the modules (generic.tied) before load drops any of them.
        self.tied = tied
        self.range = layers
        self.config = config
        # A tensor-parallel group's member (compute/tensor_parallel.py); member 0, the face, alone embeds
        # for the ring and computes the head: the others return the hidden states, which every member holds.
        self.member = member
        self.face = member == 0
        inner = model.model
        keep_embed = layers.is_first or (layers.is_last and self.tied and self.face)
        self.embed = getattr(inner, "embed_tokens", None) if keep_embed else None
        self.layers = blocks
        # An untied head splits by vocabulary rows across a last stage's group (split_head at load): each
        # member computes its rows' logits, and the face gathers them (join_group's `gather`).
        self.vocab_split = layers.is_last and "lm_head" in model and getattr(model, "vocab_split", False)
        self.norm = inner.norm if layers.is_last and (self.face or self.vocab_split) else None
        self.gather: tensor_parallel.Reduce | None = None
        self.hidden_size = int(config["hidden_size"])
        self.head_split = self._head_split()
        # Looked up once: finish_head runs on every sampled step of the first stage.
        self.head_dtype = tied_head.input_dtype(self.embed, self.layers[0]) if self.head_split else None
        # On CPU with the native module: each block's native ops for decode positions (batched.DecodePlan).
        self.plans = [DecodePlan.of(block) for block in self.layers]
        self.fast_decode = any(p is not None for p in self.plans)

    @property
    def emits(self) -> bool:
        """Whether this shard's output leaves the stage: the head's logits, or hidden states for the next."""
        return self.face

    def join_group(
        self, reduce: tensor_parallel.Reduce, gather: tensor_parallel.Reduce | None = None
    ) -> None:
        """Each block's row-parallel products end in the group's sum (`reduce`), in both forward paths; a
        split head's logits are joined by `gather` (members' rows after the face's, in member order)."""
        self.gather = gather
        for block in self.layers:
            block.self_attn.o_proj = tensor_parallel.GroupSum(block.self_attn.o_proj, reduce)
            block.mlp.down_proj = tensor_parallel.GroupSum(block.mlp.down_proj, reduce)
        summed = tensor_parallel.reduced
        self.plans = [
            p and dataclasses.replace(p, o_proj=summed(p.o_proj, reduce), down=summed(p.down, reduce))
            for p in self.plans
        ]

    def _head_split(self) -> int:
        """Where a tied output head splits between the first and the last stage (0: it does not).

        The head is the largest single matmul of a small model's decode step, and with tied embeddings the
        first stage holds its weights already. Sharing it keeps the last stage from being the slowest one,
        which is what paces interleaved micro-batches, while the layers stay evenly split, which is what
        prefill wants (its head is one row): the last stage computes the upper half of the logits and the
        first stage (the leader) the lower half, then samples (`finish_head`). Float and affine-quantized
        embeddings split; each logit is computed as the whole head computes it (`_head_rows`)."""
        if self.range.is_first == self.range.is_last or not self.tied or not self.face:
            return 0
        return tied_head.split_point(self.embed)

    def _head_rows(self, h: mx.array, start: int, end: int) -> mx.array:
        return tied_head.rows(self.embed, h, start, end)

    def make_cache(
        self, block: int, shared: list[list[tuple[mx.array, mx.array]]] | None = None
    ) -> PagedCaches:
        """A request's caches, one per layer, in blocks of `block` positions; shared[j]: the full blocks
        layer j starts from (held by others too, never written)."""
        if shared is None:
            return PagedCaches(PagedKV(block) for _ in self.layers)
        if len(shared) != len(self.layers):
            raise ValueError(f"shared blocks for {len(shared)} layers, this stage has {len(self.layers)}")
        return PagedCaches(PagedKV(block, blocks) for blocks in shared)

    def forward(self, x: mx.array, cache: list[PagedKV] | list[kv_cache.KVCache]) -> mx.array:
        """x: token ids (1, n) on the first stage, hidden states (1, n, D) elsewhere.

        Returns hidden states (1, n, D), or on the last stage the logits of the final position (vocab,).
        """
        h = self.embed(x) if self.range.is_first else x
        if h.shape[1] == 1 and self.fast_decode:  # one decode position: the batched blocks, one row
            h = decode_stack(self.layers, self.plans, h, [[c] for c in cache])
        else:
            mask = create_attention_mask(h, cache[0])
            for layer, c in zip(self.layers, cache, strict=True):
                h = layer(h, mask, cache=c)
        if not self.range.is_last or not (self.face or self.vocab_split):
            return h
        return self.head(self.final_norm(h[:, -1, :]))[0]

    def forward_rows(
        self, x: mx.array, caches: list[list[PagedKV]] | list[list[kv_cache.KVCache]]
    ) -> mx.array:
        """One decode position for each of several requests: x is (rows, 1) token ids on the first stage,
        (rows, 1, D) hidden states elsewhere; row i continues caches[i]. Returns (rows, 1, D), or on the last
        stage each row's logits (rows, vocab)."""
        h = self.embed(x) if self.range.is_first else x
        by_layer = [[c[j] for c in caches] for j in range(len(self.layers))]
        h = decode_stack(self.layers, self.plans, h, by_layer)
        if not self.range.is_last or not (self.face or self.vocab_split):
            return h
        return self.head(self.final_norm(h[:, -1, :]))

    def final_norm(self, h: mx.array) -> mx.array:
        """The last stage's norm before the head, as one native op where the decode plans run."""
        ops = quantized.native() if self.fast_decode else None
        weight = self.norm.get("weight")
        if ops is not None and type(self.norm) is nn.RMSNorm and h.dtype == weight.dtype == mx.float32:
            return ops.rms_norm(h, weight, self.norm.eps)
        return self.norm(h)

    def head(self, h: mx.array) -> mx.array:
        """Normalised hidden states (rows, D) -> logits (rows, vocab); with a split head, the hidden states
        and the upper part of the logits side by side (rows, D + vocab - split), for `finish_head`."""
        if not self.head_split:
            logits = self.embed.as_linear(h) if self.tied else self.model.lm_head(h)
            logits = logits.astype(mx.float32)
            if self.vocab_split and self.gather is not None:  # this member's rows; the face gets them all
                logits = self.gather(logits)
            return logits
        upper = self._head_rows(h, self.head_split, int(self.embed.weight.shape[0]))
        return mx.concatenate([h.astype(mx.float32), upper.astype(mx.float32)], axis=-1)

    def finish_head(self, packed: mx.array) -> mx.array:
        """On the first stage: the last stage's `head` output -> full logits (..., vocab)."""
        return tied_head.finish(self.embed, self.head_dtype, self.hidden_size, packed)

    def weight_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def _check_partial(model: nn.Module, model_dir: Path, layers: LayerRange) -> None:
    """Lenient loading leaves a tensor absent from the files randomly initialised: refuse that instead.
    Run on the stage's model as rewritten (generic.StageLayer): held layer i's tensors are
    `...layers.i.layer.*`; before the last stage, nothing outside the layers but the embedding is read."""
    wanted = {}
    for name, value in tree_flatten(model.parameters()):
        held = re.sub(r"\.layers\.(\d+)\.layer\.", r".layers.\1.", name)
        inside = held != name
        if inside or layers.is_last or (layers.is_first and "embed" in name):
            wanted[held] = tuple(value.shape)
    if missing := missing_tensors(model_dir, wanted):
        raise CorruptModelError(
            f"{model_dir} holds a partial model without {len(missing)} tensor(s) that layers "
            f"[{layers.start}, {layers.end}) need, e.g. {missing[0]}: fetch this stage's range instead"
        )


def load_shard(
    model_dir: Path,
    layers: LayerRange | None = None,
    score_budget: int | None = None,
    member: int = 0,
    group: int = 1,
    expert_owners: list[list[int]] | None = None,
    expert_heads: bool = False,
) -> Shard:
    """Materialise only this stage's weights (member `member`'s share of them, in a tensor-parallel group of
    `group`, or an expert-parallel one where `expert_owners` maps each held layer's experts to members:
    compute/expert_parallel.py; its attention split by heads too where `expert_heads`): everything else
    stays a lazy, never-read array. The stage takes the fast path where its blocks are llama-shaped and
    compute what the model's own forward computes (`fast_check`), else the generic one;
    `shard.why_generic` says why. `SHARDLINE_FAST=0` keeps every stage generic."""
    config = load_config(Path(model_dir))
    check_architecture(config)
    # A stage directory fetched from a peer (cluster/weights/) holds only its own tensors, which strict
    # loading refuses; load it leniently, then require every tensor this stage keeps (_check_partial).
    partial = (Path(model_dir) / SHARD_MANIFEST).is_file()
    model, config = gguf_linear.load_model(Path(model_dir), lazy=True, strict=not partial)
    listed = list(model.layers)  # GenericShard finds the list the forward iterates, where it must
    total = len(listed)
    layers = layers or LayerRange(0, total, total)
    if layers.total != total:
        raise ValueError(f"layer range for {layers.total} layers, model has {total}")
    blocks = listed[layers.start : layers.end]
    # A vision-language wrapper's text model (mistral3's language_model) takes the fast path as itself.
    text, text_config = _text_model(model, config)
    why = "SHARDLINE_FAST=0" if os.environ.get("SHARDLINE_FAST") == "0" else fast_structure(text, blocks)
    owners = expert_owners if expert_owners and group > 1 else None
    experts = owners is not None
    if owners is not None and len(owners) != len(blocks):
        raise ValueError(f"an expert map for {len(owners)} layers, the stage holds {len(blocks)}")
    if group > 1:
        arch = mlx_lm_architecture(str(config.get("model_type")))
        reason = NO_EXPERT_GROUPS.get(arch, "") if experts else ""
        if reason := reason or expert_parallel.group_split_reason(blocks, experts):
            kind = "expert" if experts else "tensor"
            raise UnsupportedArchitectureError(f"{kind}-parallel groups cannot split its blocks: {reason}")
        if not experts:
            tensor_parallel.check_split(text_config, group)
        # The fast blocks' sums are checked exact in groups for these; any other group runs generic.
        if experts:
            why = why or "expert-parallel groups run the model's own forward"
        elif not why and arch not in TENSOR_PARALLEL_ARCHITECTURES:
            why = f"tensor-parallel groups of {arch} blocks run the model's own forward"
    on_cpu = mx.default_device() == mx.cpu
    blocks_as_stored = gguf_linear.kernel_runs_here()
    budget = score_budget or attention.DEFAULT_SCORE_BUDGET
    generic = GenericShard(model, config, layers, member)
    if partial:
        _check_partial(model, Path(model_dir), layers)
    generic.experts_split = experts
    generic.heads_split = []
    for i, layer in enumerate(blocks):  # one layer at a time: only this member's slice is ever read in full
        held = owners[i] if owners is not None else None
        generic.heads_split.append(expert_parallel.split_member(layer, member, group, held, expert_heads))
        if not blocks_as_stored:  # GGUF blocks as MLX affine, once, where the CPU kernel does not run them
            gguf_linear.to_affine_layers(layer)
        if on_cpu:
            if not why:  # llama-shaped blocks call their projections and nothing else reads them
                make_input_major(layer)
            make_cpu_quantized(layer)
        mx.eval(layer.parameters())
    if why:
        if not generic.heads_out:
            generic.drop_head()
        if on_cpu:  # the embedding and an untied head too, where quantized
            make_cpu_quantized(model)
        mx.eval(model.parameters())
        gc.collect()
        return _generic(generic, why, blocks[0], budget)
    module = sys.modules[type(blocks[0]).__module__]
    stock = module.scaled_dot_product_attention
    fast = _fast(text, text_config, layers, member, group, blocks, budget, generic.tied)
    if group == 1 and (why := fast_check(fast, generic, 4)):
        module.scaled_dot_product_attention = stock  # the fast path's attention, checked again below
        return _generic(generic, why, blocks[0], budget)
    gc.collect()
    return fast


def _generic(generic: GenericShard, why: str, block: nn.Module, budget: int) -> GenericShard:
    """The generic path, saying why the fast one does not run it; the bounded prefill attention on CPU
    where it agrees with the model's own (compute/path_check.py)."""
    generic.why_generic = why
    if mx.default_device() == mx.cpu:
        generic.bounded_attention = bounded_attention(block, generic, budget)
    return generic


def _text_model(model: nn.Module, config: dict) -> tuple[nn.Module, dict]:
    """The model whose `model` holds the layers, and its config: the model itself, or a wrapper's
    language model (with the wrapper's text_config over its own keys)."""
    inner = getattr(model, "language_model", None)
    if getattr(model, "model", None) is None and inner is not None and hasattr(inner, "model"):
        return inner, {**config, **(config.get("text_config") or {})}
    return model, config


def _fast(
    model: nn.Module,
    config: dict,
    layers: LayerRange,
    member: int,
    group: int,
    blocks: list[Any],
    score_budget: int,
    tied: bool,
) -> FastShard:
    inner = model.model
    face = member == 0
    vocab = int(config.get("vocab_size") or 0)
    vocab_split = group > 1 and layers.is_last and "lm_head" in model and vocab % group == 0
    if vocab_split:  # each member reads and computes its rows of the head (tensor_parallel.split_head)
        tensor_parallel.split_head(model.lm_head, member, group)
        model.vocab_split = True
    attention.install(sys.modules[type(blocks[0]).__module__], score_budget)
    keep_embed = layers.is_first or (layers.is_last and tied and face)
    if mx.default_device() == mx.cpu:
        if layers.is_last and "lm_head" in model and type(model.lm_head) is nn.Linear:  # an untied head
            model.lm_head = InputMajorLinear.of(model.lm_head)
        elif layers.is_last and "lm_head" in model:
            model.lm_head = cpu_quantized(model.lm_head)
        if keep_embed:  # a tied quantized head runs as the embedding's as_linear
            inner.embed_tokens = cpu_quantized(inner.embed_tokens)
    if not keep_embed and not isinstance(inner.embed_tokens, ZeroEmbedding):  # a group member's
        inner.embed_tokens = ZeroEmbedding(int(config["hidden_size"]), mx.float32)
    if not layers.is_last or not (face or vocab_split):
        del inner.norm
        if "lm_head" in model:
            del model.lm_head
    mx.eval(model.parameters())
    return FastShard(model, layers, config, member, blocks, tied)
