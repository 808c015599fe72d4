"""What the routes of every API share: answering an active request (api/active.py) whole or streamed, and
noticing a client that left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline.api.active import ActiveRequest, Outcome
from shardline.api.errors import ApiError, Flavor, body

T = TypeVar("T")
R = TypeVar("R", ActiveRequest, "ActiveGroup")

# How a route documents its streamed form in the OpenAPI spec: each server-sent event (event name, data
# line), or each NDJSON line (an object).
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
}
STREAMED_SSE = {"content": {"text/event-stream": {"schema": SSE_EVENT}}}
STREAMED_NDJSON = {"content": {"application/x-ndjson": {"schema": {"type": "object"}}}}


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was cancelled."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so the request in the pipeline) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone


async def whole(request: Request, active: ActiveRequest) -> Outcome:
    try:
        return await unless_gone(request, active.complete())
    finally:
        active.close()


@dataclass
class ActiveGroup:
    """The active requests of one request's choices (OpenAI's n), answered and closed together."""

    actives: list[ActiveRequest]

    def close(self) -> None:
        for active in self.actives:
            active.close()


async def whole_all(request: Request, group: ActiveGroup) -> list[Outcome]:
    try:
        return await unless_gone(request, asyncio.gather(*(active.complete() for active in group.actives)))
    finally:
        group.close()


@dataclass
class _Item(Generic[T]):
    index: int
    value: T | None = None  # None: that iterator ended
    error: BaseException | None = None


async def merged(iters: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T | None]]:
    """(i, item) from several async iterators as their items come, and (i, None) when iterator i ends;
    the first error ends it all. Leaving early cancels what is still running."""
    queue: asyncio.Queue[_Item[T]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for x in it:
                await queue.put(_Item(i, x))
            await queue.put(_Item(i))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put(_Item(i, error=exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iters)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item.error is not None:
                raise item.error
            if item.value is None:
                left -= 1
            yield item.index, item.value
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {text}\n\n".encode()


def ndjson(data: Any) -> bytes:
    return (json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


class ActiveResponse(StreamingResponse):
    """A streamed active request that ends with its response, however the response ends.

    Starlette cancels the body's task when the client disconnects; before the first byte its generator
    has not even started, so a `finally` inside it never runs. Closing the active request here, after
    the whole response (sent, failed or cancelled), frees its slot and cancels it in the pipeline in every
    case."""

    def __init__(self, active: ActiveRequest | ActiveGroup, content: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.active = active
        self._content = content

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.active.close()
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()  # runs the generator's own cleanup if it had started


def stream_response(
    active: R,
    events: Callable[[R], AsyncIterator[bytes]],
    flavor: Flavor,
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Stream what `events` makes of the active request (or group). A client that disconnects, before or
    after the first byte, ends the response, which cancels the request; an error after the first byte is
    sent in the API's shape."""

    async def body_stream() -> AsyncIterator[bytes]:
        try:
            async for part in events(active):
                yield part
        except ApiError as exc:
            err = body(exc, flavor)
            if flavor == "ollama":
                yield ndjson(err)
            elif flavor == "anthropic":
                yield sse(err, "error")
            else:
                yield sse(err)
        finally:
            active.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return ActiveResponse(active, body_stream(), media_type=media_type, headers=headers)
