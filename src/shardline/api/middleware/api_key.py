"""The API key a node may require (--api-key): whether a request carries it (bearer token or x-api-key)."""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection


def carries_key(request: HTTPConnection, key: str) -> bool:
    given = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    return bool(given) and hmac.compare_digest(given.encode(), key.encode())
