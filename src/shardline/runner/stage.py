"""One stage's compute: per-request KV caches and the step it runs for each ring message."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from shardline.compute.constraints import Constraint, Matchers
from shardline.compute.sampling import SamplingParams, sample, sample_many
from shardline.compute.shard import Shard
from shardline.dataplane.frame import tensor_meta
from shardline.dataplane.messages import Prime, RowResult, Step, StepResult, StepTime

WARMUP_ID = "\x00warmup"  # the ring warm-up's request: no front sends control characters


class ProtocolError(RuntimeError):
    """A message that does not fit this stage's state: never obeyed."""


# One step through the runner's stage, timed and watched (runner/process.py RunnerProcess.compute): the
# message for the next stage (or the step's result) and its tensor.
Compute = Callable[[Step, mx.array], tuple[Step | StepResult, mx.array | None]]


@dataclass
class Held:
    """A request's sampling state on the stage that samples: its settings (sent once, with its first step),
    the newest known tokens its repetition penalty reads and its output so far, both kept up to date here
    by appending each token this stage samples. The leader appends the same tokens to what it knows, so
    both stay what the leader would have sent every step."""

    sampling: SamplingParams
    want_logits: bool
    context: deque[int]
    output: list[int]

    @classmethod
    def of(cls, prime: Prime) -> Held:
        sp = prime.sampling
        # A window of 0 reads every known token (as the leader's known[-0:] did).
        window = sp.repetition_context or None
        context = deque(prime.context if sp.repetition_penalty != 1.0 else (), maxlen=window)
        output = list(prime.output) if sp.needs_output else []
        return cls(sp, prime.want_logits, context, output)

    def took(self, token: int) -> None:
        if self.sampling.repetition_penalty != 1.0:
            self.context.append(token)
        if self.sampling.needs_output:
            self.output.append(token)


Constrained = tuple[str, Constraint, list[int]]  # request, constraint, output so far


def constrained_rows(step: Step, held: Mapping[str, Held]) -> list[Constrained]:
    """The step's requests that sample under a constraint: what their masks are computed from (a copy of
    each output: masks are prepared on another thread while this one appends)."""
    ids = [step.request_id] if not step.rows else [r.request_id for r in step.rows if r.sample]
    if not step.sample:
        return []
    return [
        (rid, h.sampling.constraint, list(h.output))
        for rid in ids
        if (h := held.get(rid)) is not None and h.sampling.constraint is not None
    ]


def _masks(matchers: Matchers | None, rows: list[tuple[str, Held]], vocab: int) -> list[mx.array | None]:
    """Each row's allowed tokens (None when unconstrained: such a row costs nothing here)."""
    want = [(rid, h.sampling.constraint, list(h.output)) for rid, h in rows if h.sampling.constraint]
    if not want:
        return [None] * len(rows)
    if matchers is None:
        raise ProtocolError("a constrained row reached a stage that cannot compute masks")
    got = iter(matchers.masks(want, vocab))  # type: ignore[arg-type]
    return [mx.array(next(got)) if h.sampling.constraint is not None else None for _, h in rows]


def _held(held: Mapping[str, Held], request_id: str) -> Held:
    h = held.get(request_id)
    if h is None:
        raise ProtocolError(f"request {request_id} samples, and its settings never reached this stage")
    return h


