"""The instance controller's state, folded from what it hears, and its decisions as pure functions.

`apply` folds one message into the state; `judge` says why the current generation can no longer be
trusted; `after_failure` decides between another generation (after a backoff) and giving up. The shell in
controller.py only turns these into messages.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from shardline.dataplane import messages as m
from shardline.dataplane.diagnostics import Diagnostic
from shardline.instance.deadline import Speed
from shardline.instance.settings import InstanceSettings

Phase = Literal["idle", "starting", "serving", "backoff", "failed", "stopped"]


class ControllerConfig(InstanceSettings):
    """What the controller needs to judge and rebuild an instance: its settings and its number of stages."""

    stages: int = Field(2, ge=1)

    @classmethod
    def of(cls, settings: InstanceSettings, stages: int) -> ControllerConfig:
        return cls(stages=stages, **settings.settings_fields())


@dataclass
class StageView:
    """One runner of the current generation, as last heard (times are arrival times, monotonic)."""

    pid: int | None = None
    alive: bool = False  # has said anything: silence before that is covered by the load timeout
    last_heard: float = 0.0
    heartbeat: m.Heartbeat | None = None
    heartbeat_at: float = 0.0
    ready: m.Ready | None = None
    failed: m.RunnerFailed | None = None
    fatal: Diagnostic | None = None
    exited: m.RunnerExited | None = None
    stopped: bool = False
    weights: m.WeightsProgress | None = None  # copying weights from a peer before the runner starts
    progress_at: float = 0.0  # last sign of bring-up progress (weights copied, runner loading)


@dataclass
class Failure:
    """One failure and what it cost: when it was detected and when the rebuilt instance was serving again."""

    why: str
    generation: int
    detected_at: float  # monotonic
    detected_wall: float  # time.time(), comparable with timestamps other processes log
    pids: list[int]  # the runners of the failed generation
    suspects: list[int] | None = None  # stages blamed (None: all); the others may be reused
    recovered_at: float | None = None
    requests_resumed: int = 0


@dataclass
class ControllerState:
    """What an instance controller knows of its instance: the current generation, its runners as last heard,
    and the failures so far."""

    stages: int
    generation: int = -1
    phase: Phase = "idle"
    started_at: float = 0.0  # bring-up of the current generation
    retry_at: float = 0.0
    views: list[StageView] = field(default_factory=list)
    speeds: list[Speed] = field(default_factory=list)  # per stage, carried across generations
    failures: list[Failure] = field(default_factory=list)
    fault: str | None = None  # a lost message reported by a front, a node that left
    fault_stages: list[int] = field(default_factory=list)  # the stages that fault blames
    witnesses: list[int] = field(default_factory=list)  # stages that reported losing a peer: not to blame
    failure: str | None = None  # why the instance gave up
    names: list[str] = field(default_factory=list)  # how judgements name each runner (groups: stage, member)
    dropped: int = 0  # frames of other generations, unknown stages

    def __post_init__(self) -> None:
        if not self.speeds:
            self.speeds = [Speed() for _ in range(self.stages)]


GENERATION_BITS = 20  # a generation id is (master term << 20) | count: the term is part of its keys


def next_generation(current: int, term: int) -> int:
    """The id of the generation after `current`, launched by a master of `term`.

    Two masters of different terms can never launch the same id (so never the same data-plane keys), and ids
    only grow: a newer term's first generation is above every id of an older term."""
    return max(current + 1, term << GENERATION_BITS)


def generation_term(generation: int) -> int:
    return generation >> GENERATION_BITS if generation > 0 else 0


def generation_label(generation: int) -> str:
    """How people read an id: "term.count" ("3.0" is term 3's first generation); a lone engine's as is."""
    term = generation_term(generation)
    return f"{term}.{generation - (term << GENERATION_BITS)}" if term else str(generation)


