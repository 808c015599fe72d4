"""Runner output -> typed diagnostics, the rotating runner log, and the pump that ties them together."""

from __future__ import annotations

import logging
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from shardline.dataplane.diagnostics import (
    DIAGNOSTICS,
    Diagnostic,
    OutOfMemory,
    PythonMemoryError,
    PythonTraceback,
    Unknown,
    parse_diagnostic,
)
from shardline.node.classify import LineClassifier, classify_line
from shardline.node.logs import RotatingLog, pump_stream

pytestmark = pytest.mark.timeout(60)

METAL_OOM = (
    "libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer "
    "execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
)

TRACEBACK = """\
Traceback (most recent call last):
  File "/opt/shardline/src/shardline/runner/process.py", line 287, in main
    runner.serve()
  File "/opt/shardline/src/shardline/runner/process.py", line 160, in serve
    self.step(message)
  File "/opt/shardline/src/shardline/runner/process.py", line 201, in step
    out = self.shard(hidden, cache)
          ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/shardline/src/shardline/compute/shard.py", line 88, in __call__
    h = layer(h, mask, cache[i])
        ^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/shardline/.venv/lib/python3.11/site-packages/mlx_lm/models/llama.py", line 120, in __call__
    r = self.self_attn(self.input_layernorm(x), mask, cache)
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/shardline/.venv/lib/python3.11/site-packages/mlx_lm/models/llama.py", line 71, in __call__
    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
ValueError: [reshape] Cannot reshape array of size 4096 into shape (1,8,32,-1).
"""


def feed_all(text: str, **kw: Any) -> list[Diagnostic]:
    classifier = LineClassifier(slot=1, clock=lambda: 123.0, **kw)
    out = [d for line in text.splitlines() for d in classifier.feed(line)]
    return out + classifier.flush()


@pytest.mark.parametrize(
    ("line", "kind", "fatal", "fields"),
    [
        ("[ring] Too many send/recv errors. Aborting...", "ring_abort", True, {"backend": "ring"}),
        ("[ring] Couldn't connect (error: 111)", "ring_abort", True, {}),
        ("[jaccl] Failed to open the RDMA device", "ring_abort", True, {"backend": "jaccl"}),
        (
            "[ring] Receiving from socket 51 failed with errno 54",
            "socket_error",
            False,
            {"errno": 54, "source": "ring"},
        ),
        ("ConnectionResetError: [Errno 104] Connection reset by peer", "socket_error", False, {"errno": 104}),
        ("BrokenPipeError: [Errno 32] Broken pipe", "socket_error", False, {"errno": 32}),
        ("ConnectionRefusedError: [Errno 111] Connection refused", "socket_error", False, {"errno": 111}),
        ("send: Connection reset by peer (errno 104)", "socket_error", False, {"errno": 104}),
        ("write failed: Broken pipe", "socket_error", False, {"errno": None, "reason": "Broken pipe"}),
        (
            "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
            "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)",
            "gpu_timeout",
            True,
            {},
        ),
        (METAL_OOM, "out_of_memory", True, {"backend": "metal"}),
        (
            "RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory "
            "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
            "out_of_memory",
            True,
            {"backend": "metal"},
        ),
        (
            "[metal::malloc] Attempting to allocate 18253611008 bytes which is greater than the maximum "
            "allowed buffer size of 17179869184 bytes.",
            "out_of_memory",
            True,
            {"backend": "metal"},
        ),
        ("RuntimeError: CUDA error: out of memory", "out_of_memory", True, {"backend": "cuda"}),
        (
            "terminate called after throwing an instance of 'std::bad_alloc'",
            "out_of_memory",
            True,
            {"backend": "cpu"},
        ),
        (
            "[METAL] Command buffer execution failed: Caused GPU Address Fault Error "
            "(0000000b:kIOGPUCommandBufferCallbackErrorPageFault)",
            "gpu_error",
            True,
            {"code": "kIOGPUCommandBufferCallbackErrorPageFault"},
        ),
        ("MemoryError", "memory_error", True, {"message": ""}),
        ("MemoryError: cannot allocate 8 GiB", "memory_error", True, {"message": "cannot allocate 8 GiB"}),
        (
            "2025-01-07T10:00:00.123456Z ERROR ThreadId(05) zenoh_transport::unicast::universal::link: "
            "Unable to send: Connection reset by peer (os error 104)",
            "zenoh_error",
            False,
            {"target": "zenoh_transport::unicast::universal::link", "errno": 104},
        ),
        ("zenoh.ZError: Unable to connect to tcp/10.0.0.2:7447", "zenoh_error", False, {}),
        (
            "shardline runner stage 2 failed (deadline): DeadlineExceeded: no step from stage 1 in 30.0s",
            "runner_exit",
            True,
            {"slot": 2, "reason": "deadline", "message": "DeadlineExceeded: no step from stage 1 in 30.0s"},
        ),
        ("Segmentation fault (core dumped)", "unknown", False, {"severity": "error"}),
        ("FileNotFoundError: [Errno 2] No such file or directory: 'w.gguf'", "unknown", False, {}),
        (
            "/opt/x.py:12: UserWarning: the tokenizer has no chat template",
            "unknown",
            False,
            {"severity": "warning"},
        ),
    ],
)
def test_single_line_patterns(line: str, kind: str, fatal: bool, fields: dict[str, Any]) -> None:
    found = classify_line(line, slot=1, at=5.0)
    assert found is not None
    assert (found.kind, found.fatal, found.line, found.at) == (kind, fatal, line, 5.0)
    assert found.slot == fields.get("slot", 1)
    for name, value in fields.items():
        assert getattr(found, name) == value, name
    assert feed_all(line)[0].kind == kind  # the incremental classifier agrees


