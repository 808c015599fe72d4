"""Errors a caller of any role sees; each says what happened in one line."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The instance could not start, has failed, or is shut down."""


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context."""


class RequestTooLargeError(ValueError):
    """The request cannot travel to the instance in one message: refused before it is sent."""


class OverloadError(RuntimeError):
    """Too many requests wait already: try again later (HTTP maps this to 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(RuntimeError):
    """The request could not be completed; the message says why."""
