"""One error type for every API, written out in the shape of the API the request came through."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

Flavor = Literal["openai", "anthropic", "ollama"]


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported", "invalid_request_error", param, "unsupported_parameter")


# ---- the documented shapes (they are what the OpenAPI spec says each route answers on error) ---------------


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


class OllamaError(BaseModel):
    error: str


ERROR_MODELS: dict[Flavor, type[BaseModel]] = {
    "openai": OpenAIError,
    "anthropic": AnthropicError,
    "ollama": OllamaError,
}

# Anthropic names its error types by status.
_ANTHROPIC_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def flavor_of(path: str) -> Flavor:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def body(error: ApiError, flavor: Flavor) -> dict[str, Any]:
    if flavor == "anthropic":
        kind = _ANTHROPIC_KINDS.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    if flavor == "ollama":
        return {"error": error.message}
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def headers(error: ApiError) -> dict[str, str]:
    out = {}
    if error.retry_after_s is not None:
        out["Retry-After"] = str(max(1, round(error.retry_after_s)))
    if error.status == 401:
        out["WWW-Authenticate"] = "Bearer"
    return out


def error_responses(flavor: Flavor, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each status documented with the API's error shape."""
    model = ERROR_MODELS[flavor]
    return {s: {"model": model, "description": _DESCRIPTIONS.get(s, "error")} for s in statuses}


_DESCRIPTIONS = {
    400: "the request is malformed, has wrong types or values, or asks for something unsupported",
    401: "an API key is required and was missing or wrong",
    403: "from a web page of another origin (an Origin header not allowed), or to a host name not allowed",
    404: "no such model, instance or route",
    405: "method not allowed",
    413: "the request body is too large",
    429: "too many requests are waiting; retry after the Retry-After header's seconds",
    500: "an internal error",
    503: "the model cannot be served now (no instance and it cannot be placed, or the instance failed)",
}
