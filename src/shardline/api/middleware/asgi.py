"""What the ASGI middlewares of the API share: the types, reading a header, answering an error in the API's
shape before any route runs."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from shardline.api.errors import ApiError, body, flavor_of, headers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def send_error(scope: Scope, send: Send, error: ApiError) -> None:
    """The error as a whole response, in the shape of the API the path belongs to."""
    payload = json.dumps(body(error, flavor_of(scope.get("path", "")))).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers(error).items()]
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
