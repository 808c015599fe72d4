"""The door of the Ollama routes (/api/...): JSON bodies whatever their Content-Type, browsers only from here.

Ollama's own documentation posts with `curl -d '{...}'`, which labels the body form-encoded; Ollama reads it
as JSON all the same, so this does too. That makes the routes reachable by a browser's "simple" cross-site
request (no CORS preflight for a form-encoded POST), so a request from a foreign page (an Origin header that
is neither this server nor localhost, nor allowed with --cors-origin) is refused before it reaches a route.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from shardline.api.errors import ApiError
from shardline.api.middleware.asgi import ASGIApp, Receive, Scope, Send, header, send_error

PREFIX = "/api/"
LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}  # what Ollama allows by default


def is_json_type(content_type: str | None) -> bool:
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def origin_allowed(origin: str, host: str | None, allowed: list[str]) -> bool:
    """Whether a browser page at `origin` may use the Ollama routes of the server reached as `host`."""
    if "*" in allowed or origin in allowed:
        return True
    try:
        parts = urlsplit(origin)
        hostname = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not hostname:
        return False  # "null" (sandboxed frames, file pages) and other schemes are foreign
    return (
        hostname in LOOPBACK or hostname.endswith(".localhost") or (host is not None and parts.netloc == host)
    )


class OllamaEntrance:
    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allowed = list(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        foreign = origin is not None and not origin_allowed(origin, header(scope, b"host"), self.allowed)
        if foreign and scope.get("method") != "OPTIONS":  # a preflight sends nothing to a route
            await _forbidden(scope, send, str(origin))
            return
        if scope.get("method") == "POST" and not is_json_type(header(scope, b"content-type")):
            # Read as JSON, as Ollama does: the route's body parser decides by this header.
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


async def _forbidden(scope: Scope, send: Send, origin: str) -> None:
    message = (
        f"requests from the web page at origin {origin!r} are refused: allow it with --cors-origin on the "
        "node, or call this API from a program (no Origin header)"
    )
    await send_error(scope, send, ApiError(403, message, "permission_error"))