def finish(
    step: Step, y: mx.array, held: Mapping[str, Held], matchers: Matchers | None = None
) -> tuple[StepResult, mx.array | None]:
    """A sampling step's result from its logits: (vocab,) for one request, (rows, vocab) for a batch, each
    row sampled with its own held settings (and its constraint's mask) in one evaluation. Pure: the caller
    appends the sampled tokens to what it holds (Held.took)."""
    vocab = int(y.shape[-1])
    if not step.rows:
        h = _held(held, step.request_id)
        (allowed,) = _masks(matchers, [(step.request_id, h)], vocab)
        s = sample(y, h.sampling, step.pos + step.n, list(h.context), h.output, allowed)
        logits = y if h.want_logits else None
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
    rows = [(step.rows[i].request_id, _held(held, step.rows[i].request_id)) for i in wanted]
    masks = _masks(matchers, rows, vocab)
    args = []
    for i, (_, h), allowed in zip(wanted, rows, masks, strict=True):
        args.append((y[i], h.sampling, step.rows[i].pos + 1, list(h.context), h.output, allowed))
    sampled = dict(zip(wanted, sample_many(args), strict=True))  # one sync for every row
    results = []
    for i, r in enumerate(step.rows):
        s = sampled.get(i)
        fields = {} if s is None else s.model_dump(include={"token", "logprob", "top_logprobs"})
        results.append(RowResult(request_id=r.request_id, **fields))
    logits = y if any(h.want_logits for _, h in rows) else None
    meta = tensor_meta(logits) if logits is not None else None
    return StepResult(seq=step.seq, request_id=step.request_id, rows=results, tensor=meta), logits