@pytest.mark.parametrize(
    "line",
    [
        "",
        "INFO loading model from /models/llama",
        "2025-01-07 10:00:00,123 INFO shardline.engine: instance a1 ready",
        "INFO:shardline.runner:stage 1 loaded layers 8-15 (1.2 GiB)",
        "stage 1 ready: layers 0-11, 1.2 GiB",
        "prefill 2048 tokens in 0.81s (2528 tok/s)",
        "Fetching 4 files: 100%|██████████| 4/4 [00:00<00:00, 41.2it/s]",
        "2025-01-07T10:00:00.123456Z  INFO ThreadId(02) zenoh::net::runtime: Using ZID: 5e1a",
        "DEBUG send/recv error_count=0",
        "heartbeat steps=12 busy=False 0 errors",
    ],
)
def test_benign_lines_produce_nothing(line: str) -> None:
    assert classify_line(line) is None
    assert feed_all(line) == []


def test_full_traceback_is_one_diagnostic_at_its_last_line() -> None:
    classifier = LineClassifier(slot=1, clock=lambda: 7.0, max_frames=3)
    lines = TRACEBACK.splitlines()
    for line in lines[:-1]:
        assert classifier.feed(line) == []  # buffered until the exception line
    [found] = classifier.feed(lines[-1])
    assert classifier.flush() == []
    assert isinstance(found, PythonTraceback)
    assert found.fatal and found.slot == 1 and found.at == 7.0
    assert found.exc_type == "ValueError"
    assert found.message == "[reshape] Cannot reshape array of size 4096 into shape (1,8,32,-1)."
    assert found.line == lines[-1]
    assert len(found.frames) == 3 and found.frames[-1].endswith('llama.py", line 71, in __call__')
    assert found.evidence[0] == "Traceback (most recent call last):" and found.evidence[-1] == lines[-1]


def test_traceback_from_python_itself() -> None:
    def inner() -> None:
        raise KeyError("missing-layer")

    try:
        inner()
    except KeyError as exc:
        text = "".join(traceback.format_exception(exc))
    [found] = feed_all(text)
    assert isinstance(found, PythonTraceback)
    assert (found.exc_type, found.message) == ("KeyError", "'missing-layer'")
    assert "in inner" in found.frames[-1]


def test_traceback_ending_in_oom_is_out_of_memory_with_traceback_evidence() -> None:
    text = TRACEBACK.replace(TRACEBACK.splitlines()[-1], "RuntimeError: " + METAL_OOM.split(": ", 2)[2])
    [found] = feed_all(text)
    assert isinstance(found, OutOfMemory) and found.fatal and found.backend == "metal"
    assert found.evidence[0] == "Traceback (most recent call last):"