def new_generation(
    state: ControllerState,
    now: float,
    stages: int | None = None,
    term: int = 0,
    names: list[str] | None = None,
) -> None:
    """A new generation of `stages` runners (a re-placement may change their number), named `names` where
    given (a tensor-parallel member is "stage 0 member 1 (runner 2)"), "stage k" otherwise."""
    if stages is not None and stages != state.stages:
        state.stages = stages
        state.speeds = [Speed(attn_keys=state.speeds[0].attn_keys) for _ in range(stages)]
    state.generation = next_generation(state.generation, term)
    state.phase = "starting"
    state.started_at = now
    state.fault = None
    state.fault_stages = []
    state.witnesses = []
    state.views = [StageView() for _ in range(state.stages)]
    state.names = list(names) if names is not None and len(names) == state.stages else []


def runner_label(state: ControllerState, slot: int) -> str:
    """How judgements name runner `slot`: "stage k", or a group member's stage, place and slot."""
    return state.names[slot] if slot < len(state.names) else f"stage {slot}"


def adopt(state: ControllerState, generation: int, stages: int, now: float) -> None:
    """Take over a generation that serves already (a new master): heartbeats judge it from now on."""
    new_generation(state, now, stages)
    state.generation = generation  # the id it was launched with, whichever term that was
    state.phase = "serving"
    for v in state.views:
        v.alive, v.last_heard = True, now


def stage_phase(view: StageView) -> str:
    """What a stage is doing during bring-up, in the words the cluster view uses."""
    if view.ready is not None:
        return "ready"
    if view.alive:
        return "warming" if view.heartbeat is not None and view.heartbeat.phase == "ready" else "loading"
    if view.weights is not None:
        return "weights"
    return "starting" if view.pid is not None else "placed"


def apply(state: ControllerState, msg: Any, generation: int, received_at: float) -> None:
    """Fold one status message in. Messages of another generation or stage are counted and dropped."""
    gen = getattr(msg, "generation", None)
    gen = generation if gen is None else gen
    stage = getattr(msg, "stage", None)
    if isinstance(msg, m.Resubmitted):
        if gen == state.generation and state.failures:
            state.failures[-1].requests_resumed = msg.requests
        return
    if gen != state.generation or (stage is not None and not 0 <= stage < len(state.views)):
        state.dropped += 1
        return
    if isinstance(msg, m.GenerationFault):
        state.fault = state.fault or f"lost message: {msg.why}"
        return
    if isinstance(msg, m.PeerLost):
        if 0 <= msg.peer < len(state.views):
            if state.fault is None:
                lost, seen = runner_label(state, msg.peer), runner_label(state, msg.stage)
                state.fault = f"{lost} vanished: {seen} lost its link to it"
            if msg.peer not in state.fault_stages:
                state.fault_stages.append(msg.peer)
            # A runner that lost its peer may fail next, of that loss: it is a witness, not a suspect (even
            # when the loss was known already, from its node leaving the cluster).
            if msg.stage not in state.witnesses and msg.stage != msg.peer:
                state.witnesses.append(msg.stage)
        return
    assert stage is not None
    view = state.views[stage]
    if isinstance(msg, m.RunnerStarted):
        view.pid = msg.pid
        return
    if isinstance(msg, m.RunnerExited):
        view.exited = msg
        return
    if isinstance(msg, m.RunnerStopped):
        view.stopped = True
        return
    if isinstance(msg, m.RunnerDiagnostic):
        view.fatal = view.fatal or msg.diagnostic
        return
    if isinstance(msg, m.WeightsProgress):
        view.weights = msg
        view.progress_at = max(view.progress_at, received_at)
        return
    # From the runner itself: it is alive, and this is when we last heard it.
    view.alive = True
    view.last_heard = max(view.last_heard, received_at)
    speed = state.speeds[stage]
    if isinstance(msg, m.Loading):
        view.pid = msg.pid
        view.progress_at = max(view.progress_at, received_at)  # weights in place: the load itself starts
    elif isinstance(msg, m.Ready):
        view.ready = msg
        for t in msg.warmup:
            speed.observe(t.n, t.context, t.seconds)
    elif isinstance(msg, m.Heartbeat):
        view.heartbeat = msg
        view.heartbeat_at = received_at
        if msg.last_step is not None:
            t = msg.last_step
            speed.observe(t.n, t.context, t.seconds, t.reserve)
    elif isinstance(msg, m.RunnerFailed):
        view.failed = view.failed or msg


