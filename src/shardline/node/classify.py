"""Turn a runner's output lines into typed diagnostics.

Single-line patterns live in `RULES`, most specific first: adding a pattern is adding a table entry. The only
state is the traceback being read (Python prints one over many lines) and a few lines of context for evidence.
Ordinary lines produce nothing; a line that looks like an error or warning but matches no rule is `unknown`.
"""

from __future__ import annotations

import errno as errno_codes
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardline.dataplane.diagnostics import (
    MAX_EVIDENCE_LINES,
    Diagnostic,
    DiagnosticBase,
    GpuError,
    GpuTimeout,
    OutOfMemory,
    PythonMemoryError,
    PythonTraceback,
    RingAbort,
    RunnerExit,
    SocketError,
    Unknown,
    ZenohError,
    clip,
)

Fields = Callable[[re.Match[str]], dict[str, Any] | None]


def _no_fields(_: re.Match[str]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Rule:
    """A line matching `pattern` (re.search) becomes `model`; `fields` adds fields, or vetoes with None."""

    model: type[DiagnosticBase]
    pattern: re.Pattern[str]
    fields: Fields = _no_fields


# Socket errnos of this platform (the runner runs on its node agent's machine): numbers differ between Linux
# and macOS (ECONNRESET is 104 vs 54), so no number is hard-coded.
_SOCKET_ERRNOS = {
    getattr(errno_codes, name)
    for name in (
        "EPIPE", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH",
        "ENETDOWN", "ENOTCONN", "EADDRINUSE", "EADDRNOTAVAIL", "EHOSTDOWN", "ESHUTDOWN",
    )
    if hasattr(errno_codes, name)
}  # fmt: skip
_ERRNO = re.compile(r"\[Errno (\d+)\]|\berrno[\s=:]*(\d+)|\bos error (\d+)|\(error: (\d+)\)", re.IGNORECASE)
_SOCKET_PHRASE = re.compile(
    r"connection reset by peer|broken pipe|connection refused|connection aborted|network is unreachable|"
    r"no route to host|transport endpoint is not connected|address already in use|"
    r"\b(?:ECONNRESET|EPIPE|ECONNREFUSED|ECONNABORTED|EHOSTUNREACH|ENETUNREACH|ENOTCONN)\b",
    re.IGNORECASE,
)


def _errno_in(line: str) -> int | None:
    m = _ERRNO.search(line)
    return int(next(g for g in m.groups() if g is not None)) if m else None


def _socket_fields(m: re.Match[str]) -> dict[str, Any] | None:
    line = m.string
    number = _errno_in(line)
    phrase = _SOCKET_PHRASE.search(line)
    if phrase is None and number not in _SOCKET_ERRNOS:
        return None  # "[Errno 2] No such file or directory" is not a socket error
    reason = phrase.group(0) if phrase else os.strerror(number) if number is not None else ""
    return {"errno": number, "reason": reason}


def _ring_socket_fields(m: re.Match[str]) -> dict[str, Any]:
    number = int(m.group(2))
    return {"errno": number, "reason": os.strerror(number), "source": m.group(1).lower()}


def _zenoh_fields(m: re.Match[str]) -> dict[str, Any]:
    target = re.search(r"\b(zenoh\w*(?:::\w+)*)", m.string)
    return {"target": target.group(1) if target else None, "errno": _errno_in(m.string)}


def _gpu_fields(m: re.Match[str]) -> dict[str, Any]:
    code = re.search(r"kIOGPU\w+", m.string)
    return {"code": code.group(0) if code else None}


def _const(**values: Any) -> Fields:
    return lambda _: values


RULES: tuple[Rule, ...] = (
    # The runner's own last words come first: whatever the cause, it is exiting.
    Rule(
        RunnerExit,
        re.compile(r"^shardline runner stage (\d+) failed \((\w+)\): (.*)$"),
        lambda m: {"slot": int(m.group(1)), "reason": m.group(2), "message": m.group(3)},
    ),
    Rule(RingAbort, re.compile(r"too many send/recv errors", re.IGNORECASE)),
    Rule(
        SocketError,
        re.compile(r"\[(ring|jaccl)\].*failed with errno (\d+)", re.IGNORECASE),
        _ring_socket_fields,
    ),
    Rule(
        RingAbort,
        re.compile(
            r"\[(ring|jaccl)\].*\b(?:error|fail\w*|couldn'?t|can(?:no|')t|unable|abort\w*)\b", re.IGNORECASE
        ),
        lambda m: {"backend": m.group(1).lower()},
    ),
    Rule(GpuTimeout, re.compile(r"GPU Timeout Error|kIOGPUCommandBufferCallbackErrorTimeout")),
    Rule(
        OutOfMemory,
        re.compile(
            r"Insufficient Memory|kIOGPUCommandBufferCallbackErrorOutOfMemory|\[metal::malloc\]|"
            r"maximum allowed buffer size"
        ),
        _const(backend="metal"),
    ),
    Rule(
        OutOfMemory,
        re.compile(
            r"CUDA (?:error: )?out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|"
            r"\[cuda::malloc\]"
        ),
        _const(backend="cuda"),
    ),
    Rule(OutOfMemory, re.compile(r"std::bad_alloc"), _const(backend="cpu")),
    Rule(OutOfMemory, re.compile(r"\bout of memory\b|\[malloc\] Unable to allocate", re.IGNORECASE)),
    Rule(
        GpuError,
        re.compile(r"\[METAL\] Command buffer execution failed|kIOGPUCommandBufferCallbackError\w+"),
        _gpu_fields,
    ),
    Rule(
        PythonMemoryError,
        re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*MemoryError(?::\s?(.*))?$"),
        lambda m: {"message": m.group(1) or ""},
    ),
    Rule(ZenohError, re.compile(r"\bZError\b|^(?=.*\bERROR\b)(?=.*\bzenoh)"), _zenoh_fields),
    # Phrases, or an errno that is a socket errno on this platform (_socket_fields vetoes the others).
    Rule(
        SocketError, re.compile(f"{_SOCKET_PHRASE.pattern}|{_ERRNO.pattern}", re.IGNORECASE), _socket_fields
    ),
)

# Lines that only announce a traceback, or chain two: they carry no diagnosis of their own.
_PRELUDE = re.compile(
    r"^(?:During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:"
    r"|Exception in thread .*:"
    r"|Exception ignored in: .*"
    r"|Task exception was never retrieved)\s*$"
)
_CHAIN = re.compile(r"^(?:During handling of the above|The above exception was the direct cause)")
_IGNORED = re.compile(r"^Exception ignored in")
_TB_HEADER = re.compile(r"^Traceback \(most recent call last\):\s*$")
_GROUP_HEADER = re.compile(r"^(\s*)\+ Exception Group Traceback \(most recent call last\):\s*$")
_GROUP_END = re.compile(r"^(\s*)\+-+\s*$")
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?P<colon>:\s?(?P<msg>.*))?$")
_EXC_NAME = re.compile(r"(?:Error|Exception|Interrupt|Exit|Warning|Iteration|Group)$")
_LEVEL_BENIGN = re.compile(r"(?:^|[\s\[:|])(?:INFO|DEBUG|TRACE|NOTICE)(?=[\]\s:|]|$)")
_LEVEL_ERROR = re.compile(r"(?:^|[\s\[:|])(?:ERROR|CRITICAL|EXCEPTION|WARNING|WARN)(?=[\]\s:|]|$)")
_TROUBLE = re.compile(
    r"\b\w*(?:error|exception)\b|\bfatal\b|\bpanic(?:ked)?\b|\babort(?:ed|ing)?\b|\bfail(?:ed|ure)?\b"
    r"|\bsegmentation fault\b|\bcore dumped\b|\bterminat\w+ (?:called|due)\b",
    re.IGNORECASE,
)
_WARNING = re.compile(r"\b\w*warn(?:ing)?\b", re.IGNORECASE)
_LEVEL_SPAN = 64  # a log record's level sits near the start, after the timestamp


