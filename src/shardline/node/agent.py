"""The node agent: starts and kills runner processes, pumps and classifies their output, reports exits.

It knows nothing of requests. Commands arrive on the agent key (StartRunner, StopGeneration); what it sees
goes back as typed status on the instance's reports key (RunnerStarted, RunnerExited with code, signal and
log tail, RunnerDiagnostic for fatal lines). One per machine; `shardline node` will host it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import zenoh

from shardline.dataplane import messages as m
from shardline.dataplane.transport import DeadlineExceeded, Inbox, Keys, Outbox
from shardline.node.launch import spawn_runner, stop_runners
from shardline.supervisor.classify import LineClassifier
from shardline.supervisor.diagnostics import Diagnostic
from shardline.supervisor.logs import RotatingLog, pump_stream

log = logging.getLogger("shardline.agent")
TAIL_LINES = 5
STOP_POLL_S = 0.25


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


@dataclass
class _Runner:
    spec: m.RunnerSpec
    proc: subprocess.Popen
    log: RotatingLog
    pump: threading.Thread


class NodeAgent:
    def __init__(self, session: zenoh.Session, instance: str, log_dir: Path) -> None:
        self.session = session
        self.keys = Keys(instance)
        self.log_dir = Path(log_dir)
        self._runners: dict[tuple[int, int], _Runner] = {}  # (generation, stage) -> runner
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._inbox = Inbox(session, name="agent")
        self._inbox.subscribe(self.keys.agent, m.AGENT, "agent")
        self._reports = Outbox(session, self.keys.reports)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="node-agent")

    def start(self) -> NodeAgent:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                env = self._inbox.get(timeout=0.2)
            except DeadlineExceeded:
                continue  # idle: the tick only notices close()
            try:
                if isinstance(env.message, m.StartRunner):
                    self._start(env.message)
                elif isinstance(env.message, m.StopGeneration):
                    self._stop(env.message.keep, env.message.grace_s)
            except Exception:  # one bad command must not end the agent
                log.exception("agent command %s failed", type(env.message).__name__)

    def _report(self, message: object) -> None:
        if self._closed.is_set():
            return  # shutting down: nobody judges these any more
        try:
            self._reports.send(message)
        except Exception as exc:
            log.warning("could not report %s: %s", type(message).__name__, exc)

    def _start(self, cmd: m.StartRunner) -> None:
        spec = cmd.spec
        if self._closed.is_set():
            return
        spec = spec.model_copy(update={"parent_pid": os.getpid()})
        proc = spawn_runner(spec, cmd.threads)
        runner_log = RotatingLog(self.log_dir / f"stage{spec.stage}.log")

        def on_diagnostic(diag: Diagnostic) -> None:
            log.warning("stage %s: %s %s", diag.stage, diag.kind, diag.line)
            if diag.fatal:
                self._report(
                    m.RunnerDiagnostic(generation=spec.generation, stage=spec.stage, diagnostic=diag)
                )

        pump = pump_stream(proc.stdout, spec.stage, runner_log, LineClassifier(spec.stage), on_diagnostic)
        runner = _Runner(spec, proc, runner_log, pump)
        with self._lock:
            self._runners[(spec.generation, spec.stage)] = runner
        self._report(m.RunnerStarted(generation=spec.generation, stage=spec.stage, pid=proc.pid))
        threading.Thread(target=self._wait, args=(runner,), daemon=True, name=f"wait-{proc.pid}").start()

    def _wait(self, runner: _Runner) -> None:
        spec = runner.spec
        stopped_reported = False
        while True:
            try:
                code = runner.proc.wait(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            # A stopped process sends nothing, not even what it queued before the signal: say so at once.
            if not stopped_reported and _is_stopped(runner.proc.pid):
                stopped_reported = True
                self._report(
                    m.RunnerStopped(generation=spec.generation, stage=spec.stage, pid=runner.proc.pid)
                )
        runner.pump.join(timeout=5)  # its last lines, for the tail
        runner.log.close()
        with self._lock:
            self._runners.pop((spec.generation, spec.stage), None)
        self._report(
            m.RunnerExited(
                generation=spec.generation,
                stage=spec.stage,
                pid=runner.proc.pid,
                code=code if code >= 0 else None,
                signal=-code if code < 0 else None,
                log_tail=runner.log.tail(TAIL_LINES),
            )
        )

    def _stop(self, keep: int, grace_s: float) -> None:
        with self._lock:
            doomed = [r for (gen, _), r in self._runners.items() if gen != keep]
        stop_runners([r.proc for r in doomed], grace=grace_s)

    def pids(self, generation: int) -> list[int]:
        with self._lock:
            found = sorted((s, r.proc.pid) for (g, s), r in self._runners.items() if g == generation)
        return [pid for _, pid in found]

    def all_pids(self) -> list[int]:
        with self._lock:
            return [r.proc.pid for r in self._runners.values()]

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting commands and stop every runner; returns once they are reaped."""
        self._closed.set()
        with self._lock:
            procs = [r.proc for r in self._runners.values()]
        stop_runners(procs, grace=grace_s)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        # A StartRunner that raced close() may have spawned after the snapshot: reap it too.
        with self._lock:
            late = [r.proc for r in self._runners.values()]
        stop_runners(late, grace=0)
        self._inbox.close()


def signal_name(number: int | None) -> str:
    if number is None:
        return ""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
