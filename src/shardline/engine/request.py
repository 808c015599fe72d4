"""Request state held by the front, outside any runner: enough to resume a request on a new instance."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m

if TYPE_CHECKING:
    from shardline.engine.engine import Engine


class RequestError(RuntimeError):
    """The request could not be completed; the message says why."""


@dataclass
class Token:
    index: int
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    logits: mx.array | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_tokens: list[int]
    want_logits: bool = False
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    submitted_at: float = field(default_factory=time.monotonic)

    def spec(self, resume: str = "exact") -> m.RequestSpec:
        """What to send a leader now: prompt plus everything already streamed, so a resume continues."""
        if resume == "fast" and self.generated:
            return m.RequestSpec(
                request_id=self.request_id,
                prompt=[*self.prompt, *self.generated],
                index_base=len(self.generated),
                max_tokens=self.max_tokens - len(self.generated),
                sampling=self.sampling,
                stop_tokens=self.stop_tokens,
                want_logits=self.want_logits,
            )
        return m.RequestSpec(
            request_id=self.request_id,
            prompt=self.prompt,
            generated=list(self.generated),
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_tokens=self.stop_tokens,
            want_logits=self.want_logits,
        )


class RequestHandle:
    """Iterate to stream tokens; the iteration ends when the request finishes, or raises RequestError."""

    def __init__(self, engine: Engine, state: RequestState) -> None:
        self._engine = engine
        self.state = state
        self._queue: queue.Queue[Token | m.Finished | m.RequestFailed] = queue.Queue()
        self._done = threading.Event()

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    # Called by the engine's event thread.
    def _deliver(self, event: m.TokenEvent | m.Finished | m.RequestFailed, tensor: mx.array | None) -> None:
        if self._done.is_set():
            return
        if isinstance(event, m.TokenEvent):
            if event.index != len(self.state.generated):
                return  # a replayed or duplicate token after a resume: already streamed
            self.state.generated.append(event.token)
            self._queue.put(Token(event.index, event.token, event.logprob, event.top_logprobs, tensor))
            return
        if isinstance(event, m.Finished):
            self.state.finish_reason = event.reason
        else:
            self.state.error = event.message
        self._done.set()
        self._queue.put(event)

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            item = self._queue.get()
            if isinstance(item, Token):
                yield item
            elif isinstance(item, m.RequestFailed):
                raise RequestError(item.message)
            else:
                return

    def tokens(self, timeout: float | None = None) -> list[int]:
        """Wait for the whole answer (with a deadline, if given) and return its token ids."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout}s")
        if self.state.error is not None:
            raise RequestError(self.state.error)
        return list(self.state.generated)

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self._done.is_set()
