"""A runner process: its lifecycle (load, join its group, link, rejoin), heartbeat and watchdog, and main.

Once linked it serves the ring as the leader (stage 0's face, runner/leader.py), a follower
(runner/follower.py) or a tensor-parallel group's other member (runner/member.py). It exits on Stop or
Shutdown, and on any failure with a typed RunnerFailed status and a non-zero code: nothing limps on in a
broken state. What it reads it does not trust: a message that does not fit is dropped and counted (see the
heartbeat), and a real loss is caught by a deadline.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from shardline.compute import attention, expert_parallel
from shardline.compute.shard import LayerRange, UnsupportedArchitectureError, load_shard
from shardline.dataplane import messages as m
from shardline.dataplane.frame import FrameError
from shardline.dataplane.group import GroupFace, GroupMember
from shardline.dataplane.transport import (
    DeadlineExceeded,
    Inbox,
    Keys,
    Link,
    Outbox,
    TransportError,
    open_session,
)
from shardline.instance.deadline import Speed
from shardline.instance.slots import runner_slots
from shardline.instance.spec import RunnerSpec
from shardline.runner.faults import Faults, step_phase
from shardline.runner.follower import serve_follower
from shardline.runner.leader import Leader
from shardline.runner.member import serve_member
from shardline.runner.signals import RejoinRequested, StopRunner
from shardline.runner.stage import ProtocolError, Stage, StageCompute
from shardline.runner.tp_mirror import TensorParallelMirror
from shardline.trust.credentials import Credentials

EXIT_FAILED = 3
WARMUP_CHUNK_MAX = 512  # a warm-up chunk as large as a prefill chunk, within reason


class RunnerProcess:
    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.keys = Keys(spec.instance, spec.generation, spec.namespace)
        # The node's key and TLS folder come through the environment, never the command line.
        self.session = open_session(spec.listen, spec.connect, Link(credentials=Credentials.from_env()))
        self.rejoin_spec: RunnerSpec | None = None
        self.inbox = self._inbox(spec)
        self.status = Outbox(self.session, self.keys.status(spec.slot), spec.generation)
        self.faults = Faults(spec.fault)
        self.policy = spec.policy
        self.speed = Speed()
        self.stage: StageCompute | None = None
        # What the ring's messages act on: the stage, or on a tensor-parallel face its mirror.
        self.mirrored: Stage | None = None
        self.downstream: Outbox | None = None
        self.events: Outbox | None = None
        self.leader: Leader | None = None
        # (since, n, context, reserve) of the step being computed
        self.busy: tuple[float, int, int, int] | None = None
        self.last_step: m.StepTime | None = None
        self.phase: str = "loading"
        self.grace_s = 0.0  # announced bounded work under way (Heartbeat.grace_s)
        self.weight_bytes = 0
        self.blocks: list[Any] = []
        self.path = ""  # the shard's compute path, for Ready
        self.group: GroupFace | GroupMember | None = None

    def _inbox(self, spec: RunnerSpec) -> Inbox:
        inbox = Inbox(self.session, spec.generation, name=f"stage {spec.slot}")
        if spec.is_face:  # a group's other members hear the ring through their face
            inbox.subscribe(self.keys.ring(spec.ring), m.RING, "ring")
        self.received: dict[str, int] = {}  # front -> newest control seq that reached this generation
        if spec.is_leader:
            inbox.subscribe(self.keys.control, m.CONTROL, "control")
            inbox.watch("control", self._on_control, queued_only=True)  # a dropped Submit is not received
        if spec.runner_id:
            inbox.subscribe(self.keys.runner(spec.runner_id), m.REJOIN, "agent")
            inbox.watch("agent", self._on_rejoin)
        return inbox

    def _on_control(self, env: Any) -> None:
        """As a front's message arrives (before the leader reads it): the beat tells each front what reached
        this process, so a Submit lost on the way is found within transport time, not a step's."""
        msg = env.message
        if isinstance(msg, m.Submit | m.Cancel):
            self.received[msg.front] = max(self.received.get(msg.front, -1), msg.seq)

    def _on_rejoin(self, env: Any) -> None:
        self.rejoin_spec = env.message.spec  # read by waits that cannot look at the inbox (_abort_wait)

    def _abort_wait(self) -> None:
        """A Rejoin arrived while this stage waits for its next stage: give up the wait, serve the new one."""
        spec, self.rejoin_spec = self.rejoin_spec, None
        if spec is not None and spec.generation > self.spec.generation:
            raise RejoinRequested(spec)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        spec = self.spec
        self.status.wait_matched(spec.load_timeout)
        self.status.send(m.Loading(slot=spec.slot, pid=os.getpid()))
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        self.faults.maybe_fire("load", 0)
        layers = LayerRange(spec.layer_start, spec.layer_end, spec.layer_total)
        # Attention scratch per head: one chunk attending to TILE_KEYS keys, at any context length.
        budget = spec.score_budget or attention.score_budget(spec.prefill_step)
        shard = load_shard(
            Path(spec.model_dir),
            layers,
            budget,
            spec.member,
            spec.group,
            spec.expert_owners or None,
            spec.expert_heads,
        )
        self.stage = self.mirrored = StageCompute(shard, Path(spec.model_dir), block=spec.prefill_step)
        if self.stage.matchers is not None:
            self.stage.matchers.grace = self.grace
            self.stage.matchers.on_build = lambda: self.faults.at_tokenizer_build()
        self.weight_bytes = shard.weight_bytes()
        self.blocks = list(shard.layers)  # the held blocks, whose experts' routing the face reports
        self.path = shard.path if not shard.why_generic else f"{shard.path}: {shard.why_generic}"
        print(f"layers [{spec.layer_start}, {spec.layer_end}): {self.path} path", file=sys.stderr, flush=True)
        self.speed.attn_keys = 6 * shard.hidden_size
        if spec.group > 1:
            self._join_group(shard)
        self.faults.maybe_fire("warmup", 0)
        warmup = self.stage.warm_up(
            min(spec.prefill_step, WARMUP_CHUNK_MAX), lambda: self.faults.slow_s("warmup", 0)
        )
        if self.group is not None:
            self.group.check()
        for t in warmup:
            self.speed.observe(t.n, t.context, t.seconds)
        self._link(warmup)

    def _join_group(self, shard: Any) -> None:
        """Meet the stage's other members (bring-up, with the load deadline); every sum of the warm-up and
        of each step goes through them."""
        spec = self.spec
        creds = Credentials.from_env()
        key = creds.key
        slots = runner_slots(spec.stages, spec.group)
        members = [slots.index((spec.ring, j)) for j in range(1, spec.group)]
        if spec.is_face:
            face = GroupFace(
                self.session,
                self.keys,
                spec.ring,
                spec.group,
                spec.listen,
                key,
                members,
                self._lost,
                creds.tls_dir,
            )
            face.admit(spec.load_timeout, abort=self._abort_wait)
            assert self.stage is not None
            self.mirrored = TensorParallelMirror(self.stage, face, self.policy.floor)
            self.group = face
        else:
            self.group = GroupMember(
                self.session,
                self.keys,
                spec.ring,
                spec.member,
                spec.group,
                key,
                spec.load_timeout,
                self._abort_wait,
                self._lost,
                creds.tls_dir,
            )
        shard.join_group(self.group.reduce, self.group.gather)
        self.group.begin(-1, self.policy.ceiling)  # the warm-up: not measured yet, err long

    def _lost(self, slot: int) -> None:
        """A group peer stopped answering or broke its stream: name it before this runner fails."""
        try:
            self.status.send(m.PeerLost(slot=self.spec.slot, peer=slot))
        except Exception:
            pass

    def rejoin(self, spec: RunnerSpec) -> None:
        """Serve a newer generation with the weights already loaded: new keys, no KV, a fresh warm-up."""
        assert self.stage is not None
        self.phase, self.leader = "loading", None
        for outbox in (self.downstream, self.events):
            if outbox is not None:
                outbox.close()
        self.downstream = self.events = None
        self.inbox.close()
        old_status = self.status
        self.spec, self.keys = spec, Keys(spec.instance, spec.generation, spec.namespace)
        self.faults = Faults(spec.fault)
        self.stage.clear()  # the old generation's requests are resubmitted by their fronts
        self.inbox = self._inbox(spec)
        self.status = Outbox(self.session, self.keys.status(spec.slot), spec.generation)
        old_status.close()
        self.status.wait_matched(spec.load_timeout, abort=self._abort_wait)
        self.status.send(m.Loading(slot=spec.slot, pid=os.getpid()))
        self._link([])

    def _link(self, warmup: list[m.StepTime]) -> None:
        """Links to the next stage (and, on the leader, to the fronts), the ring warmed, then Ready."""
        spec = self.spec
        assert self.stage is not None
        if spec.stages > 1 and spec.is_face:
            self.downstream = Outbox(
                self.session, self.keys.ring(spec.next_stage), spec.generation, on_lost=self._peer_lost
            )
            self.downstream.wait_matched(spec.load_timeout, abort=self._abort_wait)
        if spec.is_leader:
            # Not waiting for a front to listen: in a cluster, fronts come and go; a front subscribes to
            # events before it submits anything, so nothing it needs can be missed.
            self.events = Outbox(self.session, self.keys.events, spec.generation)
            assert self.mirrored is not None
            session, keys = self.session, self.keys
            self.leader = Leader(
                spec,
                self.mirrored,
                self.compute,
                self.inbox,
                self.downstream,
                self.events,
                policy=self.policy,
                faults=self.faults,
                received=self.received,
                attn_keys=self.speed.attn_keys,
                open_reply=lambda front: Outbox(session, keys.reply(front), spec.generation),
            )
            self.leader.warm_ring()  # the whole ring works, and the leader knows every stage's speed
        self.status.send(
            m.Ready(
                slot=spec.slot,
                pid=os.getpid(),
                weight_bytes=self.weight_bytes,
                layers=(spec.layer_start, spec.layer_end),
                kv_bytes_per_token=self.stage.kv_bytes_per_token,
                warmup=warmup,
                path=self.path,
                expert_bytes=expert_parallel.expert_bytes(self.blocks),
            )
        )
        self.phase = "ready"

    def _peer_lost(self) -> None:
        """The next stage vanished: say so at once (a killed machine is seen in well under its lease)."""
        try:
            self.status.send(m.PeerLost(slot=self.spec.slot, peer=self.spec.next_stage))
        except Exception:
            pass

    def _beat(self) -> m.Heartbeat:
        w = self.stage
        busy = self.busy
        kv = w.kv_figures() if w else (0, 0)
        return m.Heartbeat(
            slot=self.spec.slot,
            steps=w.steps if w else 0,
            busy=busy is not None,
            phase="ready" if self.phase == "ready" else "loading",
            busy_for_s=time.monotonic() - busy[0] if busy else 0.0,
            busy_n=busy[1] if busy else 0,
            busy_context=busy[2] if busy else 0,
            busy_reserve=busy[3] if busy else 0,
            last_step=self.last_step,
            peak_bytes=mx.get_peak_memory(),
            kv_bytes=kv[0],
            kv_cached_bytes=kv[1],
            kv_peak_bytes=w.kv_peak_bytes if w else 0,
            weight_bytes=self.weight_bytes,
            constraint_tokenizer=bool(w and w.matchers and w.matchers.loaded),
            grace_s=self.grace_s,
            **self._group_figures(),
            routed=self._routed(),
            dropped=self.inbox.dropped,
            requests=len(self.leader.requests) if self.leader else len(w.caches) if w else 0,
        )

    def _routed(self) -> list[list[int]]:
        # Every member routes every token alike: the face alone reports it.
        face_of_experts = self.spec.expert_owners and self.spec.is_face and self.phase == "ready"
        return expert_parallel.routed_counts(self.blocks) if face_of_experts else []

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.spec.heartbeat_s)  # the period of a beat, not a synchronisation
            busy = self.busy
            beat = self._beat()
            if busy is not None:
                watchdog = self.spec.watchdog_factor * self.policy.step(self.speed, *busy[1:])
                if beat.busy_for_s > watchdog + beat.grace_s:
                    # Our own watchdog: a step this far past its deadline means this process is wedged (a
                    # stuck kernel, a lost peer). Exit with a typed reason rather than limp on.
                    self.die(
                        "deadline", f"step running for {beat.busy_for_s:.1f}s (watchdog {watchdog:.1f}s)"
                    )
            try:
                self.status.send(beat)
                if self.leader is not None and self.phase == "ready":
                    self.leader.beat()
            except TransportError:
                return

    @contextmanager
    def grace(self, seconds: float) -> Iterator[None]:
        """Bounded work of about `seconds` at most, which may hold the GIL (so no beat goes out while it
        runs) or lengthen the current step: a beat sent before it starts tells the controller to wait that
        much longer. Within a step the grace lasts to the step's end (the step's time includes the work)."""
        self.grace_s += seconds
        try:
            self.status.send(self._beat())
        except TransportError:
            pass  # the heartbeat thread reports a lost link
        try:
            yield
        finally:
            if self.busy is None:
                self.grace_s = 0.0

    def _group_figures(self) -> dict[str, Any]:
        g = self.group
        if g is None:
            return {}
        decode, chunk = g.percentiles(True), g.percentiles(False)
        return {"group_sums": g.count, "sum_us_decode": decode, "sum_us_chunk": chunk}

    def serve(self) -> None:
        """Serve the ring until Stop (StopRunner) or a Rejoin (RejoinRequested)."""
        assert self.stage is not None and self.mirrored is not None
        if self.leader is not None:
            self.leader.serve()
        elif isinstance(self.group, GroupMember):
            serve_member(self.group, self.stage, self.compute)
        else:
            assert self.downstream is not None
            serve_follower(self.spec, self.inbox, self.mirrored, self.compute, self.downstream, self.faults)

    def die(self, reason: str, message: str) -> None:
        print(
            f"shardline runner stage {self.spec.slot} failed ({reason}): {message}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.status.send(m.RunnerFailed(slot=self.spec.slot, reason=reason, message=message))
        finally:
            os._exit(EXIT_FAILED)

    def compute(self, step: m.Step, x: Any) -> tuple[Any, Any]:
        """Run one step through this stage; the outgoing message carries this stage's time in its trace."""
        assert self.stage is not None
        context = step.keys
        started = time.monotonic()
        self.busy = (started, step.n, context, step.reserve)
        phase = step_phase(step)
        if self.group is not None:  # the step's sums wait at most its deadline
            self.group.begin(step.seq, self.policy.step(self.speed, step.n, context, step.reserve))
        try:
            self.faults.maybe_fire(phase, self.stage.steps)
            assert self.mirrored is not None
            out, tensor = self.mirrored.run(step, x)
            if self.group is not None:  # its sums failed: the step's output is not the stage's
                self.group.check()
            time.sleep(self.faults.slow_s(phase, self.stage.steps))
        finally:
            self.busy = None
            self.grace_s = 0.0
        seconds = time.monotonic() - started
        self.last_step = m.StepTime(n=step.n, context=context, seconds=seconds, reserve=step.reserve)
        self.speed.observe(step.n, context, seconds, step.reserve)
        return out.model_copy(update={"trace": [*step.trace, seconds]}), tensor


def _watch_parent(parent_pid: int) -> None:
    # A runner never outlives the process that launched it, even if that one was SIGKILLed.
    while True:
        if os.getppid() != parent_pid:
            os._exit(EXIT_FAILED)
        time.sleep(0.5)  # polling period


def _reason(exc: BaseException, phase: str) -> str:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, TransportError):
        return "transport"
    if phase == "load" or isinstance(exc, UnsupportedArchitectureError | FileNotFoundError):
        return "load"
    if isinstance(exc, ProtocolError | FrameError):
        return "protocol"
    return "compute"