class Stage(Protocol):
    """What the ring's messages act on: a StageCompute, or on a tensor-parallel face its mirror
    (runner/tp_mirror.py), which hands each message to the group's other members first."""

    @property
    def shard(self) -> Shard: ...
    @property
    def steps(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    def check(self, step: Step, x: mx.array) -> None: ...
    def run(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]: ...
    def release(self, request_id: str) -> None: ...
    def evict(self, blocks: list[int]) -> None: ...
    def stop(self) -> None: ...
    def finish_head(self, step: Step, packed: mx.array) -> tuple[StepResult, mx.array | None]: ...


class StageCompute:
    """One stage's compute: its shard, each request's KV cache, the prefix cache's blocks, and on the stage
    that samples each request's sampling state. It obeys the ring's messages in the order it is handed them;
    a tensor-parallel face's wrapper (runner/tp_mirror.py) hands each to the group's members first."""

    def __init__(self, shard: Shard, model_dir: Path | None = None, block: int = 256) -> None:
        self.shard = shard
        self.block = block  # KV positions per cache block: the prefill chunk
        self.caches: dict[str, list] = {}
        # The prefix cache's blocks, as the leader named them: each layer's (keys, values) of one block,
        # the same arrays the request that computed them holds (runner/prefix.py decides).
        self.store: dict[int, list[tuple[mx.array, mx.array]]] = {}
        # Constraint matchers, on the stage that samples (the last, or the first with a split head).
        self.samples = shard.face and shard.range.is_last != bool(shard.head_split)
        tokenizer = model_dir / "tokenizer.json" if model_dir is not None else None
        self.matchers = Matchers(tokenizer) if self.samples else None
        # On the stage that samples: each request's settings and output so far, from its first step to its
        # release (every other stage ignores the settings a first step carries).
        self.held: dict[str, Held] = {}
        self.vocab = int(shard.config.get("vocab_size") or 0)
        self.steps = 0
        self.kv_peak_bytes = 0
        self.kv_bytes_per_token = 0

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        self.held.pop(request_id, None)
        if self.matchers is not None:
            self.matchers.release(request_id)
        if request_id == WARMUP_ID:
            self.reset_peaks()  # peaks from here on are what real requests cost

    def evict(self, blocks: list[int]) -> None:
        for b in blocks:
            self.store.pop(b, None)

    def stop(self) -> None:
        """The ring stops: a stage of one runner has nobody else to tell."""

    def clear(self) -> None:
        """A new generation: no requests, no cached blocks (its leader starts with an empty index)."""
        self.caches.clear()
        self.store.clear()
        self.held.clear()

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
        if step.prime is not None and cache is not None:
            raise ProtocolError(f"request {step.request_id}: settings again at position {step.pos}")
        if self.samples and step.sample and cache is None and step.prime is None:
            raise ProtocolError(f"request {step.request_id} samples, and its first step has no settings")
        if self.samples and step.sample and cache is not None and step.request_id not in self.held:
            raise ProtocolError(
                f"request {step.request_id} samples, and its settings never reached this stage"
            )
        if step.seal is not None and (step.pos % self.block or step.n != self.block):
            raise ProtocolError(
                f"step at {step.pos} of {step.n} positions cannot fill one block of {self.block}"
            )
        if cache is not None and cache.offset != step.pos:
            raise ProtocolError(
                f"request {step.request_id}: step at position {step.pos}, cache holds {cache.offset}"
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
            if cache is None or cache.offset != r.pos:
                held = "no cache" if cache is None else f"cache holds {cache.offset}"
                raise ProtocolError(f"request {r.request_id}: batched row at position {r.pos}, {held}")
            if self.samples and r.sample and r.request_id not in self.held:
                raise ProtocolError(
                    f"request {r.request_id} samples, and its settings never reached this stage"
                )
        if x.ndim < 2 or x.shape[0] != len(step.rows) or x.shape[1] != 1:
            raise ProtocolError(f"batched step of {len(step.rows)} rows, tensor has shape {list(x.shape)}")
        if not self.shard.range.is_first and x.shape[-1] != self.shard.hidden_size:
            raise ProtocolError(f"hidden size {x.shape[-1]}, this model has {self.shard.hidden_size}")

    def run(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        """Returns the message for the next stage (hidden states) or, on the last stage, the step's result.
        A step that does not fit raises ProtocolError before anything runs."""
        self.check(step, x)
        return self.run_checked(step, x)

    def run_checked(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        """`run`, for a step `check` passed already."""
        if step.rows:
            return self._run_rows(step, x)
        if step.prime is not None and self.samples:
            self.held[step.request_id] = Held.of(step.prime)
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
            self.store[step.seal] = cache.seal(index, self.block)
        return self._done(step, y)

    def _run_rows(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        self._prepare(step)
        y = self.shard.forward_rows(x, [self.caches[r.request_id] for r in step.rows])
        mx.eval(y)
        return self._done(step, y)

    def _prepare(self, step: Step) -> None:
        """Start the step's masks now: they are computed while this stage runs its layers (and, with a
        split head, while the other stages run theirs)."""
        if self.matchers is not None and (rows := constrained_rows(step, self.held)):
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
        return self._sampled(*finish(step, y, self.held, self.matchers))

    def _sampled(self, res: StepResult, logits: mx.array | None) -> tuple[StepResult, mx.array | None]:
        """Append what was sampled to each row's held output: the leader appends the same tokens."""
        for r in res.rows or [RowResult(request_id=res.request_id, token=res.token)]:
            if r.token is not None and (h := self.held.get(r.request_id)) is not None:
                h.took(r.token)
        return res, logits

    def finish_head(self, step: Step, packed: mx.array) -> tuple[StepResult, mx.array | None]:
        """On the first stage, for a result with `head`: the full logits from the last stage's part, then
        the step's samples."""
        # One evaluation: the sampler's.
        return self._sampled(*finish(step, self.shard.finish_head(packed), self.held, self.matchers))

    def kv_bytes(self) -> int:
        """The bytes of every KV block held, each once however many requests share it."""
        return self.kv_figures()[0]

    def kv_figures(self) -> tuple[int, int]:
        """The bytes of every KV block held (each once, however many requests share it), and of those the
        bytes of the blocks the prefix cache keeps."""
        held: dict[int, int] = {}
        for cache in list(self.caches.values()):
            for a in cache.arrays():
                held[id(a)] = a.nbytes
        cached: dict[int, int] = {}
        for layers in list(self.store.values()):
            for k, v in layers:
                cached[id(k)], cached[id(v)] = k.nbytes, v.nbytes
        return sum({**held, **cached}.values()), sum(cached.values())

    def warm_up(self, chunk: int, delay: Callable[[], float]) -> list[StepTime]:
        """Throwaway steps of one position and of one prefill chunk: first-touch allocation is paid here,
        and their timings seed the step deadlines before any real step runs. The stage that samples builds
        its constraint tokenizer here too, under the load deadline: built at a request's first constrained
        step, its GIL-holding build would lengthen that step, in every fresh runner."""
        if self.matchers is not None and self.matchers.available and self.vocab > 0:
            self.matchers.load(self.vocab)
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
                self.kv_bytes_per_token = cache.bytes_per_token()
            del cache
        self.reset_peaks()
        return timings
