"""The node agent: starts and kills runner processes, pumps and classifies their output, reports exits.

It knows nothing of requests. Commands arrive on the node's agent key (StartRunner, StopGeneration); what it
sees goes back as typed status on the instance's reports key (RunnerStarted, RunnerExited with code, signal
and log tail, RunnerDiagnostic for fatal lines, WeightsProgress while a stage's weights are copied from a
peer). One per machine, for every instance it runs a stage of; `shardline node` hosts it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import zenoh

from shardline.dataplane import messages as m
from shardline.dataplane.diagnostics import Diagnostic
from shardline.dataplane.transport import DeadlineExceeded, Inbox, Keys, Outbox
from shardline.node.classify import LineClassifier
from shardline.node.launch import spawn_runner, stop_runners
from shardline.node.logs import RotatingLog, pump_stream
from shardline.trust.credentials import Credentials
from shardline.trust.refusals import refuse
from shardline.trust.seal import Checker

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
    issued: tuple[int, int] = (0, 0)  # (term, view seq) of the command that started or handed it over


RunnerKey = tuple[str, int, int]  # instance, generation, slot


class NodeAgent:
    """agent_key: where commands arrive. fetch: how a spec without a model_dir gets one (the node resolves
    the model name, copying the stage's weights from a peer if needed); with it, a spec naming a path is
    refused: a command names a model the node holds, never a file of its. Without it (a local engine), specs
    name a model_dir. obey: whether a command of this master term is to be obeyed (a node follows the highest
    term seen). allow_faults: obey specs that inject faults (tests and benches only). credentials: what the
    runners join with (the node's key and TLS folder)."""

    def __init__(
        self,
        session: zenoh.Session,
        agent_key: str,
        log_dir: Path,
        *,
        fetch: Callable[[m.StartRunner, Callable[[int, int, str], None]], Path] | None = None,
        obey: Callable[[int], bool] = lambda term: True,
        allow_faults: bool = False,
        credentials: Credentials | None = None,
    ) -> None:
        self._allow_faults = allow_faults
        self._credentials = credentials
        self.session = session
        self.log_dir = Path(log_dir)
        self._fetch = fetch
        self._obey = obey
        self._runners: dict[RunnerKey, _Runner] = {}
        self._pending: set[RunnerKey] = set()  # fetching weights before the process starts
        self._cancelled: set[RunnerKey] = set()  # stopped while fetching: never started
        self._newest: dict[str, int] = {}  # instance -> the newest generation a StartRunner named
        self.fenced = 0  # StartRunners refused: an older generation, or a stage already running
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._inbox = Inbox(session, name="agent")
        # Commands come from a node (the master): a client's certificate, or none, commands nothing.
        self._checker = Checker(credentials) if credentials is not None else None
        self._inbox.subscribe(
            agent_key, m.AGENT, "agent", self._unsealed if self._checker is not None else None
        )
        self._reports: dict[tuple[str, str], Outbox] = {}  # (namespace, instance) -> reports outbox
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
            msg = env.message
            if not self._obey(msg.term):
                self._inbox.drop(f"{msg.kind} of an old master's term {msg.term}")
                refuse(msg.kind, "outdated term", f"term {msg.term}")
                continue
            if isinstance(msg, m.StartRunner) and (why := self._unauthorised(msg.spec)) is not None:
                self._inbox.drop(f"StartRunner of {msg.spec.instance}: {why}")
                refuse(msg.kind, why, f"instance {msg.spec.instance}")
                continue
            try:
                if isinstance(msg, m.StartRunner):
                    self._start(msg)
                elif isinstance(msg, m.StopGeneration):
                    self.stop_instance(msg.instance, msg.keep, msg.grace_s, msg.slots)
            except Exception:  # one bad command must not end the agent
                log.exception("agent command %s failed", type(msg).__name__)

    def _report(self, spec: m.RunnerSpec, message: object) -> None:
        if self._closed.is_set():
            return  # shutting down: nobody judges these any more
        key = (spec.namespace, spec.instance)
        try:
            with self._lock:
                if key not in self._reports:
                    self._reports[key] = Outbox(self.session, Keys(spec.instance, 0, spec.namespace).reports)
                outbox = self._reports[key]
            outbox.send(message)
        except Exception as exc:
            log.warning("could not report %s: %s", type(message).__name__, exc)

    def _unsealed(self, data: bytes, attachment: bytes | None) -> str | None:
        """Why a command's seal does not show a node sent it (trust/seal.py); None when it does."""
        assert self._checker is not None
        if (why := self._checker.check(None, data, attachment)) is not None:
            refuse("agent command", "seal", why)
        return why

    def _unauthorised(self, spec: m.RunnerSpec) -> str | None:
        """Why no master may command this StartRunner, whatever its term; None when it may."""
        if spec.fault is not None and not self._allow_faults:
            return "fault injection is off"
        if self._fetch is not None and spec.model_dir:
            return "names a path, not a model"
        if self._fetch is not None and not spec.model:
            return "names no model"
        return None

    def _fence(self, spec: m.RunnerSpec) -> str | None:
        """Why a StartRunner must not run (caller holds the lock): a generation older than one already
        commanded (a deposed master's, or a late copy), or a stage that runs or is fetched already. A live
        runner's entry is never overwritten: that would leave its process without an owner."""
        key = (spec.instance, spec.generation, spec.slot)
        newest = self._newest.get(spec.instance, -1)
        if spec.generation < newest:
            return f"generation {spec.generation} is older than {newest}"
        if key in self._pending or (key in self._runners and self._runners[key].proc.poll() is None):
            return "that stage runs already"
        return None

    def _start(self, cmd: m.StartRunner) -> None:
        spec = cmd.spec
        if self._closed.is_set():
            return
        with self._lock:
            why = self._fence(spec)
            if why is None:
                self._newest[spec.instance] = spec.generation
        if why is not None:
            self.fenced += 1
            self._inbox.drop(f"StartRunner of {spec.instance} stage {spec.slot}: {why}")
            refuse("start_runner", "fenced", why)
            return
        issued = (cmd.term, cmd.view_seq)
        if cmd.reuse and self._rejoin(spec, issued):
            return
        if spec.model_dir or self._fetch is None:
            self._spawn(spec, cmd.threads, issued)
            return
        key = (spec.instance, spec.generation, spec.slot)
        with self._lock:
            self._pending.add(key)
        # Copying weights takes a while: it runs beside the agent, which keeps obeying other commands.
        threading.Thread(target=self._fetch_then_spawn, args=(cmd, key), daemon=True).start()

    def _fetch_then_spawn(self, cmd: m.StartRunner, key: RunnerKey) -> None:
        spec = cmd.spec

        def progress(done: int, total: int, source: str) -> None:
            beat = m.WeightsProgress(
                generation=spec.generation, slot=spec.slot, done=done, total=total, source=source
            )
            self._report(spec, beat)

        try:
            assert self._fetch is not None
            model_dir = self._fetch(cmd, progress)
        except Exception as exc:
            log.error("stage %d of %s: no weights: %s", spec.slot, spec.instance, exc)
            failed = m.RunnerFailed(slot=spec.slot, reason="load", message=f"weights: {exc}")
            self._report(spec, failed.model_copy(update={"generation": spec.generation}))
            return
        finally:
            with self._lock:
                self._pending.discard(key)
                gone = key in self._cancelled
                self._cancelled.discard(key)
        if not gone:
            issued = (cmd.term, cmd.view_seq)
            self._spawn(spec.model_copy(update={"model_dir": str(model_dir)}), cmd.threads, issued)

    def _rejoin(self, spec: m.RunnerSpec, issued: tuple[int, int]) -> bool:
        """Hand the new generation's stage to a live runner of an older one holding the same layers.

        The runner is listed under the new generation before it is told, and the lock is not held while
        waiting for it to be reachable (up to 2 s): the node's loop reads held() on every report, and exits
        and reports take the lock too. Listed as the new generation, it is spared by fencing meanwhile."""
        with self._lock:
            found = [
                (k, r)
                for k, r in self._runners.items()
                if k[0] == spec.instance
                and k[1] < spec.generation
                and (r.spec.layer_start, r.spec.layer_end) == (spec.layer_start, spec.layer_end)
                and r.spec.group == spec.group == 1  # a group member serves its own group alone
                and r.proc.poll() is None
            ]
            if not found:
                return False
            key, runner = max(found, key=lambda kr: kr[0][1])
            old, old_issued = runner.spec, runner.issued
            new = spec.model_copy(
                update={"model_dir": old.model_dir, "runner_id": old.runner_id, "parent_pid": os.getpid()}
            )
            if self._fence(new) is not None:
                return False
            new_key = (new.instance, new.generation, new.slot)
            del self._runners[key]
            runner.spec, runner.issued = new, issued  # its exit is now the new generation's
            self._runners[new_key] = runner
        try:
            to_runner = Outbox(self.session, Keys(old.instance, 0, old.namespace).runner(old.runner_id))
            try:
                to_runner.generation = old.generation  # the runner takes only its own generation's frames
                to_runner.wait_matched(2.0)
                to_runner.send(m.Rejoin(spec=new))
            finally:
                to_runner.close()
        except Exception as exc:
            log.warning("runner %d could not be reused: %s", runner.proc.pid, exc)
            with self._lock:  # back as it was, unless it exited meanwhile (its exit is reported already)
                if self._runners.get(new_key) is runner:
                    del self._runners[new_key]
                    runner.spec, runner.issued = old, old_issued
                    self._runners[key] = runner
            return False
        log.info("stage %d of %s reuses runner %d", new.slot, new.instance, runner.proc.pid)
        self._report(new, m.RunnerStarted(generation=new.generation, slot=new.slot, pid=runner.proc.pid))
        return True

    def _spawn(self, spec: m.RunnerSpec, threads: int, issued: tuple[int, int] = (0, 0)) -> None:
        spec = spec.model_copy(update={"parent_pid": os.getpid(), "runner_id": uuid.uuid4().hex})
        key = (spec.instance, spec.generation, spec.slot)
        with self._lock:
            if self._closed.is_set():
                return
            if key in self._runners and self._runners[key].proc.poll() is None:
                log.warning("stage %d of %s generation %d runs already", spec.slot, spec.instance, key[1])
                return  # never overwritten (see _fence)
            proc = spawn_runner(spec, threads, self._credentials)  # under the lock: close() cannot miss it
            runner_log = RotatingLog(stage_log(self.log_dir, spec.instance, spec.slot))

            def on_diagnostic(diag: Diagnostic) -> None:
                log.warning("stage %s: %s %s", diag.slot, diag.kind, diag.line)
                if diag.fatal:
                    fatal = m.RunnerDiagnostic(generation=spec.generation, slot=spec.slot, diagnostic=diag)
                    self._report(spec, fatal)

            pump = pump_stream(proc.stdout, spec.slot, runner_log, LineClassifier(spec.slot), on_diagnostic)
            runner = _Runner(spec, proc, runner_log, pump, issued)
            self._runners[key] = runner
        self._report(spec, m.RunnerStarted(generation=spec.generation, slot=spec.slot, pid=proc.pid))
        threading.Thread(target=self._wait, args=(runner,), daemon=True, name=f"wait-{proc.pid}").start()

    def _wait(self, runner: _Runner) -> None:
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
                spec = runner.spec
                stopped = m.RunnerStopped(generation=spec.generation, slot=spec.slot, pid=runner.proc.pid)
                self._report(spec, stopped)
        runner.pump.join(timeout=5)  # its last lines, for the tail
        runner.log.close()
        with self._lock:  # read under the lock: a reused runner belongs to its newest generation
            spec = runner.spec
            key = (spec.instance, spec.generation, spec.slot)
            if self._runners.get(key) is runner:
                del self._runners[key]
        exited = m.RunnerExited(
            generation=spec.generation,
            slot=spec.slot,
            pid=runner.proc.pid,
            code=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            log_tail=runner.log.tail(TAIL_LINES),
        )
        self._report(spec, exited)

    def stop_instance(
        self, instance: str, keep: int = -1, grace_s: float = 0.0, slots: list[int] | None = None
    ) -> None:
        """Stop the instance's runners of every generation but `keep` (-1: all), fetches included; with
        `slots`, only those runners."""
        with self._lock:
            doomed = [
                r
                for (i, g, s), r in self._runners.items()
                if i == instance and g != keep and (not slots or s in slots)
            ]
            self._cancelled |= {k for k in self._pending if k[0] == instance and k[1] != keep}
        if grace_s > 0:
            for r in doomed:
                if r.spec.slot == 0 and r.proc.poll() is None:
                    self._shut_down(r.spec)
        stop_runners([r.proc for r in doomed], grace=grace_s)

    def _shut_down(self, spec: m.RunnerSpec) -> None:
        """Ask a leader to stop its ring in order (it ends its requests and tells the next stage).

        Sent by the agent, which obeys only a StopGeneration of the highest term it has seen: a deposed
        master's controller sends no Shutdown of its own, so it cannot stop a ring the next master adopted."""
        keys = Keys(spec.instance, spec.generation, spec.namespace)
        control = Outbox(self.session, keys.control, spec.generation)
        try:
            control.wait_matched(1.0)
            control.send(m.Shutdown())
        except Exception as exc:
            log.info("no clean shutdown for %s generation %d: %s", spec.instance, spec.generation, exc)
        finally:
            control.close()

    def held(self) -> list[tuple[RunnerKey, m.RunnerSpec, int, tuple[int, int]]]:
        """(instance, generation, slot), spec, pid and issuing (term, view seq) of every runner here."""
        with self._lock:
            return [(k, r.spec, r.proc.pid, r.issued) for k, r in self._runners.items()]

    def pending(self) -> list[RunnerKey]:
        with self._lock:
            return sorted(self._pending - self._cancelled)

    def pids(self, generation: int, instance: str | None = None) -> list[int]:
        with self._lock:
            found = sorted(
                (s, r.proc.pid)
                for (i, g, s), r in self._runners.items()
                if g == generation and instance in (None, i)
            )
        return [pid for _, pid in found]

    def all_pids(self) -> list[int]:
        with self._lock:
            return [r.proc.pid for r in self._runners.values()]

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting commands and stop every runner; returns once they are reaped."""
        with self._lock:
            self._closed.set()  # under the lock: no spawn can start after this
            procs = [r.proc for r in self._runners.values()]
        stop_runners(procs, grace=grace_s)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._inbox.close()
        for outbox in list(self._reports.values()):
            outbox.close()


def stage_log(log_dir: Path, instance: str, stage: int) -> Path:
    """One rotating log per stage of an instance; every generation appends to it."""
    return Path(log_dir) / instance / f"stage{stage}.log"


def signal_name(number: int | None) -> str:
    if number is None:
        return ""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
