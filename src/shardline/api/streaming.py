"""What the routes of every API share: answering a run whole or streamed, and noticing a client that left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline.api.errors import ApiError, Flavor, body
from shardline.api.service import ActiveRequest, Outcome

T = TypeVar("T")

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


async def whole(request: Request, run: ActiveRequest) -> Outcome:
    try:
        return await unless_gone(request, run.complete())
    finally:
        run.close()


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {text}\n\n".encode()


def ndjson(data: Any) -> bytes:
    return (json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def stream_response(
    run: ActiveRequest,
    events: Callable[[ActiveRequest], AsyncIterator[bytes]],
    flavor: Flavor,
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Stream what `events` makes of the run. A client that disconnects ends the generator (Starlette
    cancels it), which cancels the request; an error after the first byte is sent in the API's shape."""

    async def body_stream() -> AsyncIterator[bytes]:
        try:
            async for part in events(run):
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
            run.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body_stream(), media_type=media_type, headers=headers)