def _exception_line(line: str) -> re.Match[str] | None:
    """ "ValueError: x", "pkg.mod.Failure", "KeyboardInterrupt". A bare word needs an exception-like name, so
    that stray output interleaved with a traceback ("Done") does not end it."""
    m = _EXC_LINE.match(line)
    if m and (m.group("colon") is not None or "." in m.group("type") or _EXC_NAME.search(m.group("type"))):
        return m
    return None


def _match_rules(line: str, slot: int | None, at: float) -> Diagnostic | None:
    for rule in RULES:
        m = rule.pattern.search(line)
        if m is None:
            continue
        extra = rule.fields(m)
        if extra is None:
            continue
        fields: dict[str, Any] = {"slot": slot, "at": at, "line": clip(line), "evidence": [clip(line)]}
        fields.update(extra)
        return rule.model(**fields)  # type: ignore[return-value]
    return None


def _severity(line: str) -> str | None:
    """'error' or 'warning' when an unmatched line looks like trouble; None for ordinary output."""
    if _LEVEL_BENIGN.search(line[:_LEVEL_SPAN]):
        return None
    if _TROUBLE.search(line):
        return "error"
    if _WARNING.search(line):
        return "warning"
    return None


def classify_line(line: str, slot: int | None = None, at: float | None = None) -> Diagnostic | None:
    """Classify one line on its own (no traceback assembly, no context)."""
    line = line.rstrip("\r\n")
    when = time.time() if at is None else at
    if _PRELUDE.match(line) or _TB_HEADER.match(line):
        return None
    found = _match_rules(line, slot, when)
    if found is not None:
        return found
    severity = _severity(line)
    if severity is None:
        return None
    return Unknown(slot=slot, at=when, line=clip(line), evidence=[clip(line)], severity=severity)


