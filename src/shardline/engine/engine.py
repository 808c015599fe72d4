"""The client side of an instance: starts the runners, submits requests, streams tokens, shuts down.

Request state lives here (see request.py), never only inside a runner.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardline.compute.sampling import SamplingParams
from shardline.compute.shard import check_architecture, split_layers
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Inbox, Keys, Outbox, open_session
from shardline.engine.launch import spawn_runner, stop_runners
from shardline.engine.request import RequestHandle, RequestState
from shardline.runner.spec import Fault, RunnerSpec
from shardline.supervisor.classify import LineClassifier
from shardline.supervisor.diagnostics import Diagnostic
from shardline.supervisor.logs import RotatingLog, pump_stream

log = logging.getLogger("shardline.engine")


class EngineError(RuntimeError):
    """The instance could not start or has failed."""


class ContextLengthError(ValueError):
    pass


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_dir: Path
    stages: int = Field(2, ge=1)
    prefill_step: int = Field(256, ge=1)
    window: int = Field(0, ge=0)
    step_timeout: float = Field(60.0, gt=0)  # ceiling of the adaptive step deadline
    step_deadline_floor: float = Field(2.0, gt=0)
    load_timeout: float = Field(180.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    heartbeat_timeout: float = Field(4.0, gt=0)  # a runner silent this long is stalled (SIGSTOP, frozen host)
    max_restarts: int = Field(3, ge=0)  # within restart_window_s; one more failure marks the instance failed
    restart_window_s: float = Field(120.0, gt=0)
    backoff_s: float = Field(0.2, ge=0)  # doubled per consecutive failure, capped at backoff_max_s
    backoff_max_s: float = Field(5.0, ge=0)
    score_budget: int = Field(0, ge=0)
    pin_cpus: bool = False
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    faults: dict[int, Fault] = {}  # stage -> failure to inject (tests, chaos bench)
    faults_every_generation: bool = False  # False: only the first generation fails, so recovery can succeed
    # exact: replay prompt chunks then emitted tokens as decode steps (fault-free numerics, greedy unchanged);
    # fast: one prefill of prompt + emitted (fewer steps; a near tie can flip). `bench resume` measures both.
    resume: Literal["exact", "fast"] = "exact"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Runner:
    stage: int
    proc: subprocess.Popen
    log: RotatingLog
    pump: threading.Thread
    ready: m.Ready | None = None
    failed: m.RunnerFailed | None = None
    fatal: Diagnostic | None = None
    heartbeat: m.Heartbeat | None = None
    alive: bool = False  # has said anything yet: silence before that is covered by load_timeout
    last_heartbeat: float = field(default_factory=time.monotonic)
    slowest_step_s: float = 0.0


@dataclass
class Recovery:
    """One failure and what it cost: when it was detected and when the rebuilt instance was serving again."""

    why: str
    generation: int
    detected_at: float  # monotonic
    detected_wall: float  # time.time(), comparable with timestamps other processes log
    pids: list[int]  # the runners of the failed generation, all killed
    recovered_at: float | None = None
    requests_resumed: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = self._read_model_config(config.model_dir)
        self.context_length = int(self.model_config.get("max_position_embeddings") or 2**31)
        self.instance = uuid.uuid4().hex[:12]
        self.generation = -1
        self.runners: list[_Runner] = []
        self.requests: dict[str, RequestHandle] = {}
        self.recoveries: list[Recovery] = []
        self.diagnostics: list[Diagnostic] = []
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._closed = False
        self._stop = threading.Event()
        self.serving = False  # a generation is up and accepting steps
        self.failure: str | None = None
        self.control: Outbox | None = None
        self.inbox: Inbox | None = None
        port = _free_port(config.host)
        self.endpoint = f"tcp/{config.host}:{port}"
        self.session = open_session([self.endpoint], [])
        env_dir = os.environ.get("SHARDLINE_LOG_DIR")
        self.log_dir = config.log_dir or (Path(env_dir) if env_dir else None)

    @staticmethod
    def _read_model_config(model_dir: Path) -> dict:
        import json

        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot read model config {path}: {exc}") from exc
        try:
            check_architecture(config)
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        total = int(config.get("num_hidden_layers", 0))
        return config | {"num_hidden_layers": total}

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> Engine:
        """Bring the first generation up, retrying within the restart budget; raise if it cannot."""
        total = int(self.model_config["num_hidden_layers"])
        if self.config.stages > total:
            self.shutdown()
            raise EngineError(f"{self.config.stages} stages requested, the model has only {total} layers")
        try:
            self._bring_up()
        except BaseException:
            self.shutdown()
            raise
        if self.failure is not None:
            why = self.failure
            self.shutdown()
            raise EngineError(why)
        self._monitor = threading.Thread(target=self._run_monitor, daemon=True, name="engine-monitor")
        self._monitor.start()
        return self

    def _bring_up(self) -> None:
        """Start a new generation; on failure, back off and retry until the restart budget is spent."""
        while not self._closed:
            try:
                self._start_generation()
                return
            except Exception as exc:  # anything that stops a generation from coming up counts as a failure
                why = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
                self._record_failure(why)
                self._kill_generation()
                if not self._may_retry(why):
                    return

    def _record_failure(self, why: str) -> None:
        self.recoveries.append(
            Recovery(
                why=why,
                generation=self.generation,
                detected_at=time.monotonic(),
                detected_wall=time.time(),
                pids=[r.proc.pid for r in self.runners],
            )
        )

    def _may_retry(self, why: str) -> bool:
        """False (and the instance failed) once the restart budget is spent; else back off first."""
        if not self._within_budget(why):
            return False
        self._stop.wait(self._backoff())
        return not self._closed

    def _within_budget(self, why: str) -> bool:
        now = time.monotonic()
        recent = [r for r in self.recoveries if now - r.detected_at <= self.config.restart_window_s]
        if len(recent) > self.config.max_restarts:
            window = self.config.restart_window_s
            self._fail_instance(f"{why} (gave up after {len(recent)} failures in {window:.0f}s)")
            return False
        return True

    def _backoff(self) -> float:
        now = time.monotonic()
        recent = [r for r in self.recoveries if now - r.detected_at <= self.config.restart_window_s]
        return min(self.config.backoff_max_s, self.config.backoff_s * 2 ** max(0, len(recent) - 1))

    def _start_generation(self) -> None:
        cfg = self.config
        self.generation += 1
        keys = Keys(self.instance, self.generation)
        self.keys = keys
        if self.inbox is not None:
            self.inbox.close()  # stale messages of the old generation are dropped with it
        self.inbox = Inbox(self.session)
        self.inbox.subscribe(keys.status_all, m.STATUS, "status")
        self.inbox.subscribe(keys.events, m.EVENTS, "events")
        ranges = split_layers(int(self.model_config["num_hidden_layers"]), cfg.stages)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        threads = max(1, len(cpus) // cfg.stages)
        log_dir = self._log_dir()
        inject = cfg.faults if (self.generation == 0 or cfg.faults_every_generation) else {}
        self.runners = []
        for stage, lr in enumerate(ranges):
            spec = RunnerSpec(
                instance=self.instance,
                generation=self.generation,
                stage=stage,
                stages=cfg.stages,
                model_dir=str(cfg.model_dir),
                layer_start=lr.start,
                layer_end=lr.end,
                layer_total=lr.total,
                connect=[self.endpoint],
                listen=[f"tcp/{cfg.host}:0"],
                prefill_step=cfg.prefill_step,
                window=cfg.window,
                step_timeout=cfg.step_timeout + cfg.heartbeat_timeout,  # the front names a stall first
                step_deadline_floor=cfg.step_deadline_floor,
                load_timeout=cfg.load_timeout,
                score_budget=cfg.score_budget,
                cpu=cpus[stage % len(cpus)] if cfg.pin_cpus else None,
                parent_pid=os.getpid(),
                heartbeat_s=cfg.heartbeat_s,
                fault=inject.get(stage),
            )
            proc = spawn_runner(spec, 1 if cfg.pin_cpus else threads)
            log_file = RotatingLog(log_dir / f"stage{stage}.log")
            pump = pump_stream(proc.stdout, stage, log_file, LineClassifier(stage), self._on_diagnostic)
            self.runners.append(_Runner(stage, proc, log_file, pump))
        self._wait_ready(time.monotonic() + cfg.load_timeout)
        self.control = Outbox(self.session, keys.control)
        self.control.wait_matched(cfg.load_timeout)
        self._resubmit()

    def _log_dir(self) -> Path:
        if self.log_dir is not None:
            return Path(self.log_dir)
        import tempfile

        self.log_dir = Path(tempfile.mkdtemp(prefix=f"shardline-{self.instance}-"))
        return self.log_dir

    def _on_diagnostic(self, diag: Diagnostic) -> None:
        # Runs on a pump thread: record, and let the monitor act on fatal ones.
        log.warning("stage %s: %s %s", diag.stage, diag.kind, diag.line)
        with self._state_changed:
            self.diagnostics = [*self.diagnostics[-99:], diag]
            for r in self.runners:
                mine = r.pump is threading.current_thread()  # not a runner of an older generation
                if mine and diag.fatal and r.fatal is None:
                    r.fatal = diag
            self._state_changed.notify_all()

    def _wait_ready(self, deadline: float) -> None:
        assert self.inbox is not None
        while not all(r.ready for r in self.runners):
            if (why := self._health()) is not None:
                raise EngineError(why)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [r.stage for r in self.runners if not r.ready]
                raise EngineError(f"stages {waiting} not ready within {self.config.load_timeout:.0f}s")
            try:
                env = self.inbox.get(timeout=min(remaining, 0.1))
            except TimeoutError:
                continue
            self._on_status_or_event(env.message, env.tensor)

    def _health(self) -> str | None:
        """Why this generation can no longer be trusted, naming the stage; None while it is healthy."""
        cfg = self.config
        now = time.monotonic()
        for r in self.runners:
            if r.failed is not None:
                return f"stage {r.stage} failed ({r.failed.reason}): {r.failed.message}"
            if r.fatal is not None:
                return f"stage {r.stage} reported {r.fatal.kind}: {r.fatal.line}"
            code = r.proc.poll()
            if code is not None:
                return f"stage {r.stage} exited with code {code}: {self._log_tail(r)}"
            if r.alive and now - r.last_heartbeat > cfg.heartbeat_timeout:
                return f"stage {r.stage} stalled: no heartbeat for {now - r.last_heartbeat:.1f}s"
            hb = r.heartbeat
            if hb is not None and hb.busy and hb.busy_for_s > self._step_deadline(r):
                return f"stage {r.stage} stalled: one step running for {hb.busy_for_s:.1f}s"
        return None

    def _step_deadline(self, r: _Runner) -> float:
        # Adaptive: many times the slowest step seen, within [floor, ceiling].
        cfg = self.config
        return min(cfg.step_timeout, max(cfg.step_deadline_floor, 10 * r.slowest_step_s))

    @staticmethod
    def _log_tail(r: _Runner, lines: int = 3) -> str:
        return " | ".join(r.log.tail(lines)) or "(no output)"

    def _run_monitor(self) -> None:
        while not self._closed and self.failure is None:
            try:
                env = self.inbox.get(timeout=0.1) if self.inbox is not None else None
            except TimeoutError:
                env = None
            except Exception as exc:  # a malformed message from a peer: log and drop it, never wedge
                log.warning("dropped bad message: %s", exc)
                continue
            if env is not None:
                try:
                    self._on_status_or_event(env.message, env.tensor)
                except Exception as exc:  # e.g. a stage index no runner has: drop it, keep supervising
                    log.warning("dropped message %s: %s", type(env.message).__name__, exc)
            if self._closed:
                return
            why = self._health()
            if why is not None:
                try:
                    self._recover(why)
                except Exception as exc:  # the monitor must never die silently: requests would wait forever
                    log.exception("recovery failed")
                    self._fail_instance(f"recovery failed: {type(exc).__name__}: {exc}")

    def _recover(self, why: str) -> None:
        """One rule for every failure: kill the whole generation, start a fresh one, resume every request."""
        log.error("instance %s generation %d: %s; rebuilding", self.instance, self.generation, why)
        self.serving = False
        self._record_failure(why)
        self._kill_generation()
        if self._may_retry(why):
            self._bring_up()

    def _kill_generation(self) -> None:
        stop_runners([r.proc for r in self.runners], grace=0)
        for r in self.runners:
            r.pump.join(timeout=5)
            r.log.close()

    def _resubmit(self) -> None:
        """(Re)send every unfinished request: prompt plus the tokens the client already has."""
        with self._lock:
            pending = [h for h in self.requests.values() if not h.done]
            for h in pending:
                if len(h.state.generated) >= h.state.max_tokens:
                    # Every token arrived, only the Finished event was lost with the old generation.
                    h._deliver(m.Finished(request_id=h.request_id, reason="length"), None)
                    self.requests.pop(h.request_id, None)
                else:
                    self.control.send(m.Submit(request=h.state.spec(self.config.resume)))
            self.serving = True  # under the lock: a concurrent submit either is in `pending` or sends itself
        if self.recoveries and self.recoveries[-1].recovered_at is None:
            self.recoveries[-1].requests_resumed = len(pending)
            self.recoveries[-1].recovered_at = time.monotonic()

    def _fail_instance(self, why: str) -> None:
        log.error("instance %s failed: %s", self.instance, why)
        self.failure = why
        self.serving = False
        with self._lock:
            pending = [h for h in self.requests.values() if not h.done]
        for h in pending:
            h._deliver(m.RequestFailed(request_id=h.request_id, message=f"instance failed: {why}"), None)

    def _on_status_or_event(self, msg: Any, tensor: Any) -> None:
        if isinstance(msg, m.Loading):
            # Alive from here on: silence is a stall even before the first heartbeat (SIGSTOP during load).
            self.runners[msg.stage].last_heartbeat = time.monotonic()
            self.runners[msg.stage].alive = True
        elif isinstance(msg, m.Ready):
            self.runners[msg.stage].ready = msg
        elif isinstance(msg, m.RunnerFailed):
            self.runners[msg.stage].failed = msg
        elif isinstance(msg, m.Heartbeat):
            with self._state_changed:
                r = self.runners[msg.stage]
                r.heartbeat = msg
                r.last_heartbeat = time.monotonic()
                r.slowest_step_s = max(r.slowest_step_s, msg.last_step_s)
                self._state_changed.notify_all()
        elif isinstance(msg, m.TokenEvent | m.Finished | m.RequestFailed):
            with self._lock:
                handle = self.requests.get(msg.request_id)
            if handle is not None:
                handle._deliver(msg, tensor)
                if handle.done:
                    with self._lock:
                        self.requests.pop(msg.request_id, None)

    def fresh_heartbeats(self, timeout: float) -> list[m.Heartbeat]:
        """Wait for one heartbeat from every stage sent after this call (runner counters are then current)."""
        since = time.monotonic()
        with self._state_changed:
            ok = self._state_changed.wait_for(
                lambda: all(r.last_heartbeat > since and r.heartbeat for r in self.runners), timeout
            )
            if not ok:
                raise EngineError(f"no heartbeat from every stage within {timeout:.0f}s")
            return [r.heartbeat for r in self.runners]  # type: ignore[misc]

    def shutdown(self, grace: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.control is not None and self.serving:
            try:
                self.control.send(m.Shutdown())
            except Exception:
                pass
        stop_runners([r.proc for r in self.runners], grace=grace)
        self._kill_generation()
        with self._lock:
            pending = [h for h in self.requests.values() if not h.done]
        for h in pending:
            h._deliver(m.RequestFailed(request_id=h.request_id, message="engine shut down"), None)
        try:
            self.session.close()
        except Exception:
            pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- requests ----------------------------------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_tokens: list[int] | None = None,
        want_logits: bool = False,
        request_id: str | None = None,
    ) -> RequestHandle:
        if self._closed:
            raise EngineError("engine is shut down")
        if self.failure is not None:
            raise EngineError(f"instance failed: {self.failure}")
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = int(self.model_config.get("vocab_size", 2**31))
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(prompt) >= self.context_length:
            raise ContextLengthError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.context_length} tokens"
            )
        max_tokens = min(max_tokens, self.context_length - len(prompt))
        if sampling is None:
            sampling = SamplingParams()
        if sampling.temperature > 0 and "seed" not in sampling.model_fields_set:
            # A fixed seed per request makes a resumed request continue exactly where it was.
            sampling = sampling.model_copy(update={"seed": int.from_bytes(os.urandom(7), "little")})
        state = RequestState(
            request_id=request_id or uuid.uuid4().hex,
            prompt=list(prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_tokens=list(stop_tokens or []),
            want_logits=want_logits,
        )
        handle = RequestHandle(self, state)
        with self._lock:
            self.requests[state.request_id] = handle
            # While a generation is being rebuilt the request waits here; _resubmit sends it once it is up.
            if self.serving and self.control is not None:
                self.control.send(m.Submit(request=state.spec()))
        return handle

    def cancel(self, request_id: str) -> None:
        if self._closed or self.failure is not None:
            return
        if self.serving and self.control is not None:
            self.control.send(m.Cancel(request_id=request_id))
        else:  # nothing runs it now: finish it here so a resume does not restart it
            with self._lock:
                handle = self.requests.pop(request_id, None)
            if handle is not None:
                handle._deliver(m.Finished(request_id=request_id, reason="cancelled"), None)
