"""The instance controller as a pure fold: `apply(state, event) -> (state, effects)`.

Like cluster/master_state.py, this holds no thread, lock, clock or socket, and never changes a state it is
given: it returns a new one (containers copied, the items in them replaced, never changed in place). The
events (controller/events.py, with the effects) are what the controller hears: a runner's status, time
passing, a layout, another role's fault. The effects are what the shell in controller/controller.py
carries out: commands to node agents, announcements to the instance's fronts, a layout to compute and
fold back, log lines. `judge` says why the current generation can no longer be trusted and
`after_failure` decides between another generation (after a backoff) and giving up.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import Field

from shardline.dataplane import messages as m
from shardline.dataplane.diagnostics import Diagnostic
from shardline.instance.deadline import Speed
from shardline.instance.generation import next_generation
from shardline.instance.settings import InstanceSettings

from .events import (
    Abandon,
    Adopt,
    Begin,
    Broken,
    Clock,
    Effect,
    Event,
    Heard,
    LaidOut,
    Lay,
    Note,
    Retire,
    ToAgent,
    ToFronts,
)

Phase = Literal["idle", "starting", "serving", "backoff", "failed", "stopped"]


class ControllerConfig(InstanceSettings):
    """What the controller needs to judge and rebuild an instance: its settings and its number of stages."""

    stages: int = Field(2, ge=1)

    @classmethod
    def of(cls, settings: InstanceSettings, stages: int) -> ControllerConfig:
        return cls(stages=stages, **settings.settings_fields())


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    and the failures so far. The fold returns a new one for each event; before the first, its owner may set
    where the next generation starts from (a new master's `generation`, the failure it inherits)."""

    stages: int
    config: ControllerConfig = field(default_factory=ControllerConfig)
    instance: str = ""  # named in the commands to node agents
    term: int = 0  # the master's term, stamped on commands (node agents obey the highest they saw)
    kv_budget_bytes: int = 0  # announced to the fronts with Serving
    reuse: bool = False  # after a failure, stop only the blamed stages (the layout may reuse the others)
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
    kv_bytes_per_token: int = 0  # of the serving generation, over all its runners
    agents: list[str] = field(default_factory=list)  # every node agent this instance ever used, by key

    def __post_init__(self) -> None:
        if not self.speeds:
            self.speeds = [Speed() for _ in range(self.stages)]


def initial(
    config: ControllerConfig,
    attn_keys: int,
    instance: str = "",
    kv_budget_bytes: int = 0,
    reuse: bool = False,
) -> ControllerState:
    """A controller's state before its first generation; attn_keys seeds every stage's speed."""
    speeds = [Speed(attn_keys=attn_keys) for _ in range(config.stages)]
    return ControllerState(
        config.stages, config, instance, kv_budget_bytes=kv_budget_bytes, reuse=reuse, speeds=speeds
    )


def _copy(state: ControllerState) -> ControllerState:
    """A state the fold may change: new containers, the same (never changed in place) items."""
    return replace(
        state,
        views=list(state.views),
        speeds=list(state.speeds),
        failures=list(state.failures),
        fault_stages=list(state.fault_stages),
        witnesses=list(state.witnesses),
        names=list(state.names),
        agents=list(state.agents),
    )


# ---- generations -----------------------------------------------------------------------------------------


def new_generation(
    state: ControllerState,
    now: float,
    stages: int | None = None,
    term: int = 0,
    names: list[str] | None = None,
) -> ControllerState:
    """A new generation of `stages` runners (a re-placement may change their number), named `names` where
    given (a tensor-parallel member is "stage 0 member 1 (runner 2)"), "stage k" otherwise."""
    s = _copy(state)
    if stages is not None and stages != s.stages:
        s.stages = stages
        s.speeds = [Speed(attn_keys=s.speeds[0].attn_keys) for _ in range(stages)]
    s.generation = next_generation(s.generation, term)
    s.phase = "starting"
    s.started_at = now
    s.fault = None
    s.fault_stages = []
    s.witnesses = []
    s.views = [StageView() for _ in range(s.stages)]
    s.names = list(names) if names is not None and len(names) == s.stages else []
    return s


def runner_label(state: ControllerState, slot: int) -> str:
    """How judgements name runner `slot`: "stage k", or a group member's stage, place and slot."""
    return state.names[slot] if slot < len(state.names) else f"stage {slot}"


def stage_phase(view: StageView) -> str:
    """What a stage is doing during bring-up, in the words the cluster view uses."""
    if view.ready is not None:
        return "ready"
    if view.alive:
        return "warming" if view.heartbeat is not None and view.heartbeat.phase == "ready" else "loading"
    if view.weights is not None:
        return "weights"
    return "starting" if view.pid is not None else "placed"


# ---- the fold --------------------------------------------------------------------------------------------