def test_uncaught_socket_error_traceback_is_fatal() -> None:
    text = TRACEBACK.replace(
        TRACEBACK.splitlines()[-1], "ConnectionResetError: [Errno 104] Connection reset by peer"
    )
    [found] = feed_all(text)
    assert found.kind == "socket_error" and found.fatal  # alone it is not; uncaught, the runner is gone


def test_traceback_ending_in_memory_error() -> None:
    [found] = feed_all(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nMemoryError\n'
    )
    assert isinstance(found, PythonMemoryError) and found.fatal


def test_chained_tracebacks_carry_their_cause() -> None:
    try:
        try:
            {}["k"]
        except KeyError as exc:
            raise RuntimeError("while loading") from exc
    except RuntimeError as exc:
        text = "".join(traceback.format_exception(exc))
    first, second = feed_all(text)
    assert isinstance(first, PythonTraceback) and first.exc_type == "KeyError" and first.cause is None
    assert isinstance(second, PythonTraceback) and second.exc_type == "RuntimeError"
    assert second.cause == "KeyError: 'k'"


def test_logged_exception_is_not_fatal() -> None:
    text = "2025-01-07 10:00:00,123 ERROR shardline.engine: dropped bad message\n" + TRACEBACK
    logged, found = feed_all(text)
    assert isinstance(logged, Unknown) and logged.severity == "error"
    assert isinstance(found, PythonTraceback) and not found.fatal


def test_exception_group() -> None:
    try:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("a"), MemoryError("b")])
    except ExceptionGroup as exc:
        text = "".join(traceback.format_exception(exc))
    [found] = feed_all(text + "after the group\n")
    assert isinstance(found, PythonMemoryError) and found.fatal  # the most specific sub-exception wins

    try:
        raise ExceptionGroup("two", [ValueError("a"), TypeError("b")])
    except ExceptionGroup as exc:
        text = "".join(traceback.format_exception(exc))
    [found] = feed_all(text)
    assert isinstance(found, PythonTraceback) and found.exc_type == "ExceptionGroup"
    assert found.sub_exceptions == ["ValueError: a", "TypeError: b"]


def test_interleaved_line_does_not_end_a_traceback() -> None:
    lines = TRACEBACK.splitlines()
    text = "\n".join([*lines[:3], "[ring] Too many send/recv errors. Aborting...", *lines[3:]])
    ring, found = feed_all(text)
    assert ring.kind == "ring_abort"
    assert isinstance(found, PythonTraceback) and found.exc_type == "ValueError"


def test_flush_reports_a_cut_off_traceback() -> None:
    [found] = feed_all("\n".join(TRACEBACK.splitlines()[:5]))
    assert isinstance(found, PythonTraceback) and found.fatal and found.exc_type == ""


def test_unknown_keeps_the_lines_before_it() -> None:
    text = "\n".join([f"step {i}" for i in range(10)] + ["something odd: fatal condition"])
    [found] = feed_all(text, context_lines=3)
    assert isinstance(found, Unknown)
    assert found.evidence == ["step 7", "step 8", "step 9", "something odd: fatal condition"]


def test_diagnostic_with_unknown_fields_and_kinds_deserialises() -> None:
    newer = (
        b'{"kind": "ring_abort", "slot": 3, "at": 1.5, "fatal": true, "line": "x", '
        b'"peer_rank": 2, "link": {"rtt_ms": 0.3}}'
    )
    found = DIAGNOSTICS.validate_json(newer)
    assert found.kind == "ring_abort" and found.slot == 3
    assert found.model_extra == {"peer_rank": 2, "link": {"rtt_ms": 0.3}}
    assert b'"peer_rank":2' in DIAGNOSTICS.dump_json(found)  # forwarded intact

    future = parse_diagnostic(b'{"kind": "thermal_throttle", "slot": 1, "fatal": true, "celsius": 105}')
    assert isinstance(future, Unknown)
    assert (future.original_kind, future.fatal, future.slot) == ("thermal_throttle", True, 1)
    bad_field = parse_diagnostic(b'{"kind": "socket_error", "errno": "not a number", "slot": 0}')
    assert isinstance(bad_field, Unknown) and bad_field.original_kind == "socket_error"
    with pytest.raises(ValueError):
        parse_diagnostic(b"[1, 2]")


