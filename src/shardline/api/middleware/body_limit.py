"""The request body limit, counted as the body arrives: a chunked body declares no Content-Length.

A declared length over the limit is refused at once. Otherwise the bytes the app reads are counted, and the
read that passes the limit raises `BodyTooLarge` (a 413 HTTPException: FastAPI's body parsing lets it
through to the app's handler, which answers in the API's shape); if it surfaces anywhere else before the
response started, the 413 is sent here. Nothing past the limit is ever held: uvicorn drops the rest of the
body after the response instead of closing at once, so the client reads its 413 rather than a reset.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from shardline.api.errors import ApiError
from shardline.api.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_error

MAX_BODY_BYTES = 32 << 20


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = header(scope, b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.limit):
            await send_error(scope, send, ApiError(413, f"the request body exceeds {self.limit} bytes"))
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:
            if started:
                raise
            await send_error(scope, send, ApiError(413, str(exc.detail)))
