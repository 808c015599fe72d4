"""The HTTP application of a node: every API's routes, one error convention per API, key, CORS, metrics;
the Host check and the body limit in front of them all."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import shardline
from shardline.api.errors import ApiError, body, flavor_of, headers
from shardline.api.middleware.api_key import carries_key
from shardline.api.middleware.body_limit import BodyLimit
from shardline.api.middleware.hosts import HostCheck, trusted_hosts
from shardline.api.middleware.ollama import OllamaEntrance, is_json_type
from shardline.api.routes import anthropic as anthropic_api
from shardline.api.routes import cluster as cluster_api
from shardline.api.routes import dashboard
from shardline.api.routes import ollama as ollama_api
from shardline.api.routes import openai as openai_api
from shardline.api.routes import openai_responses as responses_api
from shardline.api.service import Service
from shardline.api.streaming import ClientGone

log = logging.getLogger("shardline.api")

OPEN_PATHS = ("/health",)  # answered without the API key: a load balancer's probe carries none


def _error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(body(error, flavor_of(request.url.path)), error.status, headers=headers(error))


def _validation_message(
    exc: RequestValidationError, content_type: str | None = None
) -> tuple[str, str | None]:
    """The 400's message and the parameter it names. `content_type`: the request's; a body not labelled
    JSON is not parsed at all, and then that is what to say, not that the unparsed text is no object."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("loc", ())[:1] == ("body",) and not is_json_type(content_type):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return f"the body must be JSON, sent with Content-Type: application/json (this one has {got})", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (
        f"{where}: {first.get('msg', 'invalid')}{more}" if where else f"{first.get('msg')}{more}"
    ), where or None


def build_app(service: Service) -> FastAPI:
    settings = service.settings
    app = FastAPI(
        title="shardline",
        version=shardline.__version__,
        description="OpenAI-, Anthropic- and Ollama-compatible serving of a model split across a cluster.",
    )
    for module in (openai_api, responses_api, anthropic_api, ollama_api, cluster_api):
        app.include_router(module.router(service))
    dashboard.mount(app)

    @app.get(
        "/metrics",
        tags=["Cluster"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type"))
        service.metrics.requests.labels(request.url.path, "invalid").inc()
        return _error(request, ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(request, ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left, its request was cancelled

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text may hold paths, addresses, model internals: it goes to the log only, under an
        # id the client is given to quote.
        rid = uuid.uuid4().hex[:16]
        log.error("internal error %s on %s %s", rid, request.method, request.url.path, exc_info=exc)
        message = f"internal error (request id {rid}: the node's log has the details)"
        response = _error(request, ApiError(500, message, "server_error"))
        response.headers["X-Request-Id"] = rid
        return response

    # Innermost (added first), right around the routes: the key check below is a BaseHTTPMiddleware, whose
    # receive runs in a task group, which would hand the routes the limit's 413 wrapped in an ExceptionGroup.
    app.add_middleware(BodyLimit)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        key = settings.api_key
        path = request.url.path
        open_path = path in OPEN_PATHS or dashboard.is_open(path)
        if key and request.method != "OPTIONS" and not open_path:  # noqa: SIM102
            if not carries_key(request, key):
                denied = ApiError(
                    401, "a valid API key is required", "authentication_error", code="invalid_api_key"
                )
                return _error(request, denied)
        return await call_next(request)

    # Inside CORS (which answers preflights), outside the key check: see middleware/ollama.py.
    app.add_middleware(OllamaEntrance, allowed_origins=settings.cors_origins)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in settings.cors_origins,
        )
    hosts = trusted_hosts(settings.host, settings.api_key, settings.allowed_hosts)
    if hosts is not None:  # outermost: a request to a foreign name gets nothing else
        app.add_middleware(HostCheck, allowed=hosts)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's spec, told the truth: invalid input is a 400 in the route's own error shape, never a 422."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path in spec.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            invalid = responses.pop("422", None)
            if invalid is not None and "400" not in responses:
                responses["400"] = invalid
    schemas = spec.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    spec.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    spec["security"] = [{}, {"bearer": []}, {"apiKey": []}]  # only when the node is started with a key
    app.openapi_schema = spec
    return spec