# ---- logs and the pump ---------------------------------------------------------------------------------


def run_pumped(code: str, log: RotatingLog, on_diagnostic: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        thread = pump_stream(proc.stdout, 2, log, None, on_diagnostic)
        thread.join(timeout=30)
        assert not thread.is_alive(), "pump did not reach EOF"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_pump_on_a_real_runner_process(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "print('INFO stage 2 loading', flush=True)\n"
        "def load():\n"
        "    raise ValueError('bad shard header')\n"
        "load()\n"
    )
    got: list[Diagnostic] = []
    with RotatingLog(tmp_path / "stage2.log") as log:
        run_pumped(code, log, got.append)
        assert log.tail(1) == ["ValueError: bad shard header"]
    [found] = got
    assert isinstance(found, PythonTraceback)
    assert (found.slot, found.exc_type, found.message, found.fatal) == (
        2,
        "ValueError",
        "bad shard header",
        True,
    )
    text = (tmp_path / "stage2.log").read_text()
    assert "INFO stage 2 loading\n" in text and "Traceback (most recent call last):" in text
    assert text.endswith("ValueError: bad shard header\n")


def test_pump_survives_a_raising_callback_and_bad_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = (
        "import sys\n"
        "out = sys.stdout.buffer\n"
        "out.write(b'MemoryError\\n')\n"
        "out.write(b'\\xff\\xfe\\x80 undecodable\\n')\n"
        "out.write(b'[ring] Too many send/recv errors. Aborting...\\n')\n"
    )
    calls: list[Diagnostic] = []

    def callback(diagnostic: Diagnostic) -> None:
        calls.append(diagnostic)
        if len(calls) == 1:
            raise RuntimeError("callback bug")

    with (
        caplog.at_level(logging.ERROR, logger="shardline.node"),
        RotatingLog(tmp_path / "s.log") as log,
    ):
        run_pumped(code, log, callback)
    assert [d.kind for d in calls] == ["memory_error", "ring_abort"]
    assert "on_diagnostic failed" in caplog.text
    lines = (tmp_path / "s.log").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "MemoryError" and lines[1].endswith(" undecodable") and "\ufffd" in lines[1]
    assert lines[2].startswith("[ring]")


def test_pump_survives_a_classifier_bug(tmp_path: Path) -> None:
    class Broken(LineClassifier):
        def feed(self, line: str) -> list[Diagnostic]:
            if "boom" in line:
                raise RuntimeError("classifier bug")
            return super().feed(line)

    code = "print('boom'); print('MemoryError')"
    got: list[Diagnostic] = []
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    with RotatingLog(tmp_path / "b.log") as log:
        pump_stream(proc.stdout, 0, log, Broken(slot=0), got.append).join(timeout=30)
    proc.wait(timeout=30)
    assert [d.kind for d in got] == ["memory_error"]
    assert (tmp_path / "b.log").read_text() == "boom\nMemoryError\n"


@pytest.mark.parametrize("backups", [0, 1, 3])
def test_rotation_keeps_at_most_k_old_files(tmp_path: Path, backups: int) -> None:
    path = tmp_path / "r.log"
    with RotatingLog(path, max_bytes=64, backups=backups, recent=5) as log:
        for i in range(200):
            log.write_line(f"line {i:03d}")  # 9 bytes each: 7 lines per file
        files = log.files()
        assert log.tail(2) == ["line 198", "line 199"]
    assert sorted(tmp_path.iterdir()) == sorted(files)
    assert len(files) == backups + 1
    assert all(p.stat().st_size <= 64 for p in files)
    # Newest first, and nothing lost between consecutive files.
    numbers = [int(line.split()[1]) for p in reversed(files) for line in p.read_text().splitlines()]
    assert numbers == list(range(numbers[0], 200))


def test_log_appends_to_a_previous_runs_file(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("x" * 60 + "\n")
    with RotatingLog(path, max_bytes=64, backups=1) as log:
        log.write_line("next")
    assert (tmp_path / "a.log.1").read_text() == "x" * 60 + "\n"
    assert path.read_text() == "next\n"