def apply(state: ControllerState, event: Event) -> tuple[ControllerState, list[Effect]]:
    """Fold one event in: the new state, and what the shell is to do about it, in order."""
    effects: list[Effect] = []
    if isinstance(event, Heard):
        return _heard(state, event.message, event.generation, event.received_at), effects
    s = _copy(state)
    if isinstance(event, Clock):
        _clock(s, event.now, event.wall, effects)
    elif isinstance(event, Begin):
        effects.append(Lay(next_generation(s.generation, s.term), event.now))
    elif isinstance(event, LaidOut):
        names = [start.spec.name for _, start in event.launches]
        s = new_generation(s, event.now, len(event.launches), s.term, names)
        for key, start in event.launches:
            _use(s, key)
            effects.append(ToAgent(key, start))
        if s.reuse:  # after the hand-overs (same outbox, in order): what was not reused stops now
            effects += [
                ToAgent(key, m.StopGeneration(instance=s.instance, keep=event.generation, term=s.term))
                for key in s.agents
            ]
    elif isinstance(event, Adopt):
        for key in event.agents:
            _use(s, key)
        s.kv_bytes_per_token = event.kv_bytes_per_token
        s = new_generation(s, event.now, event.stages)
        s.generation = event.generation  # the id it was launched with, whichever term that was
        s.phase = "serving"
        s.views = [replace(v, alive=True, last_heard=event.now) for v in s.views]
        effects.append(ToFronts(_serving(s)))
    elif isinstance(event, Broken):
        if event.generation == s.generation and s.fault is None:
            s.fault = event.why
            s.fault_stages = list(event.stages)
    elif isinstance(event, Abandon):
        _give_up(s, event.why, effects)
    elif isinstance(event, Retire):
        s.phase = "stopped"
        effects += [
            ToAgent(key, m.StopGeneration(instance=s.instance, keep=-1, grace_s=event.grace_s, term=s.term))
            for key in s.agents
        ]
    return s, effects


def _use(state: ControllerState, agent: str) -> None:
    if agent not in state.agents:
        state.agents.append(agent)


def _heard(state: ControllerState, msg: Any, generation: int, received_at: float) -> ControllerState:
    """Fold one status message in. Messages of another generation or stage are counted and dropped."""
    gen = getattr(msg, "generation", None)
    gen = generation if gen is None else gen
    stage = getattr(msg, "slot", None)
    s = _copy(state)
    if isinstance(msg, m.Resubmitted):
        if gen == s.generation and s.failures:
            s.failures[-1] = replace(s.failures[-1], requests_resumed=msg.requests)
        return s
    if gen != s.generation or (stage is not None and not 0 <= stage < len(s.views)):
        s.dropped += 1
        return s
    if isinstance(msg, m.GenerationFault):
        s.fault = s.fault or f"lost message: {msg.why}"
        return s
    if isinstance(msg, m.PeerLost):
        if 0 <= msg.peer < len(s.views):
            if s.fault is None:
                lost, seen = runner_label(s, msg.peer), runner_label(s, msg.slot)
                s.fault = f"{lost} vanished: {seen} lost its link to it"
            if msg.peer not in s.fault_stages:
                s.fault_stages.append(msg.peer)
            # A runner that lost its peer may fail next, of that loss: it is a witness, not a suspect (even
            # when the loss was known already, from its node leaving the cluster).
            if msg.slot not in s.witnesses and msg.slot != msg.peer:
                s.witnesses.append(msg.slot)
        return s
    assert stage is not None
    view = s.views[stage]
    if isinstance(msg, m.RunnerStarted):
        s.views[stage] = replace(view, pid=msg.pid)
        return s
    if isinstance(msg, m.RunnerExited):
        s.views[stage] = replace(view, exited=msg)
        return s
    if isinstance(msg, m.RunnerStopped):
        s.views[stage] = replace(view, stopped=True)
        return s
    if isinstance(msg, m.RunnerDiagnostic):
        s.views[stage] = replace(view, fatal=view.fatal or msg.diagnostic)
        return s
    if isinstance(msg, m.WeightsProgress):
        s.views[stage] = replace(view, weights=msg, progress_at=max(view.progress_at, received_at))
        return s
    # From the runner itself: it is alive, and this is when we last heard it.
    view = replace(view, alive=True, last_heard=max(view.last_heard, received_at))
    speed = replace(s.speeds[stage])  # observed on a copy: the state given is never changed
    if isinstance(msg, m.Loading):
        # weights in place: the load itself starts
        view = replace(view, pid=msg.pid, progress_at=max(view.progress_at, received_at))
    elif isinstance(msg, m.Ready):
        view = replace(view, ready=msg)
        for t in msg.warmup:
            speed.observe(t.n, t.context, t.seconds)
    elif isinstance(msg, m.Heartbeat):
        view = replace(view, heartbeat=msg, heartbeat_at=received_at)
        if msg.last_step is not None:
            t = msg.last_step
            speed.observe(t.n, t.context, t.seconds, t.reserve)
    elif isinstance(msg, m.RunnerFailed):
        view = replace(view, failed=view.failed or msg)
    s.views[stage] = view
    s.speeds[stage] = speed
    return s


