"""Uvicorn in a thread of the node process, on a socket bound before it starts (so a busy port fails fast)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from shardline.api.app import build_app
from shardline.api.service import Service

# Longer than any common client's pool expiry (httpx 5 s, aiohttp 15 s, undici 4 s), so the client closes
# an idle connection first. With uvicorn's 5 s default, a client reusing a connection idle ~5 s races the
# server's close and gets a reset for a request the node never read.
KEEP_ALIVE_S = 75


class ApiServer:
    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((settings.host, settings.port))
        except OSError as exc:
            self._sock.close()
            raise OSError(
                f"HTTP API cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
            ) from exc
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        host = f"[{settings.host}]" if family == socket.AF_INET6 else settings.host
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            build_app(service),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="api-http")

    def _serve(self) -> None:
        self._server.run(sockets=[self._sock])

    def start(self) -> ApiServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
