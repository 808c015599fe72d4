"""A pipeline stage of any mlx-lm architecture, run through the model's own code for a layer range.

mlx-lm's `Model.__call__` knows each architecture's embedding (and its scaling), its per-layer masks (sliding
windows, recurrent layers' masks), its final norm and head (tied or not, soft-capped or scaled). A stage runs
that very call with its layer list rewritten in place, keeping its length so that every index the model
reads (`cache[self.fa_idx]`, `layer_types[i]`) still means what it means:

- the layers this stage holds run as they are; the first of them (on a later stage) takes the hidden states
  that came over the ring instead of whatever reached it (`inject`);
- the others (`StageLayer`s in skip mode) hand their input on, keep their module's attributes for the model
  to read (`layer.use_sliding`), and hold no weights;
- on a stage before the last, the last held layer stops the call (`StageExit`) with its output.

Each request's caches are the model's own `make_cache()` list, full length: the caches the held layers are
handed fill up; the others are ghosts that only count positions (`_advance`), since the model makes masks
from whichever cache it likes (`cache[0]`, which on a later stage belongs to another machine's layer). A
prefill chunk's logits are the head of its last position alone: the last held layer stops the call, and a
second call with every layer skipped carries that one position through the model's own norm and head
(`_tail`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as kv_cache

from shardline.compute import expert_parallel, tied_head
from shardline.compute.layer_range import LayerRange

_RUN, _SKIP, _EMIT = "run", "skip", "emit"


class StageExit(Exception):
    """The last held layer's output, carried out of the model's call on a stage before the last."""

    def __init__(self, h: mx.array) -> None:
        self.h = h


class StageLayer(nn.Module):
    """One entry of the model's layer list: the layer itself where this stage holds it (a child, so its
    weights count), or only its attributes (a shadow, outside the module tree) where another stage does."""

    def __init__(self, layer: nn.Module, held: bool) -> None:
        super().__init__()
        if held:
            self.layer = layer
        object.__setattr__(self, "_shadow", layer)
        object.__setattr__(self, "_mode", _RUN if held else _SKIP)
        object.__setattr__(self, "_inject", None)
        object.__setattr__(self, "_exit", False)
        object.__setattr__(self, "_seen", None)  # a held layer notes the caches it is handed here

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_shadow"), key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The hidden states come first, by position or as the first keyword (gptj: `inputs=`).
        key = None if args else next(iter(kwargs))
        mode = self._mode
        if mode == _SKIP:
            return args[0] if key is None else kwargs[key]
        if mode == _EMIT:
            return self._inject
        if self._inject is not None:
            if key is None:
                args = (self._inject, *args[1:])
            else:
                kwargs[key] = self._inject
        if self._seen is not None:
            self._seen.update(id(v) for v in (*args, *kwargs.values()) if isinstance(v, kv_cache._BaseCache))
        out = self.layer(*args, **kwargs)
        if self._exit:
            raise StageExit(out)
        return out


class ZeroEmbedding(nn.Module):
    """An embedding this stage does not hold: a later stage's hidden states come over the ring, so what
    the model computes before its first held layer is thrown away; zeros keep it cheap and finite."""

    def __init__(self, dims: int, dtype: mx.Dtype) -> None:
        super().__init__()
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "_dtype", dtype)

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.zeros((*ids.shape, self._dims), self._dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        raise RuntimeError("a stage without the embedding computed a tied head")


def layer_list(model: nn.Module) -> list[Any]:
    """The list object the model's forward iterates (`model.layers` returns it on every mlx-lm model; a
    property that builds a new list is found by identity in the module tree)."""
    layers = model.layers
    if model.layers is layers:
        return layers
    first = layers[0]
    for _, m in model.named_modules():
        for v in m.values() if isinstance(m, dict) else ():
            if isinstance(v, list) and len(v) == len(layers) and v and v[0] is first:
                return v
    raise ValueError(f"{type(model).__module__}: cannot find the list its layers live in")


def _outside(model: nn.Module, layers: list[Any]) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, key, module) of every module outside the layers."""
    inside = {id(m) for layer in layers for _, m in layer.named_modules()}
    for _, parent in model.named_modules():
        if id(parent) in inside:
            continue
        for key, child in parent.children().items():
            if isinstance(child, nn.Module) and id(child) not in inside:
                yield parent, key, child


