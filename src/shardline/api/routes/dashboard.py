"""The dashboard: static files with no build step, served by every node at / (the page) and /ui/ (its parts).

They hold no data, so they are served without the API key; the page asks for the key and sends it with every
call it makes. Nothing is loaded from elsewhere: the policy below forbids it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).parent.parent / "web"
PREFIX = "/ui"
POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def is_open(path: str) -> bool:
    return path == "/" or path.startswith(PREFIX + "/")


def mount(app: FastAPI) -> None:
    app.mount(PREFIX, StaticFiles(directory=WEB), name="ui")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB / "index.html", headers={"Content-Security-Policy": POLICY})
