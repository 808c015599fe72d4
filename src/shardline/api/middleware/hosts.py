"""The Host check: a keyless node on loopback answers only requests addressed to this machine's own names.

Why (DNS rebinding): a web page at http://evil.example:8000 can have its name re-resolved to 127.0.0.1. The
browser then sends the page's requests to this node as same-origin ones, with `Host: evil.example:8000`,
and lets the page read the answers: without a key, it could place and remove instances and use every API.
The page cannot choose the Host header, so refusing names other than localhost and loopback addresses
(any port) closes that door; --allowed-host adds names (a proxy's, an /etc/hosts alias). A node with an API
key needs no check (the page does not have the key), nor one listening beyond loopback without a key (it
is open to its network anyway), unless --allowed-host is given, which turns the check on for any node.
"""

from __future__ import annotations

import ipaddress

from shardline.api.errors import ApiError
from shardline.api.middleware.asgi import ASGIApp, Receive, Scope, Send, header, send_error


def is_loopback(host: str) -> bool:
    """localhost, or a loopback address (127.0.0.0/8, ::1), bracketed or not."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """A Host header's name, without its port: "[::1]:8000" -> "::1", "Example.COM:80" -> "example.com"."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value  # a bare IPv6 address has several
    return name.rstrip(".")


def trusted_hosts(host: str, api_key: str | None, allowed_hosts: list[str]) -> frozenset[str] | None:
    """The names (besides loopback ones) requests may be addressed to; None: no check."""
    extra = frozenset(host_name(h) for h in allowed_hosts)
    if "*" in extra:
        return None
    if allowed_hosts or (api_key is None and is_loopback(host)):
        return extra
    return None


class HostCheck:
    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return is_loopback(name) or name in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = header(scope, b"host") if scope["type"] == "http" else None
        # No Host header at all: HTTP/1.0 from a program; a browser always sends one.
        if host is not None and not self.allows(host):
            message = (
                f"requests addressed to host {host_name(host)!r} are refused: this node has no API key and "
                "answers only as localhost; name the host with --allowed-host, or use --api-key"
            )
            await send_error(scope, send, ApiError(403, message, "permission_error"))
            return
        await self.app(scope, receive, send)
