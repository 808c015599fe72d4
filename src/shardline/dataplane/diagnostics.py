"""Typed diagnostics a node agent derives from a runner's output, one tagged union on discriminator `kind`.

Every model accepts (and keeps, for forwarding) fields it does not know: an older receiver must never reject a
newer sender's diagnostic. `parse_diagnostic` goes further and degrades an unknown `kind` to `unknown`.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_EVIDENCE_LINES = 16  # evidence travels over the network: keep it to a screenful
MAX_LINE_CHARS = 1000


def clip(line: str, limit: int = MAX_LINE_CHARS) -> str:
    """One evidence line, bounded: runners sometimes print whole tensors on one line."""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class DiagnosticBase(BaseModel):
    # extra="allow" rather than "ignore": a node that relays a newer peer's diagnostic passes its fields on.
    # Infinite floats are written as JSON constants so they survive the round trip instead of becoming null.
    model_config = ConfigDict(extra="allow", frozen=True, ser_json_inf_nan="constants")

    slot: int | None = None  # the runner's (RunnerSpec.slot) whose output it was read from
    at: float = Field(default_factory=time.time)  # unix time the node agent saw it
    fatal: bool = False  # the runner can no longer be trusted and must be replaced
    line: str = ""  # the line that triggered the diagnostic
    evidence: list[str] = []  # the triggering line with the lines around it


class RingAbort(DiagnosticBase):
    """The MLX ring (or jaccl) transport gave up; collectives on it will never complete."""

    kind: Literal["ring_abort"] = "ring_abort"
    fatal: bool = True
    backend: str = "ring"


class SocketError(DiagnosticBase):
    """A socket-level failure; not fatal by itself, but usually the precursor of a transport abort."""

    kind: Literal["socket_error"] = "socket_error"
    errno: int | None = None
    reason: str = ""  # the matched phrase, or strerror(errno)
    source: str | None = None  # e.g. "ring" for MLX ring send/recv lines


class GpuTimeout(DiagnosticBase):
    kind: Literal["gpu_timeout"] = "gpu_timeout"
    fatal: bool = True


class GpuError(DiagnosticBase):
    """Any other failed GPU command buffer (page fault, device lost, ...)."""

    kind: Literal["gpu_error"] = "gpu_error"
    fatal: bool = True
    code: str | None = None  # e.g. kIOGPUCommandBufferCallbackErrorPageFault


class OutOfMemory(DiagnosticBase):
    kind: Literal["out_of_memory"] = "out_of_memory"
    fatal: bool = True
    backend: str | None = None  # "metal", "cuda", "cpu" or None when the line does not say


class PythonMemoryError(DiagnosticBase):
    kind: Literal["memory_error"] = "memory_error"
    fatal: bool = True
    message: str = ""


class PythonTraceback(DiagnosticBase):
    """A whole traceback; fatal unless a handler printed it (logging.exception, 'Exception ignored in')."""

    kind: Literal["python_traceback"] = "python_traceback"
    fatal: bool = True
    exc_type: str
    message: str = ""
    frames: list[str] = []  # the last few 'File "...", line N, in f' lines, innermost last
    cause: str | None = None  # the exception line this one was raised while handling (chained tracebacks)
    sub_exceptions: list[str] = []  # for exception groups


class ZenohError(DiagnosticBase):
    kind: Literal["zenoh_error"] = "zenoh_error"
    target: str | None = None  # the Rust module path, e.g. zenoh_transport::unicast
    errno: int | None = None


class RunnerExit(DiagnosticBase):
    """The runner's own last words: it is exiting with a typed reason."""

    kind: Literal["runner_exit"] = "runner_exit"
    fatal: bool = True
    reason: str = ""
    message: str = ""


class Unknown(DiagnosticBase):
    """A line that looks like trouble but matches no pattern, or a diagnostic of a kind we don't know."""

    kind: Literal["unknown"] = "unknown"
    severity: Literal["error", "warning"] = "error"
    original_kind: str | None = None  # set when a newer peer sent a kind this version does not know


Diagnostic = Annotated[
    RingAbort
    | SocketError
    | GpuTimeout
    | GpuError
    | OutOfMemory
    | PythonMemoryError
    | PythonTraceback
    | ZenohError
    | RunnerExit
    | Unknown,
    Field(discriminator="kind"),
]
# The adapter's own config governs DIAGNOSTICS.dump_json (the models' config only their model_dump_json).
DIAGNOSTICS: TypeAdapter[Diagnostic] = TypeAdapter(
    Diagnostic, config=ConfigDict(ser_json_inf_nan="constants")
)

_COMMON = ("slot", "at", "fatal", "line", "evidence")


def parse_diagnostic(data: str | bytes) -> Diagnostic:
    """Validate a diagnostic; one whose kind or fields this version cannot read becomes `unknown` instead.

    Raises ValueError only when `data` is not a JSON object with a string `kind`.
    """
    try:
        return DIAGNOSTICS.validate_json(data)
    except ValidationError as exc:
        original = exc
    raw: Any = json.loads(data)
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        raise original
    kind = raw["kind"]
    rest = {k: v for k, v in raw.items() if k not in ("kind", "severity", "original_kind")}
    # Widest first: keep everything (as extras) if the common fields are readable, else only what validates.
    for fields in (rest, {k: rest[k] for k in _COMMON if k in rest}):
        try:
            return Unknown.model_validate({**fields, "original_kind": kind})
        except ValidationError:
            continue
    return Unknown(original_kind=kind, fatal=raw.get("fatal") is True, evidence=[clip(json.dumps(raw))])
