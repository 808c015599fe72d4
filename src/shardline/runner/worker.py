"""One stage's compute: per-request KV caches and the step it runs for each ring message."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from shardline.compute.constraints import Constraint, Matchers
from shardline.compute.sampling import SamplingParams, sample, sample_many
from shardline.compute.shard import Shard
from shardline.dataplane.frame import tensor_meta
from shardline.dataplane.messages import Evict, Release, RowResult, Step, StepResult, StepTime

WARMUP_ID = "\x00warmup"  # the ring warm-up's request: no front sends control characters


class ProtocolError(RuntimeError):
    """A message that does not fit this stage's state: never obeyed."""


Constrained = tuple[str, Constraint, list[int]]  # request, constraint, output so far


def constrained_rows(step: Step) -> list[Constrained]:
    """The step's requests that sample under a constraint: what their masks are computed from."""
    if not step.sample:
        return []
    if not step.rows:
        sp = step.sampling
        return [(step.request_id, sp.constraint, step.output)] if sp and sp.constraint else []
    return [
        (r.request_id, r.sampling.constraint, r.output)
        for r in step.rows
        if r.sample and r.sampling is not None and r.sampling.constraint is not None
    ]


def _masks(
    matchers: Matchers | None, rows: list[tuple[str, SamplingParams, list[int]]], vocab: int
) -> list[mx.array | None]:
    """Each row's allowed tokens (None when unconstrained: such a row costs nothing here)."""
    want = [(rid, sp.constraint, out) for rid, sp, out in rows if sp.constraint is not None]
    if not want:
        return [None] * len(rows)
    if matchers is None:
        raise ProtocolError("a constrained row reached a stage that cannot compute masks")
    got = iter(matchers.masks(want, vocab))
    return [mx.array(next(got)) if sp.constraint is not None else None for _, sp, _ in rows]


def finish(step: Step, y: mx.array, matchers: Matchers | None = None) -> tuple[StepResult, mx.array | None]:
    """A sampling step's result from its logits: (vocab,) for one request, (rows, vocab) for a batch, each
    row sampled with its own settings (and its constraint's mask) in one evaluation."""
    vocab = int(y.shape[-1])
    if not step.rows:
        assert step.sampling is not None
        (allowed,) = _masks(matchers, [(step.request_id, step.sampling, step.output)], vocab)
        s = sample(y, step.sampling, step.pos + step.n, step.context, step.output, allowed)
        logits = y if step.want_logits else None
        return (
            StepResult(
                seq=step.seq,
                request_id=step.request_id,
                token=s.token,
                logprob=s.logprob,
                top_logprobs=s.top_logprobs,
                tensor=tensor_meta(y) if logits is not None else None,
            ),
            logits,
        )
    wanted = [i for i, r in enumerate(step.rows) if r.sample]
    rows = [step.rows[i] for i in wanted]
    assert all(r.sampling is not None for r in rows)
    masks = _masks(matchers, [(r.request_id, r.sampling, r.output) for r in rows], vocab)  # type: ignore[misc]
    args = []
    for i, r, allowed in zip(wanted, rows, masks, strict=True):
        assert r.sampling is not None
        args.append((y[i], r.sampling, r.pos + 1, r.context, r.output, allowed))
    sampled = dict(zip(wanted, sample_many(args), strict=True))  # one sync for every row
    results = []
    for i, r in enumerate(step.rows):
        s = sampled.get(i)
        fields = {} if s is None else s.model_dump(include={"token", "logprob", "top_logprobs"})
        results.append(RowResult(request_id=r.request_id, **fields))
    logits = y if any(r.want_logits for r in step.rows) else None
    meta = tensor_meta(logits) if logits is not None else None
    return StepResult(seq=step.seq, request_id=step.request_id, rows=results, tensor=meta), logits


