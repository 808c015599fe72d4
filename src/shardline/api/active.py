"""An active request: one API request through this node's front, as text. Its chunks as they become safe to
send, its outcome (finish reason, counts, text) and its timings; closing it frees its slot.

"Active request" (`active` for one, `actives` for a request's n choices) is the API's one word for it; the
front's own form of the same request is front/request.py's RequestState and RequestHandle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from shardline.api.errors import ApiError
from shardline.api.metrics import Metrics
from shardline.api.model_text import ModelText
from shardline.api.text_stream import TextStream
from shardline.errors import RequestError
from shardline.front.request import RequestDeadlineError, RequestHandle, Token


@dataclass
class Chunk:
    text: str
    tokens: list[Token]


@dataclass
class RequestTimings:
    ttft_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    total_s: float = 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {k: (round(v, 6) if v is not None else None) for k, v in self.__dict__.items()}


@dataclass
class Outcome:
    finish_reason: str  # "stop" (end token or stop string) or "length"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    text: str
    timings: RequestTimings
    cached_tokens: int = 0  # of prompt_tokens, those the leader's prefix cache held (its Finished)


@dataclass
class ActiveRequest:
    """One request through this node's front, as text. Iterate `chunks()`; then `outcome` is set."""

    id: str
    model: str
    instance: str
    handle: RequestHandle
    stream: TextStream
    text: ModelText  # the model's tokenizer: routes format logprobs with it, with no await in between
    prompt_tokens: int
    started: float
    metrics: Metrics
    release: Callable[[], None]
    endpoint: str
    # Runs a callable later, off whatever thread a finaliser interrupted (which may hold any lock).
    defer: Callable[[Callable[[], None]], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    outcome: Outcome | None = None
    _first: float | None = None
    _last: float | None = None
    _fed: int = 0  # tokens taken from the front (the text stream stops counting at a stop string)
    _closed: bool = False
    used: list[Token] = field(default_factory=list)  # tokens whose text was sent (with their logprobs)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Text as it becomes safe to send; ends at the end token, max_tokens or a stop string.

        Leaving the iteration early (the client went away) cancels the request in the pipeline."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self.handle.watch(lambda: loop.call_soon_threadsafe(wake.set))
        outcome = "cancelled"
        try:
            while True:
                wake.clear()
                try:
                    tokens, ended = self.handle.drain()
                except RequestDeadlineError as exc:
                    outcome = "error"
                    raise ApiError(
                        503, f"the request timed out: {exc}", "timeout_error", code="timeout"
                    ) from exc
                except RequestError as exc:
                    outcome = "error"
                    raise ApiError(503, f"the request failed: {exc}", "server_error") from exc
                if tokens:
                    counted = self.stream.tokens
                    text = "".join(self._feed(t) for t in tokens)
                    used = tokens[: self.stream.tokens - counted]  # those before a stop string
                    self.used += used
                    if self.stream.stopped is not None:
                        self.handle.cancel_soon()  # the rest is not wanted: free the pipeline now
                        self._finish("stop")
                        yield Chunk(text + self.stream.flush(), used)
                        return
                    if text or used:
                        yield Chunk(text, used)
                if ended:
                    reason = "stop" if self.handle.finish_reason == "stop" else "length"
                    tail = self.stream.flush()
                    self._finish(reason)
                    if tail:
                        yield Chunk(tail, [])
                    return
                if not tokens:
                    await wake.wait()
        finally:
            self.close(outcome)

    def __del__(self) -> None:
        # A backstop: an active request dropped on a path that never reached its response (an exception or a
        # cancellation between start and respond) still frees its slot and its place in the pipeline. A
        # finaliser may run inside any code holding any lock (the slot count's, the front's, a metric's):
        # it only hands the close to the service, which runs it later.
        if self._closed:
            return
        try:
            if self.defer is not None:
                self.defer(self.close)
            else:
                self.close()
        except Exception:
            pass

    def close(self, outcome: str = "cancelled") -> None:
        """End the request if it has not ended (cancelling it in the pipeline); free its slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.outcome is None:
            self.handle.cancel_soon()  # sent from the front's thread: no blocking put on the event loop
            self.metrics.requests.labels(self.endpoint, outcome).inc()
        self.release()

    def _feed(self, token: Token) -> str:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.metrics.ttft.labels(self.model).observe(now - self.started)
        elif self._last is not None:
            self.metrics.itl.labels(self.model).observe(now - self._last)
        self._last = now
        self._fed += 1
        return self.stream.feed(token.token)

    def _finish(self, reason: str) -> None:
        now = time.monotonic()
        t = RequestTimings(total_s=now - self.started)
        if self._first is not None:
            t.ttft_s = self._first - self.started
            t.prefill_tokens_per_s = self.prompt_tokens / max(t.ttft_s, 1e-9)
            n = self.stream.tokens
            if n > 1 and self._last is not None and self._last > self._first:
                t.decode_tokens_per_s = (n - 1) / (self._last - self._first)
        self.outcome = Outcome(
            finish_reason=reason,
            stop_sequence=self.stream.stopped,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.stream.tokens,
            text=self.stream.text,
            timings=t,
            cached_tokens=self.handle.state.cached_tokens,
        )
        self.metrics.tokens_out.labels(self.model).inc(self.stream.tokens)
        self.metrics.requests.labels(self.endpoint, "ok").inc()

    async def complete(self) -> Outcome:
        async for _ in self.chunks():
            pass
        assert self.outcome is not None
        return self.outcome