@dataclass
class _Traceback:
    header: str
    group_indent: int | None  # None for a plain traceback; the '+' column for an exception group
    handled: bool  # printed by a handler (logging.exception, 'Exception ignored in'): not fatal
    cause: str | None
    frames: deque[str]
    tail: deque[str]
    exc_lines: list[str] = field(default_factory=list)
    cut: bool = False  # the tail dropped lines


class LineClassifier:
    """Incremental classifier for one runner's merged stdout/stderr. Not thread-safe: one per stream."""

    def __init__(
        self,
        slot: int | None = None,
        *,
        clock: Callable[[], float] = time.time,
        context_lines: int = 4,
        max_frames: int = 5,
        evidence_lines: int = 12,
    ) -> None:
        self.slot = slot
        self._clock = clock
        self._context: deque[str] = deque(maxlen=context_lines)
        self._max_frames = max_frames
        self._evidence_lines = min(evidence_lines, MAX_EVIDENCE_LINES - 2)
        self._tb: _Traceback | None = None
        self._last_exc: str | None = None  # the last traceback's exception line, for chains
        self._last_handled = False
        self._chained = False  # a "During handling ..." line was seen since that traceback

    def feed(self, line: str) -> list[Diagnostic]:
        line = line.rstrip("\r\n")
        out = self._feed_traceback(line) if self._tb is not None else self._feed_plain(line)
        self._context.append(line)
        return out

    def flush(self) -> list[Diagnostic]:
        """End of stream: a traceback still being read is reported as it stands."""
        out = [self._finish(None)] if self._tb is not None else []
        self._last_exc, self._chained = None, False
        return out

    # ---- outside a traceback -------------------------------------------------------------------------

    def _feed_plain(self, line: str) -> list[Diagnostic]:
        if _CHAIN.match(line):
            self._chained = self._last_exc is not None
            return []
        group = _GROUP_HEADER.match(line)
        if group or _TB_HEADER.match(line):
            self._start(line, len(group.group(1)) if group else None)
            return []
        if line.strip():
            self._chained = False
        if _PRELUDE.match(line):
            return []
        found = self._single(line)
        return [found] if found is not None else []

    def _single(self, line: str) -> Diagnostic | None:
        found = _match_rules(line, self.slot, self._clock())
        if found is not None:
            if len(found.evidence) == 1:  # add the lines before it: they usually say what was going on
                found = found.model_copy(update={"evidence": [*map(clip, self._context), clip(line)]})
            return found
        severity = _severity(line)
        if severity is None:
            return None
        return Unknown(
            slot=self.slot,
            at=self._clock(),
            line=clip(line),
            evidence=[*map(clip, self._context), clip(line)],
            severity=severity,
        )

    def _start(self, header: str, group_indent: int | None) -> None:
        before = next((c for c in reversed(self._context) if c.strip()), "")
        handled = bool(_IGNORED.match(before) or _LEVEL_ERROR.search(before[:_LEVEL_SPAN]))
        if self._chained:  # the tail of a chain was printed by whoever printed its head
            handled = self._last_handled
        self._tb = _Traceback(
            header=header,
            group_indent=group_indent,
            handled=handled,
            cause=self._last_exc if self._chained else None,
            frames=deque(maxlen=self._max_frames),
            tail=deque(maxlen=self._evidence_lines),
        )
        self._chained = False

    # ---- inside a traceback --------------------------------------------------------------------------

    def _feed_traceback(self, line: str) -> list[Diagnostic]:
        tb = self._tb
        assert tb is not None
        if tb.group_indent is not None:
            return self._feed_group(tb, line)
        if not line.strip():
            return []
        if line[0].isspace():
            self._remember(tb, line, line.strip())
            return []
        if _exception_line(line):
            tb.exc_lines.append(line)
            self._remember(tb, line, None)
            return [self._finish(line)]
        # Output from another thread interleaved with the traceback: judge it alone, keep reading.
        found = self._single(line)
        return [found] if found is not None else []

    def _feed_group(self, tb: _Traceback, line: str) -> list[Diagnostic]:
        end = _GROUP_END.match(line)
        if end and len(end.group(1)) == (tb.group_indent or 0) + 2:
            self._remember(tb, line, None)
            return [self._finish(tb.exc_lines[0] if tb.exc_lines else None)]
        if line.strip() and not line[0].isspace():  # the group ended without its closing rule
            return [self._finish(tb.exc_lines[0] if tb.exc_lines else None), *self._feed_plain(line)]
        self._remember(tb, line, None)
        bar = re.match(r"^\s*\|\s?", line)
        if bar is None:
            return []  # separators like "+-+---- 1 ----"
        content = line[bar.end() :]
        is_exception = content and not content[0].isspace() and _exception_line(content)
        if is_exception and len(tb.exc_lines) < MAX_EVIDENCE_LINES:
            tb.exc_lines.append(content)
        elif content.strip().startswith('File "'):
            tb.frames.append(clip(content.strip()))
        return []

    def _remember(self, tb: _Traceback, line: str, frame: str | None) -> None:
        if len(tb.tail) == tb.tail.maxlen:
            tb.cut = True
        tb.tail.append(clip(line))
        if frame is not None and frame.startswith('File "'):
            tb.frames.append(clip(frame))

    def _finish(self, exc_line: str | None) -> Diagnostic:
        tb = self._tb
        assert tb is not None
        self._tb = None
        self._last_exc, self._last_handled = exc_line, tb.handled
        at = self._clock()
        evidence = [tb.header, *(["..."] if tb.cut else []), *tb.tail]
        uncaught = not tb.handled
        # A more specific diagnosis of the exception line wins (OOM, ring abort, ...); being uncaught makes it
        # fatal whatever it is.
        for candidate in tb.exc_lines:
            found = _match_rules(candidate, self.slot, at)
            if found is not None and not isinstance(found, RunnerExit):
                return found.model_copy(update={"fatal": found.fatal or uncaught, "evidence": evidence})
        m = _exception_line(exc_line) if exc_line is not None else None
        return PythonTraceback(
            slot=self.slot,
            at=at,
            fatal=uncaught,
            line=clip(exc_line or tb.header),
            evidence=evidence,
            exc_type=m.group("type") if m else "",
            message=clip(m.group("msg") or "") if m else "traceback cut off",
            frames=list(tb.frames),
            cause=clip(tb.cause) if tb.cause else None,
            sub_exceptions=[clip(x) for x in tb.exc_lines[1:]] if tb.group_indent is not None else [],
        )
