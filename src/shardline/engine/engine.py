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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shardline.compute.sampling import SamplingParams
from shardline.compute.shard import check_architecture, split_layers
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Inbox, Keys, Outbox, open_session
from shardline.engine.launch import kill_group, spawn_runner, stop_runners
from shardline.engine.request import RequestHandle, RequestState
from shardline.runner.spec import RunnerSpec

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
    step_timeout: float = Field(60.0, gt=0)
    load_timeout: float = Field(180.0, gt=0)
    score_budget: int = Field(0, ge=0)
    pin_cpus: bool = False
    host: str = "127.0.0.1"
    log_dir: Path | None = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Runner:
    stage: int
    proc: subprocess.Popen
    log_path: Path
    ready: m.Ready | None = None
    failed: m.RunnerFailed | None = None
    heartbeat: m.Heartbeat | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = self._read_model_config(config.model_dir)
        self.context_length = int(self.model_config.get("max_position_embeddings") or 2**31)
        self.instance = uuid.uuid4().hex[:12]
        self.generation = 0
        self.runners: list[_Runner] = []
        self.requests: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._closed = False
        self.failure: str | None = None
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
        return config

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> Engine:
        try:
            self._start_generation()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start_generation(self) -> None:
        cfg = self.config
        keys = Keys(self.instance, self.generation)
        self.keys = keys
        self.inbox = Inbox(self.session)
        self.inbox.subscribe(keys.status_all, m.STATUS, "status")
        self.inbox.subscribe(keys.events, m.EVENTS, "events")
        total = int(self.model_config["num_hidden_layers"])
        if cfg.stages > total:
            raise EngineError(f"{cfg.stages} stages requested, the model has only {total} layers")
        ranges = split_layers(total, cfg.stages)
        cpus = (
            sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1))
        )
        threads = max(1, len(cpus) // cfg.stages)
        log_dir = self._log_dir()
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
                step_timeout=cfg.step_timeout,
                load_timeout=cfg.load_timeout,
                score_budget=cfg.score_budget,
                cpu=cpus[stage % len(cpus)] if cfg.pin_cpus else None,
                parent_pid=os.getpid(),
            )
            log_path = log_dir / f"g{self.generation}-stage{stage}.log"
            proc = spawn_runner(spec, log_path, 1 if cfg.pin_cpus else threads)
            self.runners.append(_Runner(stage, proc, log_path))
        self._wait_ready(time.monotonic() + cfg.load_timeout)
        self.control = Outbox(self.session, keys.control)
        self.control.wait_matched(cfg.load_timeout)
        self._pump = threading.Thread(target=self._pump_events, daemon=True, name="engine-events")
        self._pump.start()

    def _log_dir(self) -> Path:
        if self.log_dir is not None:
            return Path(self.log_dir)
        import tempfile

        self.log_dir = Path(tempfile.mkdtemp(prefix=f"shardline-{self.instance}-"))
        return self.log_dir

    def _wait_ready(self, deadline: float) -> None:
        while not all(r.ready for r in self.runners):
            self._check_processes()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [r.stage for r in self.runners if not r.ready]
                raise EngineError(f"stages {waiting} not ready within {self.config.load_timeout:.0f}s")
            try:
                env = self.inbox.get(timeout=min(remaining, 0.5))
            except TimeoutError:
                continue
            self._on_status_or_event(env.message, env.tensor)

    def _check_processes(self) -> None:
        for r in self.runners:
            code = r.proc.poll()
            if r.failed is not None:
                raise EngineError(f"stage {r.stage} failed ({r.failed.reason}): {r.failed.message}")
            if code is not None:
                raise EngineError(f"stage {r.stage} exited with code {code}: {self._log_tail(r)}")

    @staticmethod
    def _log_tail(r: _Runner, lines: int = 3) -> str:
        try:
            text = r.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def _pump_events(self) -> None:
        while not self._closed:
            try:
                env = self.inbox.get(timeout=0.5)
            except TimeoutError:
                env = None
            except Exception as exc:  # a malformed message from a peer: log and drop it, never wedge
                log.warning("dropped bad message: %s", exc)
                continue
            if env is not None:
                self._on_status_or_event(env.message, env.tensor)
            if not self._closed and self.failure is None:
                self._watch_runners()

    def _watch_runners(self) -> None:
        for r in self.runners:
            code = r.proc.poll()
            if r.failed is not None or code is not None:
                why = (
                    f"stage {r.stage} failed ({r.failed.reason}): {r.failed.message}"
                    if r.failed
                    else f"stage {r.stage} exited with code {code}: {self._log_tail(r)}"
                )
                self._fail_instance(why)
                return

    def _fail_instance(self, why: str) -> None:
        log.error("instance %s failed: %s", self.instance, why)
        self.failure = why
        stop_runners([r.proc for r in self.runners], grace=0)
        with self._lock:
            pending = [h for h in self.requests.values() if not h.done]
        for h in pending:
            h._deliver(m.RequestFailed(request_id=h.request_id, message=f"instance failed: {why}"), None)

    def _on_status_or_event(self, msg: Any, tensor: Any) -> None:
        if isinstance(msg, m.Ready):
            self.runners[msg.stage].ready = msg
        elif isinstance(msg, m.RunnerFailed):
            self.runners[msg.stage].failed = msg
        elif isinstance(msg, m.Heartbeat):
            with self._state_changed:
                self.runners[msg.stage].heartbeat = msg
                self.runners[msg.stage].last_heartbeat = time.monotonic()
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
        if getattr(self, "control", None) is not None and self.failure is None:
            try:
                self.control.send(m.Shutdown())
            except Exception:
                pass
        stop_runners([r.proc for r in self.runners], grace=grace)
        with self._lock:
            pending = [h for h in self.requests.values() if not h.done]
        for h in pending:
            h._deliver(m.RequestFailed(request_id=h.request_id, message="engine shut down"), None)
        try:
            self.session.close()
        except Exception:
            pass

    def kill(self) -> None:
        for r in self.runners:
            kill_group(r.proc)

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
        self.control.send(m.Submit(request=state.spec()))
        return handle

    def cancel(self, request_id: str) -> None:
        if not self._closed and self.failure is None:
            self.control.send(m.Cancel(request_id=request_id))