def _embeddings(model: nn.Module, layers: list[Any]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, key, module) of every embedding outside the layers: a table of vectors by token
    (nn.Embedding's kinds), not a rotary "embedding" of positions."""
    kinds = nn.Embedding | nn.QuantizedEmbedding
    return [
        (parent, key, child)
        for parent, key, child in _outside(model, layers)
        if isinstance(child, kinds) or type(child).__name__ in ("CpuQuantizedEmbedding", "GGUFEmbedding")
    ]


def _heads(model: nn.Module, layers: list[Any], vocab: int) -> list[tuple[nn.Module, str]]:
    """(parent, key) of every linear outside the layers whose outputs are the vocabulary."""
    found = []
    for parent, key, child in _outside(model, layers):
        w = child.get("weight")
        name = type(child).__name__
        linear = "Linear" in name and "Embedding" not in name
        if linear and isinstance(w, mx.array) and w.ndim == 2 and w.shape[0] == vocab:
            found.append((parent, key))
    return found


def tied(model: nn.Module, layers: list[Any], vocab: int) -> bool:
    """Whether the head is the embedding: no linear outside the layers gives the vocabulary (a flag in the
    config can say otherwise and the model still tie: lille-130m)."""
    return not _heads(model, layers, vocab)


def _advance(c: Any, n: int) -> None:
    """A ghost cache counts n more positions, as its own kind would, without holding them."""
    if isinstance(c, kv_cache.CacheList):
        for inner in c.caches:
            _advance(inner, n)
    elif type(c) in (kv_cache.KVCache, kv_cache.ConcatenateKVCache, kv_cache.QuantizedKVCache):
        c.offset += n
    elif isinstance(c, kv_cache.ArraysCache):
        pass  # its mask depends on padding, not on positions
    elif hasattr(c, "update_and_fetch"):
        # Windows and chunks keep indices besides the offset: let the cache keep them, on one float each.
        z = mx.zeros((1, 1, n, 1), mx.float32)
        c.update_and_fetch(z, z)
    elif hasattr(c, "offset"):
        c.offset += n


def _arrays(c: Any) -> Iterator[mx.array]:
    """The arrays a cache holds, as allocated (its `state` would slice them to the valid positions)."""
    for value in vars(c).values():
        if isinstance(value, mx.array):
            yield value
        elif isinstance(value, list | tuple):
            for v in value:
                if isinstance(v, mx.array):
                    yield v
                elif hasattr(v, "__dict__") and not isinstance(v, type):
                    yield from _arrays(v)


class ModelCaches:
    """One request's caches on a generic stage: the model's own `make_cache()` list, full length (the caches
    the held layers are handed hold positions; the others are ghosts that count them)."""

    def __init__(self, full: list[Any], held: range) -> None:
        self.full = full
        self.held = held  # the held layers' indices (their caches' where there is one per layer)
        self.offset = 0
        # The caches the held layers were handed (ids): a model may keep fewer caches than layers
        # (nemotron_h's MLP layers keep none) and index them its own way.
        self.real: set[int] = set()

    def attach(self, shared: list[list[tuple[mx.array, mx.array]]], block: int) -> None:
        """Start after full blocks another request computed (shared[j]: held layer j's (keys, values) of
        each block): only plain KV caches take them (see `prefix_reason`)."""
        count = len(shared[0]) if shared else 0
        if count == 0:
            return
        for j, i in enumerate(self.held):
            c = self.full[i]
            c.keys = mx.concatenate([k for k, _ in shared[j]], axis=2)
            c.values = mx.concatenate([v for _, v in shared[j]], axis=2)
            c.offset = count * block
        self.offset = count * block
        # Before any forward `real` is empty; a model that takes blocks keeps one cache per layer, by index.
        for i, c in enumerate(self.full):
            if i not in self.held:
                _advance(c, count * block)

    def seal(self, index: int, block: int) -> list[tuple[mx.array, mx.array]]:
        """Held layers' (keys, values) of block `index`, as arrays of their own (the cache grows past it)."""
        lo, hi = index * block, (index + 1) * block
        return [
            (
                mx.contiguous(self.full[i].keys[..., lo:hi, :]),
                mx.contiguous(self.full[i].values[..., lo:hi, :]),
            )
            for i in self.held
        ]

    def bytes_per_token(self) -> int:
        """KV bytes one more position adds on the held layers, read off what is allocated: an upper bound
        (a window counts as if it grew; recurrent state adds nothing)."""
        total = 0
        for c in self.full:
            if id(c) not in self.real:
                continue
            keys = getattr(c, "keys", None)
            values = getattr(c, "values", None)
            if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
                total += (keys.nbytes + values.nbytes) // max(1, keys.shape[2])
        return total

    def advance(self, n: int) -> None:
        """After a forward of n positions: the ghosts count them too."""
        for c in self.full:
            if id(c) not in self.real:
                _advance(c, n)
        self.offset += n

    def arrays(self) -> Iterator[mx.array]:
        """Every array the held layers' caches keep (for counting bytes)."""
        for c in self.full:
            if id(c) in self.real:
                yield from _arrays(c)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class GenericShard:
    """Layers [start, end) of an mlx-lm model, run by the model's own forward (module docstring); a shard
    as compute/shard.py's `Shard` protocol has it, for any architecture.

    `model` is loaded lazily; this keeps the weights of the held layers, the embedding where the stage needs
    it (the first stage; the last when the head is tied) and the head on the last stage: everything else is
    replaced before anything is read."""

    path = "generic"
    why_generic = ""  # set by load_shard: why the fast path does not run this stage
    bounded_attention = False  # set by load_shard: prefill attention in tiles (compute/path_check.py)
    experts_split = False  # set by load_shard: an expert-parallel group's member (compute/expert_parallel.py)
    heads_split: list[bool] = []  # set by load_shard: which held layers' attention a group split by heads

    def __init__(self, model: nn.Module, config: dict, layers: LayerRange, member: int = 0) -> None:
        self.model = model
        self.config = config
        self.range = layers
        # A tensor-parallel group's member (compute/tensor_parallel.py): member 0, the face, sends the
        # stage's output and alone computes a last stage's head; the others stop at their last layer.
        self.member = member
        self.face = self.emits = member == 0
        whole = layers.is_first and layers.is_last
        self.rewritten = True
        try:
            listed = layer_list(model)
        except ValueError:
            if not whole:
                raise
            listed = list(model.layers)  # one stage runs the model as it is: nothing to rewrite
            self.rewritten = False
        if len(listed) != layers.total:
            raise ValueError(f"layer range for {layers.total} layers, model has {len(listed)}")
        start, end = layers.start, layers.end
        self.total = layers.total
        self.is_first, self.is_last = layers.is_first, layers.is_last
        embeddings = _embeddings(model, listed)
        self.hidden_size = _hidden_size(config, embeddings)
        vocab = int(config.get("vocab_size") or _text(config).get("vocab_size") or 0)
        self.tied = tied(model, listed, vocab)
        self.heads_out = self.is_last and self.face  # this stage's output is logits
        keep_embed = self.is_first or (self.heads_out and self.tied)
        dtype = _float_dtype(model, listed[start:end])
        if not keep_embed:
            for parent, key, _ in embeddings:
                parent[key] = ZeroEmbedding(self.hidden_size, dtype)
        self._vocab = vocab
        if not self.is_last:
            self.drop_head(listed)
        self.layers = listed[start:end]
        self.wrappers = [StageLayer(layer, start <= i < end) for i, layer in enumerate(listed)]
        if self.rewritten:
            listed[:] = self.wrappers
        self.held = self.wrappers[start:end]
        self.entry, self.exit = self.held[0], self.held[-1]
        self.activation_dtype = dtype
        # Decided on the first chunk that would use it; a model run as it is has no layer to emit from.
        self._tail_ok: bool | None = None if self.rewritten else False
        self.prefix_reason = self._prefix_reason()
        # Where a fast last stage splits a tied head, the first stage finishes it (`finish_head`), whatever
        # its own path: both compute the same split point. A generic last stage never splits its head.
        self.head_split = 0
        if self.is_first and not self.is_last and self.tied and self.face:
            table = [e for _, _, e in embeddings if e["weight"].shape[0] == vocab]
            self.head_split = tied_head.split_point(table[0]) if table else 0

    def drop_head(self, listed: list[Any] | None = None) -> None:
        """Replace the output head, never reached here (the call stops at the last held layer): a stage
        before the last, or a group member's (load_shard drops it once the fast path is ruled out, whose
        members split it by vocabulary rows)."""
        for parent, key in _heads(self.model, listed if listed is not None else self.wrappers, self._vocab):
            parent[key] = nn.Identity()

    def _new_caches(self) -> list[Any]:
        if hasattr(self.model, "make_cache"):
            return list(self.model.make_cache())
        return [kv_cache.KVCache() for _ in range(self.total)]

    def _prefix_reason(self) -> str:
        """Why the prefix cache cannot share this model's blocks ("" when it can): a block of positions is
        all a plain KV cache holds of them; a window forgets them, recurrent state folds them in."""
        full = self._new_caches()
        if len(full) != self.total:
            return f"it makes {len(full)} caches for {self.total} layers, not one per layer"
        kinds = sorted({type(c).__name__ for c in full if type(c) is not kv_cache.KVCache})
        if not kinds:
            return ""
        return f"its layers keep {', '.join(kinds)}, not positions in blocks"

    def make_cache(
        self, block: int = 0, shared: list[list[tuple[mx.array, mx.array]]] | None = None
    ) -> ModelCaches:
        """A request's caches (the model's own kinds); shared[j]: the full blocks held layer j starts from."""
        full = self._new_caches()
        # A whole model holds every cache it makes, however many per layer (iquestloopcoder's two loops).
        held = range(len(full)) if self.is_first and self.is_last else range(self.range.start, self.range.end)
        caches = ModelCaches(full, held)
        if self.is_first and self.is_last:  # no ghosts: every cache is this stage's, layers' or not
            caches.real.update(id(c) for c in full)
        if shared and any(shared):
            if self.prefix_reason:
                raise ValueError(f"cannot start from cached blocks: {self.prefix_reason}")
            caches.attach(shared, block)
        return caches

    def forward_rows(self, x: mx.array, caches: list[ModelCaches]) -> mx.array:
        """One decode position for each of several requests, each row through the model alone (the same
        bits as alone, whatever the batch): (rows, 1, D) hidden states, or each row's logits (rows, vocab)."""
        outs = [self.forward(x[i : i + 1], c) for i, c in enumerate(caches)]
        if self.heads_out:
            return mx.stack(outs)
        return mx.concatenate(outs, axis=0)

    def finish_head(self, packed: mx.array) -> mx.array:
        """A fast last stage split the tied head (a model whose first stage alone is generic, as gemma's,
        which scales its embedding): the lower logits come from this stage's embedding."""
        vocab = int(self.config.get("vocab_size") or _text(self.config).get("vocab_size") or 0)
        embed = next(e for _, _, e in _embeddings(self.model, self.wrappers) if e["weight"].shape[0] == vocab)
        dtype = tied_head.input_dtype(embed, self.layers[0])
        return tied_head.finish(embed, dtype, self.hidden_size, packed)

    def join_group(self, reduce: Any, gather: Any = None) -> None:
        """Each held block's partial sums end in the group's sum (compute/expert_parallel.py: join_block): a
        tensor group's attention output and MLP down projection, any group's MoE module; the face computes the
        whole head (no vocabulary split on this path)."""
        heads = self.heads_split or [not self.experts_split] * len(self.layers)
        for block, split in zip(self.layers, heads, strict=True):
            expert_parallel.join_block(block, reduce, self.experts_split, split)

    def weight_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def forward(self, x: mx.array, caches: ModelCaches) -> mx.array:
        """x: token ids (1, n) on the first stage, hidden states (1, n, D) elsewhere. Returns hidden states
        (1, n, D), or on the last stage the logits of the last position (vocab,) in float32."""
        n = int(x.shape[1])
        if self.heads_out and n > 1 and self.tail_works():
            h = self._run(x, caches, stop=True)
            return self._tail(h[:, -1:, :])
        out = self._run(x, caches, stop=not self.heads_out)
        return out if not self.heads_out else out[0, -1].astype(mx.float32)

    def _run(self, x: mx.array, caches: ModelCaches, stop: bool) -> mx.array:
        n = int(x.shape[1])
        ids = x if self.is_first else mx.zeros((1, n), mx.int32)
        if not self.is_first:
            object.__setattr__(self.entry, "_inject", x)
        object.__setattr__(self.exit, "_exit", stop)
        for w in self.held:
            object.__setattr__(w, "_seen", caches.real)
        try:
            out = self.model(ids, cache=caches.full)
        except StageExit as e:
            out = e.h
        finally:
            object.__setattr__(self.entry, "_inject", None)
            object.__setattr__(self.exit, "_exit", False)
            for w in self.held:
                object.__setattr__(w, "_seen", None)
        caches.advance(n)
        return out

    def tail_works(self) -> bool:
        """Whether the model's call can carry one position through its norm and head alone (its layers
        return their hidden states and nothing else): tried once, on zeros."""
        if self._tail_ok is None:
            try:
                mx.eval(self._tail(mx.zeros((1, 1, self.hidden_size), self.activation_dtype)))
                self._tail_ok = True
            except Exception:
                self._tail_ok = False
        return self._tail_ok

    def _tail(self, h: mx.array) -> mx.array:
        """The model's own norm and head over one position h (1, 1, D): every layer skipped, the last one
        handing h on, and no cache (a mask of one position needs none)."""
        modes = [w._mode for w in self.wrappers]
        for w in self.wrappers:
            object.__setattr__(w, "_mode", _SKIP)
        object.__setattr__(self.wrappers[-1], "_mode", _EMIT)
        object.__setattr__(self.wrappers[-1], "_inject", h)
        try:
            out = self.model(mx.zeros((1, 1), mx.int32), cache=[_Null() for _ in self.wrappers])
        finally:
            for w, mode in zip(self.wrappers, modes, strict=True):
                object.__setattr__(w, "_mode", mode)
            object.__setattr__(self.wrappers[-1], "_inject", None)
        return out[0, -1].astype(mx.float32)


class _Null:
    """A cache for the tail call, where no layer runs: masks of one position need none, and it is falsy
    so that models treat it as absent."""

    offset = 0

    def __bool__(self) -> bool:
        return False


def _text(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else {}


def _hidden_size(config: dict, embeddings: list[tuple[nn.Module, str, nn.Module]]) -> int:
    for key in ("hidden_size", "d_model", "n_embd", "dim", "model_dim"):
        for source in (config, _text(config)):
            if isinstance(source.get(key), int):
                return int(source[key])
    for _, _, e in embeddings:
        w = e.get("weight") if isinstance(e, dict) else None
        if isinstance(getattr(e, "input_dims", None), int):  # GGUF blocks (compute/gguf_linear.py)
            return int(e.input_dims)
        if isinstance(w, mx.array):
            return int(w.shape[-1]) * (32 // e.bits if "scales" in e else 1)
    raise ValueError("cannot tell the model's hidden size")


def _float_dtype(model: nn.Module, layers: list[Any]) -> mx.Dtype:
    """The dtype hidden states have between layers: the widest float among the layers' parameters."""
    rank = {mx.float16: 1, mx.bfloat16: 1, mx.float32: 2}
    found = [v.dtype for layer in layers for _, v in tree_flatten(layer.parameters()) if v.dtype in rank]
    if not found:
        return mx.float32
    if mx.float32 in found or (mx.float16 in found and mx.bfloat16 in found):
        return mx.float32
    return found[0]