def main(argv: list[str]) -> int:
    spec = RunnerSpec.model_validate_json(argv[0])
    if spec.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    if spec.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {spec.cpu})
    if mx.default_device() == mx.cpu:
        # MLX keeps freed CPU buffers for reuse by size; activations of every chunk and row count leave a
        # runner holding tens of MB in buffers of sizes no later step asks for. malloc reuses freed memory
        # for any size at no measured cost (8 streams on 2 stages at the same speed); peak RSS after the
        # engine bench's long prefill and streams fell 308 -> 279 MiB on its last stage.
        mx.set_cache_limit(0)
    runner = RunnerProcess(spec)
    phase = "load"
    try:
        pending: RunnerSpec | None = None
        try:
            runner.start()
        except RejoinRequested as rejoin:  # the generation failed while this stage was warming up
            pending = rejoin.spec
        phase = "serve"
        while True:
            try:
                if pending is not None:
                    spec, pending = pending, None
                    runner.rejoin(spec)
                runner.serve()
                break
            except RejoinRequested as rejoin:
                pending = rejoin.spec
    except StopRunner:
        return 0
    except BaseException as exc:
        reason = _reason(exc, phase)
        message = f"{type(exc).__name__}: {exc}"
        print(f"shardline runner stage {spec.slot} failed ({reason}): {message}", file=sys.stderr)
        try:
            runner.status.send(m.RunnerFailed(slot=spec.slot, reason=reason, message=message))
        except Exception:
            pass
        if not isinstance(exc, Exception):
            raise
        import traceback

        traceback.print_exc()
        return EXIT_FAILED
    finally:
        try:
            runner.session.close()
        except Exception:
            pass
    return 0
