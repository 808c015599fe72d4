"""Request state held by the front, outside any runner: enough to resume a request on a new generation."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m
from shardline.errors import RequestError


class RequestDeadlineError(RequestError):
    """The request's wait passed its deadline (front.request_deadlines); the message says which wait."""


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
    # Where it stands with the instance: the generation it was last sent to, the control seq of that send,
    # and whether that generation's leader admitted it (else it waits in a queue, and counts against it).
    sent_generation: int | None = None
    sent_seq: int | None = None
    sent_at: float = 0.0  # monotonic, when its Submit went out
    resent: bool = False  # its newest Submit went out when a generation started serving (accepted before)
    admitted: bool = False
    # Its deadlines (monotonic): the first token, and the whole answer; and when a token last arrived.
    first_token_by: float = float("inf")
    done_by: float = float("inf")
    progress_at: float = field(default_factory=time.monotonic)
    expired: bool = False  # it ended because a deadline passed
    # Prompt tokens whose KV the leader took from its prefix cache, as its Finished says (0 until then, and
    # for a request ended here, e.g. at a stop string, before the leader's end arrived).
    cached_tokens: int = 0

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


_END = object()


class RequestHandle:
    """Iterate to stream tokens; the iteration ends when the request finishes, or raises RequestError.

    Every handle ends: with its tokens and a finish reason, or with an error (the front guarantees it).
    """

    def __init__(
        self,
        state: RequestState,
        cancel: Callable[[str], None],
        cancel_soon: Callable[[str], None] | None = None,
    ) -> None:
        # Callbacks rather than the front itself: the handle needs only these, and request.py stays a leaf.
        self._cancel = cancel
        self._cancel_soon = cancel_soon or cancel
        self.state = state
        self._queue: queue.Queue[Token | object] = queue.Queue()  # at most max_tokens + 1 items
        self._done = threading.Event()
        self._ended = False  # the end marker was taken by drain()
        self._watchers: list[Callable[[], None]] = []

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (known once the request finished)."""
        return self.state.cached_tokens

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from the front's thread; it must not block) whenever a token or the end arrives."""
        self._watchers.append(wake)
        if not self._queue.empty():
            wake()

    def _wake(self) -> None:
        for wake in self._watchers:
            try:
                wake()
            except Exception:  # a watcher whose loop has closed: its client is gone
                pass

    # Called by the front, under its lock: never blocks.
    def _token(self, event: m.TokenEvent, tensor: mx.array | None) -> None:
        self.state.generated.append(event.token)
        self.state.progress_at = time.monotonic()
        self._queue.put(Token(event.index, event.token, event.logprob, event.top_logprobs, tensor))
        self._wake()

    def _finish(self, reason: str | None = None, error: str | None = None) -> bool:
        if self._done.is_set():
            return False
        self.state.finish_reason = reason
        self.state.error = error
        self._done.set()
        self._queue.put(_END)
        self._wake()
        return True

    def drain(self) -> tuple[list[Token], bool]:
        """Without blocking: the tokens that arrived since the last call, and whether the request has ended.
        Raises RequestError, after every token before it was taken, if the request ended with an error."""
        out: list[Token] = []
        while not self._ended:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Token):
                out.append(item)
            else:
                self._ended = True
        if self._ended and not out and self.state.error is not None:
            raise self._error()
        return out, self._ended and not (out and self.state.error is not None)

    def stream(self, timeout: float | None = None) -> Iterator[Token]:
        """Tokens as they come; raises TimeoutError if the whole answer takes longer than `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            try:
                if wait is not None and wait <= 0:
                    raise queue.Empty
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id} not finished within {timeout}s") from None
            if isinstance(item, Token):
                yield item
            elif self.state.error is not None:
                raise self._error()
            else:
                return

    def __iter__(self) -> Iterator[Token]:
        return self.stream()

    def tokens(self, timeout: float | None = None) -> list[int]:
        """Wait for the whole answer (with a deadline, if given) and return its token ids."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout}s")
        if self.state.error is not None:
            raise self._error()
        return list(self.state.generated)

    def _error(self) -> RequestError:
        assert self.state.error is not None
        kind = RequestDeadlineError if self.state.expired else RequestError
        return kind(self.state.error)

    def cancel(self) -> None:
        self._cancel(self.request_id)

    def cancel_soon(self) -> None:
        """Cancel from the front's own thread: never blocks, never takes a lock the caller may hold (for
        finalisers, and for event loops, where a send must not block)."""
        self._cancel_soon(self.request_id)