def set_attention_scale(state: ControllerState, attn_keys: int) -> None:
    for s in state.speeds:
        s.attn_keys = attn_keys


def _exit_text(e: m.RunnerExited) -> str:
    if e.signal is not None:
        try:
            how = f"killed by {signal.Signals(e.signal).name}"
        except ValueError:
            how = f"killed by signal {e.signal}"
    else:
        how = f"exited with code {e.code}"
    return f"{how}: {' | '.join(e.log_tail) or '(no output)'}"


def _stage_problem(state: ControllerState, cfg: ControllerConfig, now: float, stage: int) -> str | None:
    v = state.views[stage]
    name = runner_label(state, stage)
    if v.failed is not None:
        return f"{name} failed ({v.failed.reason}): {v.failed.message}"
    if v.fatal is not None:
        return f"{name} reported {v.fatal.kind}: {v.fatal.line}"
    if v.exited is not None:
        return f"{name} {_exit_text(v.exited)}"
    if v.stopped:
        return f"{name} stalled: its process is stopped (SIGSTOP)"
    hb = v.heartbeat
    # Work the runner announced, sized to that work (a tokenizer build that holds the GIL, a grammar's
    # compile): it may stay silent, and its step run, that much longer.
    grace = hb.grace_s if hb is not None else 0.0
    if v.alive and now - v.last_heard > cfg.heartbeat_timeout + grace:
        return f"{name} stalled: no heartbeat for {now - v.last_heard:.1f}s"
    if hb is not None and hb.busy:
        running = hb.busy_for_s + (now - v.heartbeat_at)
        deadline = grace + cfg.policy.step(state.speeds[stage], hb.busy_n, hb.busy_context, hb.busy_reserve)
        if running > deadline:
            return (
                f"{name} stalled: one step of {hb.busy_n} positions running for {running:.1f}s "
                f"(deadline {deadline:.1f}s)"
            )
    return None


def suspects(state: ControllerState, cfg: ControllerConfig, now: float) -> list[int] | None:
    """The stages a failure blames; None when it blames no stage in particular (all are suspect)."""
    bad = {k for k in range(len(state.views)) if _stage_problem(state, cfg, now, k) is not None}
    return sorted((bad - set(state.witnesses)) | set(state.fault_stages)) or None


def judge(state: ControllerState, cfg: ControllerConfig, now: float) -> str | None:
    """Why this generation can no longer be trusted, naming the stage; None while it is healthy."""
    if state.phase not in ("starting", "serving"):
        return None
    for stage in range(len(state.views)):
        if (problem := _stage_problem(state, cfg, now, stage)) is not None:
            return problem
    if state.fault is not None:
        return state.fault
    if state.phase == "starting":
        # Bring-up is judged from its last sign of progress: copying a large stage is slow, not dead.
        last = max([state.started_at, *(v.progress_at for v in state.views if v.ready is None)])
        if now - last > cfg.load_timeout:
            waiting = [s for s, v in enumerate(state.views) if v.ready is None]
            return f"stages {waiting} made no progress towards ready for {cfg.load_timeout:.0f}s"
    return None


def all_ready(state: ControllerState) -> bool:
    return state.phase == "starting" and all(v.ready is not None for v in state.views)


def recent_failures(failures: list[Failure], now: float, window_s: float) -> list[Failure]:
    return [f for f in failures if now - f.detected_at <= window_s]


@dataclass(frozen=True)
class Retry:
    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    why: str


def after_failure(state: ControllerState, cfg: ControllerConfig, why: str, now: float) -> Retry | GiveUp:
    """Another generation after an exponential backoff, until the restart budget is spent."""
    recent = recent_failures(state.failures, now, cfg.restart_window_s)
    if len(recent) > cfg.max_restarts:
        return GiveUp(f"{why} (gave up after {len(recent)} failures in {cfg.restart_window_s:.0f}s)")
    return Retry(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** max(0, len(recent) - 1)))