class StageWorker:
    def __init__(self, shard: Shard, model_dir: Path | None = None, block: int = 256) -> None:
        self.shard = shard
        self.block = block  # KV positions per cache block: the prefill chunk
        self.caches: dict[str, list] = {}
        # The prefix cache's blocks, as the leader named them: each layer's (keys, values) of one block,
        # the same arrays the request that computed them holds (runner/prefix.py decides).
        self.store: dict[int, list[tuple[mx.array, mx.array]]] = {}
        # Constraint matchers, on the stage that samples (the last, or the first with a split head).
        samples = shard.face and shard.range.is_last != bool(shard.head_split)
        tokenizer = model_dir / "tokenizer.json" if model_dir is not None else None
        self.matchers = Matchers(tokenizer) if samples else None
        self.vocab = int(shard.config.get("vocab_size") or 0)
        self.steps = 0
        self.kv_peak_bytes = 0
        self.kv_bytes_per_token = 0
        # A tensor-parallel face's members (dataplane/group.py): every message this stage obeys goes to them
        # first, in the same order, so their caches follow the face's.
        self.mirror: Callable[..., None] | None = None

    def release(self, request_id: str) -> None:
        if self.mirror is not None:
            self.mirror(Release(request_id=request_id))
        self.caches.pop(request_id, None)
        if self.matchers is not None:
            self.matchers.release(request_id)
        if request_id == WARMUP_ID:
            self.reset_peaks()  # peaks from here on are what real requests cost

    def evict(self, blocks: list[int]) -> None:
        if self.mirror is not None:
            self.mirror(Evict(blocks=blocks))
        for b in blocks:
            self.store.pop(b, None)

    def clear(self) -> None:
        """A new generation: no requests, no cached blocks (its leader starts with an empty index)."""
        self.caches.clear()
        self.store.clear()

    def reset_peaks(self) -> None:
        self.kv_peak_bytes = 0
        mx.reset_peak_memory()

    def check(self, step: Step, x: mx.array) -> None:
        """Raise ProtocolError unless the step continues a request exactly where its cache stands."""
        if step.rows:
            self._check_rows(step, x)
            return
        cache = self.caches.get(step.request_id)
        if cache is None and step.pos != len(step.attach) * self.block:
            raise ProtocolError(f"step at position {step.pos} for unknown request {step.request_id}")
        if cache is None and (missing := [b for b in step.attach if b not in self.store]):
            raise ProtocolError(
                f"request {step.request_id} starts from blocks {missing}, which this stage lacks"
            )
        if step.seal is not None and (step.pos % self.block or step.n != self.block):
            raise ProtocolError(
                f"step at {step.pos} of {step.n} positions cannot fill one block of {self.block}"
            )
        if cache is not None and cache[0].offset != step.pos:
            raise ProtocolError(
                f"request {step.request_id}: step at position {step.pos}, cache holds {cache[0].offset}"
            )
        if x.ndim < 2 or x.shape[1] != step.n or step.n < 1:
            raise ProtocolError(f"step says {step.n} positions, tensor has shape {list(x.shape)}")
        if not self.shard.range.is_first and x.shape[-1] != self.shard.hidden_size:
            raise ProtocolError(f"hidden size {x.shape[-1]}, this model has {self.shard.hidden_size}")

    def _check_rows(self, step: Step, x: mx.array) -> None:
        ids = [r.request_id for r in step.rows]
        if len(set(ids)) != len(ids):
            raise ProtocolError(f"batched step {step.seq} names a request twice")
        for r in step.rows:
            cache = self.caches.get(r.request_id)
            if cache is None or cache[0].offset != r.pos:
                held = "no cache" if cache is None else f"cache holds {cache[0].offset}"
                raise ProtocolError(f"request {r.request_id}: batched row at position {r.pos}, {held}")
        if x.ndim < 2 or x.shape[0] != len(step.rows) or x.shape[1] != 1:
            raise ProtocolError(f"batched step of {len(step.rows)} rows, tensor has shape {list(x.shape)}")
        if not self.shard.range.is_first and x.shape[-1] != self.shard.hidden_size:
            raise ProtocolError(f"hidden size {x.shape[-1]}, this model has {self.shard.hidden_size}")

    def run(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        """Returns the message for the next stage (hidden states) or, on the last stage, the step's result."""
        if step.rows:
            return self._run_rows(step, x)
        self.check(step, x)
        if self.mirror is not None:
            self.mirror(step, x)
        self._prepare(step)
        cache = self.caches.get(step.request_id)
        if cache is None:
            # Starting after cached blocks shares them: each layer's cache begins with the same arrays.
            shared = [[self.store[b][j] for b in step.attach] for j in range(len(self.shard.layers))]
            cache = self.caches[step.request_id] = self.shard.make_cache(self.block, shared)
        y = self.shard.forward(x, cache)
        mx.eval(y)
        if step.seal is not None:
            index = step.pos // self.block
            self.store[step.seal] = [c.block_pair(index) for c in cache]
        return self._done(step, y)

    def _run_rows(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        self._check_rows(step, x)
        if self.mirror is not None:
            self.mirror(step, x)
        self._prepare(step)
        y = self.shard.forward_rows(x, [self.caches[r.request_id] for r in step.rows])
        mx.eval(y)
        return self._done(step, y)

    def _prepare(self, step: Step) -> None:
        """Start the step's masks now: they are computed while this stage runs its layers (and, with a
        split head, while the other stages run theirs)."""
        if self.matchers is not None and (rows := constrained_rows(step)):
            self.matchers.prepare(rows, self.vocab)

    def _done(self, step: Step, y: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        self.steps += 1
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_bytes())
        if not self.shard.emits:  # a group member: its face sends the stage's output
            return step, None
        if not self.shard.range.is_last:
            return step.model_copy(update={"tensor": tensor_meta(y)}), y
        if not step.sample:
            return StepResult(seq=step.seq, request_id=step.request_id), None
        if self.shard.head_split:  # the leader completes the logits and samples
            return StepResult(seq=step.seq, request_id=step.request_id, head=True, tensor=tensor_meta(y)), y
        return finish(step, y, self.matchers)

    def finish_head(self, step: Step, packed: mx.array) -> tuple[StepResult, mx.array | None]:
        """On the first stage, for a result with `head`: the full logits from the last stage's part, then
        the step's samples."""
        return finish(step, self.shard.finish_head(packed), self.matchers)  # one evaluation: the sampler's

    def kv_bytes(self) -> int:
        """The bytes of every KV block held, each once however many requests share it."""
        return self.kv_figures()[0]

    def kv_figures(self) -> tuple[int, int]:
        """The bytes of every KV block held (each once, however many requests share it), and of those the
        bytes of the blocks the prefix cache keeps."""
        held: dict[int, int] = {}
        for cache in list(self.caches.values()):
            for c in cache:
                for a in c.blocks_held():
                    held[id(a)] = a.nbytes
        cached: dict[int, int] = {}
        for layers in list(self.store.values()):
            for k, v in layers:
                cached[id(k)], cached[id(v)] = k.nbytes, v.nbytes
        return sum({**held, **cached}.values()), sum(cached.values())

    def warm_up(self, chunk: int, delay: Callable[[], float]) -> list[StepTime]:
        """Throwaway steps of one position and of one prefill chunk: first-touch allocation is paid here,
        and their timings seed the step deadlines before any real step runs."""
        timings = []
        for n in sorted({1, max(1, chunk)}):
            cache = self.shard.make_cache(self.block)
            if self.shard.range.is_first:
                x = mx.zeros((1, n), dtype=mx.int32)
            else:
                x = mx.zeros((1, n, self.shard.hidden_size), dtype=mx.float32)
            started = time.monotonic()
            mx.eval(self.shard.forward(x, cache))
            time.sleep(delay())  # an injected slow stage is slow from warm-up on
            timings.append(StepTime(n=n, context=n, seconds=time.monotonic() - started))
            if n == 1:
                per_stage = sum(c.nbytes for c in cache)
                self.kv_bytes_per_token = per_stage // cache[0].block  # one block per layer
            del cache
        self.reset_peaks()
        return timings