def _clock(s: ControllerState, now: float, wall: float, effects: list[Effect]) -> None:
    if s.phase == "backoff":
        if now >= s.retry_at:
            effects.append(Lay(next_generation(s.generation, s.term), now))
        return
    why = judge(s, now)
    if why is not None:
        _on_failure(s, why, now, wall, effects)
    elif all_ready(s):
        s.phase = "serving"
        if s.failures and s.failures[-1].recovered_at is None:
            s.failures[-1] = replace(s.failures[-1], recovered_at=now)
        s.kv_bytes_per_token = sum(v.ready.kv_bytes_per_token for v in s.views if v.ready is not None)
        effects.append(Note(logging.INFO, f"instance {s.instance} generation {s.generation} serving"))
        effects.append(ToFronts(_serving(s)))


def _serving(s: ControllerState) -> m.Serving:
    return m.Serving(
        generation=s.generation,
        term=s.term,
        kv_bytes_per_token=s.kv_bytes_per_token,
        kv_budget_bytes=s.kv_budget_bytes,
        kv_block=s.config.prefill_step,
    )


def _on_failure(s: ControllerState, why: str, now: float, wall: float, effects: list[Effect]) -> None:
    effects.append(Note(logging.ERROR, f"instance {s.instance} generation {s.generation}: {why}"))
    pids = [v.pid for v in s.views if v.pid is not None]
    blamed = suspects(s, now)
    s.failures.append(Failure(why, s.generation, now, wall, pids, suspects=blamed))
    if s.reuse and blamed is not None:
        effects += [
            ToAgent(key, m.StopGeneration(instance=s.instance, keep=-1, term=s.term, slots=blamed))
            for key in s.agents
        ]
    else:
        _stop_all(s, effects)
    decision = after_failure(s, why, now)
    if isinstance(decision, GiveUp):
        _give_up(s, decision.why, effects)
        return
    s.phase = "backoff"
    s.retry_at = now + decision.backoff_s
    effects.append(ToFronts(m.Recovering(generation=s.generation, why=why, term=s.term)))


def _give_up(s: ControllerState, why: str, effects: list[Effect]) -> None:
    effects.append(Note(logging.ERROR, f"instance {s.instance} failed: {why}"))
    s.phase = "failed"
    s.failure = why
    _stop_all(s, effects)
    effects.append(ToFronts(m.InstanceFailed(why=why, term=s.term)))


def _stop_all(s: ControllerState, effects: list[Effect]) -> None:
    effects += [ToAgent(key, m.StopGeneration(instance=s.instance, keep=-1, term=s.term)) for key in s.agents]


# ---- judgement and the restart budget ----------------------------------------------------------------------


def _exit_text(e: m.RunnerExited) -> str:
    if e.signal is not None:
        try:
            how = f"killed by {signal.Signals(e.signal).name}"
        except ValueError:
            how = f"killed by signal {e.signal}"
    else:
        how = f"exited with code {e.code}"
    return f"{how}: {' | '.join(e.log_tail) or '(no output)'}"


def _stage_problem(state: ControllerState, now: float, stage: int) -> str | None:
    cfg = state.config
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


def suspects(state: ControllerState, now: float) -> list[int] | None:
    """The stages a failure blames; None when it blames no stage in particular (all are suspect)."""
    bad = {k for k in range(len(state.views)) if _stage_problem(state, now, k) is not None}
    return sorted((bad - set(state.witnesses)) | set(state.fault_stages)) or None


def judge(state: ControllerState, now: float) -> str | None:
    """Why this generation can no longer be trusted, naming the stage; None while it is healthy."""
    if state.phase not in ("starting", "serving"):
        return None
    for stage in range(len(state.views)):
        if (problem := _stage_problem(state, now, stage)) is not None:
            return problem
    if state.fault is not None:
        return state.fault
    if state.phase == "starting":
        # Bring-up is judged from its last sign of progress: copying a large stage is slow, not dead.
        last = max([state.started_at, *(v.progress_at for v in state.views if v.ready is None)])
        load_timeout = state.config.load_timeout
        if now - last > load_timeout:
            waiting = [s for s, v in enumerate(state.views) if v.ready is None]
            return f"stages {waiting} made no progress towards ready for {load_timeout:.0f}s"
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


def after_failure(state: ControllerState, why: str, now: float) -> Retry | GiveUp:
    """Another generation after an exponential backoff, until the restart budget is spent."""
    cfg = state.config
    recent = recent_failures(state.failures, now, cfg.restart_window_s)
    if len(recent) > cfg.max_restarts:
        return GiveUp(f"{why} (gave up after {len(recent)} failures in {cfg.restart_window_s:.0f}s)")
    return Retry(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** max(0, len(recent) - 1)))
