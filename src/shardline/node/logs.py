"""A runner's output: kept on disk with size-based rotation, and read line by line into diagnostics.

The pump must keep draining the pipe whatever happens (a runner blocked on a full pipe looks exactly like a
stalled runner), so no bad byte, classifier bug, disk error or callback exception ever stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

from shardline.dataplane.diagnostics import Diagnostic
from shardline.node.classify import LineClassifier

_log = logging.getLogger("shardline.node")

MAX_LINE_BYTES = 64 * 1024  # a longer line (a printed tensor) is split rather than buffered whole


class RotatingLog:
    """Append-only text log of one runner; at `max_bytes` the file becomes `<path>.1`, `.1` becomes `.2`, ...
    and at most `backups` old files are kept. Thread-safe; keeps the last `recent` lines in memory for `tail`.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_bytes: int = 16 << 20, backups: int = 3, recent: int = 200
    ) -> None:
        if max_bytes <= 0 or backups < 0:
            raise ValueError("max_bytes must be positive and backups non-negative")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._recent: deque[str] = deque(maxlen=recent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - lives as long as the log
        self._size = self._file.tell()  # appending to a previous run's file counts its bytes too

    def write_line(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8", errors="replace")
        with self._lock:
            self._recent.append(line.rstrip("\n"))
            if self._file is None:
                return  # closed: still remembered for tail(), nowhere to write
            if self._size > 0 and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._file.flush()  # a runner may die any moment; what it said must already be on disk
            self._size += len(data)

    def tail(self, n: int = 20) -> list[str]:
        """The last n lines written (from memory: no disk read, works after rotation)."""
        with self._lock:
            return list(self._recent)[-n:] if n > 0 else []

    def files(self) -> list[Path]:
        """Existing log files, newest first."""
        candidates = [self.path, *(self._backup(i) for i in range(1, self.backups + 1))]
        return [p for p in candidates if p.exists()]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> RotatingLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _backup(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None  # if reopening fails, later lines only reach tail()
        try:
            if self.backups == 0:
                self.path.unlink(missing_ok=True)
            else:
                self._backup(self.backups).unlink(missing_ok=True)
                for i in range(self.backups - 1, 0, -1):
                    if self._backup(i).exists():
                        os.replace(self._backup(i), self._backup(i + 1))
                os.replace(self.path, self._backup(1))
        finally:
            self._file = open(self.path, "ab")  # noqa: SIM115
            self._size = self._file.tell()


OnDiagnostic = Callable[[Diagnostic], object]


def drain_stream(
    stream: IO[bytes],
    slot: int | None,
    log: RotatingLog | None,
    classifier: LineClassifier | None = None,
    on_diagnostic: OnDiagnostic | None = None,
    *,
    max_line: int = MAX_LINE_BYTES,
) -> None:
    """Read `stream` to EOF in this thread: log every line, report every diagnostic; then close `stream`."""
    classifier = classifier if classifier is not None else LineClassifier(slot=slot)
    try:
        while True:
            try:
                raw = stream.readline(max_line)
            except (OSError, ValueError):  # closed under us, or the fd went away: nothing more to read
                _log.warning("stage %s: output stream failed", slot, exc_info=True)
                break
            if not raw:
                break
            text = raw if isinstance(raw, str) else raw.decode("utf-8", errors="replace")
            text = text.rstrip("\n").rstrip("\r")
            if log is not None:
                try:
                    log.write_line(text)
                except Exception:  # disk full, permissions: lose the log line, keep draining
                    _log.exception("stage %s: could not write runner log", slot)
            # Progress bars redraw with '\r': each redraw is a line of its own for the classifier.
            for segment in text.split("\r"):
                if segment:
                    _deliver(slot, _classify(classifier.feed, segment, slot), on_diagnostic)
    finally:
        _deliver(slot, _classify(lambda _: classifier.flush(), "", slot), on_diagnostic)
        with contextlib.suppress(Exception):
            stream.close()


def pump_stream(
    stream: IO[bytes],
    slot: int | None,
    log: RotatingLog | None,
    classifier: LineClassifier | None = None,
    on_diagnostic: OnDiagnostic | None = None,
    *,
    max_line: int = MAX_LINE_BYTES,
) -> threading.Thread:
    """`drain_stream` in a started daemon thread; join it after the runner exits for the last diagnostics."""
    thread = threading.Thread(
        target=drain_stream,
        args=(stream, slot, log, classifier, on_diagnostic),
        kwargs={"max_line": max_line},
        name=f"shardline-pump-slot{slot}",
        daemon=True,  # never keeps the node agent alive; the runner's exit closes the pipe anyway
    )
    thread.start()
    return thread


def _classify(step: Callable[[str], list[Diagnostic]], line: str, slot: int | None) -> list[Diagnostic]:
    try:
        return step(line)
    except Exception:  # a classifier bug must cost one line's diagnosis, not the pump
        _log.exception("stage %s: classifier failed on %r", slot, line[:200])
        return []


def _deliver(slot: int | None, diagnostics: list[Diagnostic], on_diagnostic: OnDiagnostic | None) -> None:
    for diagnostic in diagnostics:
        if diagnostic.slot is None and slot is not None:
            diagnostic = diagnostic.model_copy(update={"slot": slot})
        if on_diagnostic is None:
            continue
        try:
            on_diagnostic(diagnostic)
        except Exception:
            _log.exception("stage %s: on_diagnostic failed for a %s diagnostic", slot, diagnostic.kind)
