"""A runner process: loads its shard, then serves the ring as the leader (stage 0) or a follower.

It exits on Stop/Shutdown, and on any failure with a typed RunnerFailed status and a non-zero code:
nothing limps on in a broken state.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from shardline.compute.shard import LayerRange, UnsupportedArchitectureError, load_shard
from shardline.dataplane import messages as m
from shardline.dataplane.frame import FrameError, tensor_meta
from shardline.dataplane.transport import (
    DeadlineExceeded,
    Inbox,
    Keys,
    Outbox,
    TransportError,
    open_session,
)
from shardline.runner import faults, schedule
from shardline.runner.spec import RunnerSpec
from shardline.runner.worker import ProtocolError, StageWorker

EXIT_FAILED = 3


class StopRunner(Exception):
    pass


class Runner:
    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.keys = Keys(spec.instance, spec.generation)
        self.session = open_session(spec.listen, spec.connect)
        self.inbox = Inbox(self.session)
        self.inbox.subscribe(self.keys.ring(spec.stage), m.RING, "ring")
        if spec.is_leader:
            self.inbox.subscribe(self.keys.control, m.CONTROL, "control")
        self.status = Outbox(self.session, self.keys.status(spec.stage))
        self.worker: StageWorker | None = None
        self.busy_since = 0.0  # monotonic start of the step being computed, 0 when idle
        self.last_step_s = 0.0
        self.slowest_step_s = 0.0
        self.phase = "loading"
        self.weight_bytes = 0

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        spec = self.spec
        self.status.wait_matched(spec.load_timeout)
        self.status.send(m.Loading(stage=spec.stage, pid=os.getpid()))
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        faults.maybe_fire(spec.fault, "load", 0)
        layers = LayerRange(spec.layer_start, spec.layer_end, spec.layer_total)
        # Attention scratch per head stays at what one chunk attending to itself needs, at any context length.
        budget = spec.score_budget or max(4096, spec.prefill_step**2)
        shard = load_shard(Path(spec.model_dir), layers, budget)
        self.worker = StageWorker(shard)
        self.weight_bytes = shard.weight_bytes()
        faults.maybe_fire(spec.fault, "warmup", 0)
        self.worker.warm_up()
        self.downstream: Outbox | None = None
        if spec.stages > 1:
            self.downstream = Outbox(self.session, self.keys.ring(spec.next_stage))
            self.downstream.wait_matched(spec.load_timeout)
        if spec.is_leader:
            self.events = Outbox(self.session, self.keys.events)
            self.events.wait_matched(spec.load_timeout)
        self.status.send(
            m.Ready(
                stage=spec.stage,
                pid=os.getpid(),
                weight_bytes=shard.weight_bytes(),
                layers=(spec.layer_start, spec.layer_end),
            )
        )
        self.phase = "ready"

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.spec.heartbeat_s)
            w = self.worker
            since = self.busy_since
            beat = m.Heartbeat(
                stage=self.spec.stage,
                steps=w.steps if w else 0,
                busy=since > 0,
                phase=self.phase,
                busy_for_s=time.monotonic() - since if since else 0.0,
                last_step_s=self.last_step_s,
                peak_bytes=mx.get_peak_memory(),
                kv_peak_bytes=w.kv_peak_bytes if w else 0,
                weight_bytes=self.weight_bytes,
            )
            if since and beat.busy_for_s > self.watchdog_s():
                # Our own watchdog: a step this far past its deadline means this process is wedged (a stuck
                # kernel, a lost peer in a collective). Exit with a typed reason rather than limp on.
                self.die(
                    "deadline", f"step running for {beat.busy_for_s:.1f}s (watchdog {self.watchdog_s():.1f}s)"
                )
            try:
                self.status.send(beat)
            except TransportError:
                return

    def serve(self) -> None:
        if self.spec.is_leader:
            Leader(self).serve()
        else:
            self.serve_follower()

    def watchdog_s(self) -> float:
        # Adaptive like the front's deadline, but later, so the front names the stall first when it can.
        spec = self.spec
        return min(spec.step_timeout, max(spec.step_deadline_floor, 10 * self.slowest_step_s)) * 2

    def die(self, reason: str, message: str) -> None:
        print(
            f"shardline runner stage {self.spec.stage} failed ({reason}): {message}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.status.send(m.RunnerFailed(stage=self.spec.stage, reason=reason, message=message))
        finally:
            os._exit(EXIT_FAILED)

    def compute(self, step: m.Step, x: Any) -> tuple[Any, Any]:
        assert self.worker is not None
        self.busy_since = time.monotonic()
        self.fire(step)
        out = self.worker.run(step, x)
        self.last_step_s = time.monotonic() - self.busy_since
        self.slowest_step_s = max(self.slowest_step_s, self.last_step_s)
        self.busy_since = 0.0
        return out

    def fire(self, step: m.Step) -> None:
        if self.spec.fault is not None:
            phase = "decode" if step.n == 1 and step.pos > 0 else "prefill"
            faults.maybe_fire(self.spec.fault, phase, self.worker.steps if self.worker else 0)

    # ---- follower ----------------------------------------------------------------------------------------

    def serve_follower(self) -> None:
        assert self.worker is not None and self.downstream is not None
        while True:
            env = self.inbox.get(timeout=None)  # idle wait: a follower only reacts
            msg = env.message
            if isinstance(msg, m.Step):
                out, tensor = self.compute(msg, env.tensor)
                self.downstream.send(out, tensor)
            elif isinstance(msg, m.Release):
                self.worker.release(msg.request_id)
                if not self.spec.is_last:
                    self.downstream.send(msg)
            elif isinstance(msg, m.Stop):
                if not self.spec.is_last:
                    self.downstream.send(msg)
                raise StopRunner
            else:
                raise ProtocolError(f"stage {self.spec.stage} got unexpected {msg.kind}")


class Leader:
    """Stage 0: owns the schedule. Every other stage executes what it sends, in order."""

    def __init__(self, runner: Runner) -> None:
        self.r = runner
        self.spec = runner.spec
        self.worker = runner.worker
        self.requests: dict[str, schedule.LeaderRequest] = {}
        self.in_flight: dict[int, str] = {}  # step seq -> request id
        self.seq = 0
        self.tick = 0
        self.arrivals = 0

    def serve(self) -> None:
        while True:
            timeout = self.spec.step_timeout if self.in_flight else None
            try:
                env = self.r.inbox.get(timeout=timeout)
            except DeadlineExceeded:
                raise DeadlineExceeded(
                    f"no result from stages 1..{self.spec.stages - 1} within {self.spec.step_timeout:.1f}s "
                    f"({len(self.in_flight)} steps in flight)"
                ) from None
            self.handle(env.message, env.tensor)
            # Drain what already arrived before deciding, so decisions see every result and cancel.
            while (more := self.r.inbox.get_nowait()) is not None:
                self.handle(more.message, more.tensor)
            self.act()

    def act(self) -> None:
        window = self.spec.in_flight_window
        while True:
            action = schedule.plan(
                list(self.requests.values()), len(self.in_flight), window, self.spec.prefill_step
            )
            if action is None:
                return
            if isinstance(action, schedule.ReleaseRequest):
                self.release(action.request_id)
            else:
                self.feed(action)
            # Results that arrived meanwhile free credits and may finish requests: take them in first.
            while (more := self.r.inbox.get_nowait()) is not None:
                self.handle(more.message, more.tensor)

    def handle(self, msg: Any, tensor: Any) -> None:
        if isinstance(msg, m.Submit):
            spec = msg.request
            if spec.request_id in self.requests:
                self.emit(m.RequestFailed(request_id=spec.request_id, message="duplicate request id"))
                return
            self.requests[spec.request_id] = schedule.LeaderRequest(spec=spec, arrival=self.arrivals)
            self.arrivals += 1
        elif isinstance(msg, m.Cancel):
            req = self.requests.get(msg.request_id)
            if req is not None and not req.done:
                req.done = True
                self.emit(m.Finished(request_id=msg.request_id, reason="cancelled"))
        elif isinstance(msg, m.Shutdown):
            if self.r.downstream is not None:
                self.r.downstream.send(m.Stop())
            raise StopRunner
        elif isinstance(msg, m.StepResult):
            self.on_result(msg, tensor)
        else:
            raise ProtocolError(f"leader got unexpected {msg.kind}")

    def feed(self, step: schedule.FeedStep) -> None:
        req = self.requests[step.request_id]
        self.tick += 1
        schedule.apply_step_sent(req, step, self.tick)
        self.seq += 1
        sp = req.spec.sampling
        context = req.known[-sp.repetition_context :] if sp.repetition_penalty != 1.0 else []
        msg = m.Step(
            seq=self.seq,
            request_id=step.request_id,
            pos=step.pos,
            n=step.n,
            sample=step.sample,
            sampling=sp if step.sample else None,
            context=context if step.sample else [],
            want_logits=req.spec.want_logits and step.sample,
            reserve=len(req.known) + 1 if step.pos == 0 else 0,
        )
        tokens = mx.array([req.known[step.pos : step.pos + step.n]], dtype=mx.int32)
        self.in_flight[self.seq] = step.request_id
        out, tensor = self.r.compute(msg, tokens)
        if self.r.downstream is None:  # a single stage is its own last stage
            self.on_result(out, tensor)
        else:
            self.r.downstream.send(out, tensor)

    def on_result(self, res: m.StepResult, logits: Any) -> None:
        rid = self.in_flight.pop(res.seq, None)
        if rid != res.request_id:
            raise ProtocolError(f"result for step {res.seq} of {res.request_id}, expected {rid}")
        req = self.requests[rid]
        req.in_flight -= 1
        if res.token is None or req.done:
            return
        reason = schedule.apply_token(req, res.token)
        if reason != "stop":
            self.emit(
                m.TokenEvent(
                    request_id=rid,
                    index=req.spec.index_base + req.generated - 1,
                    token=res.token,
                    logprob=res.logprob or 0.0,
                    top_logprobs=res.top_logprobs,
                    tensor=tensor_meta(logits) if logits is not None else None,
                ),
                logits,
            )
        if reason is not None:
            self.emit(m.Finished(request_id=rid, reason=reason))

    def release(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        req.released = True
        self.worker.release(request_id)
        if self.r.downstream is not None:
            self.r.downstream.send(m.Release(request_id=request_id))

    def emit(self, event: Any, tensor: Any = None) -> None:
        self.r.events.send(event, tensor)


def _watch_parent(parent_pid: int) -> None:
    # A runner never outlives the process that launched it, even if that one was SIGKILLed.
    while True:
        if os.getppid() != parent_pid:
            os._exit(EXIT_FAILED)
        time.sleep(0.5)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, TransportError):
        return "transport"
    if isinstance(exc, ProtocolError | FrameError):
        return "protocol"
    return "compute"


def main(argv: list[str]) -> int:
    spec = RunnerSpec.model_validate_json(argv[0])
    if spec.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    if spec.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {spec.cpu})
    runner = Runner(spec)
    phase = "load"
    try:
        runner.start()
        phase = "serve"
        runner.serve()
    except StopRunner:
        runner.status.send(m.Exited(stage=spec.stage))
        return 0
    except BaseException as exc:
        reason = "load" if phase == "load" and not isinstance(exc, DeadlineExceeded) else _reason(exc)
        if isinstance(exc, UnsupportedArchitectureError | FileNotFoundError):
            reason = "load"
        message = f"{type(exc).__name__}: {exc}"
        print(f"shardline runner stage {spec.stage} failed ({reason}): {message}", file=sys.stderr)
        try:
            runner.status.send(m.RunnerFailed(stage=spec.stage, reason=reason, message=message))
        except Exception:
            pass
        if not isinstance(exc, Exception):
            raise
        import traceback

        traceback.print_exc()
        return EXIT_FAILED
    finally:
        # Give zenoh a moment to flush the last status before the session goes away.
        try:
            runner.session.close()
        except Exception:
            pass
    return 0
