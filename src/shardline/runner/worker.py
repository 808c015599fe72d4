"""One stage's compute: per-request KV caches and the step it runs for each ring message."""

from __future__ import annotations

import mlx.core as mx

from shardline.compute.sampling import sample
from shardline.compute.shard import Shard
from shardline.dataplane.frame import tensor_meta
from shardline.dataplane.messages import Step, StepResult

KV_STEP = 256  # mlx-lm's KVCache growth step


class ProtocolError(RuntimeError):
    pass


class StageWorker:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.caches: dict[str, list] = {}
        self.steps = 0
        self.kv_peak_bytes = 0

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def run(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        """Returns the message for the next stage (hidden states) or, on the last stage, the step's result."""
        cache = self.caches.get(step.request_id)
        if cache is None:
            if step.pos != 0:
                raise ProtocolError(f"step at position {step.pos} for unknown request {step.request_id}")
            cache = self.caches[step.request_id] = self.shard.make_cache()
            if step.reserve:
                # One allocation for the whole prompt: growing in small steps copies the cache each time,
                # and the copy briefly holds two caches.
                for c in cache:
                    c.step = -(-step.reserve // KV_STEP) * KV_STEP
        if cache[0].offset != step.pos:
            raise ProtocolError(
                f"request {step.request_id}: step at position {step.pos}, cache holds {cache[0].offset}"
            )
        if x.shape[1] != step.n:
            raise ProtocolError(f"step says {step.n} positions, tensor has {x.shape[1]}")
        y = self.shard.forward(x, cache)
        mx.eval(y)
        if step.reserve:
            for c in cache:
                c.step = KV_STEP
        self.steps += 1
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_bytes())
        if not self.shard.range.is_last:
            return step.model_copy(update={"tensor": tensor_meta(y)}), y
        if not step.sample:
            return StepResult(seq=step.seq, request_id=step.request_id), None
        assert step.sampling is not None
        s = sample(y, step.sampling, step.pos + step.n, step.context)
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

    def kv_bytes(self) -> int:
        return sum(c.nbytes for cache in self.caches.values() for c in cache)

    def warm_up(self) -> None:
        """One throwaway step so the first real request does not pay for first-touch allocation."""
        cache = self.shard.make_cache()
        if self.shard.range.is_first:
            x = mx.zeros((1, 1), dtype=mx.int32)
        else:
            x = mx.zeros((1, 1, self.shard.hidden_size), dtype=mx.float32)
        mx.eval(self.shard.forward(x, cache))
        del cache
        mx.reset_peak_memory()
