"""The pure decisions, without processes: admission, health judgment, restart budget."""

from __future__ import annotations

import pytest

from shardline.compute.kv import KV_STEP, reservation_bytes
from shardline.controller import state as cs
from shardline.dataplane import messages as m
from shardline.instance.spec import runner_name, runner_spec

CFG = cs.ControllerConfig(stages=2, heartbeat_timeout=2.0, step_deadline_floor=1.0, max_restarts=2)


@pytest.mark.timeout(10)
def test_reservation_counts_whole_cache_steps():
    assert reservation_bytes(1, 1, 10) == KV_STEP * 10
    assert reservation_bytes(KV_STEP, 1, 10) == 2 * KV_STEP * 10
    assert reservation_bytes(30, 400, 1) == 512


def _hear(s: cs.ControllerState, msg: object, generation: int, at: float) -> cs.ControllerState:
    s2, effects = cs.apply(s, cs.Heard(msg, generation, at))
    assert effects == []  # hearing decides nothing: the clock's tick judges
    return s2


def _serving(now: float = 100.0) -> cs.ControllerState:
    s = cs.new_generation(cs.ControllerState(stages=2, config=CFG), now)
    for stage in range(2):
        s = _hear(s, m.Ready(slot=stage, pid=10 + stage, weight_bytes=1, layers=(0, 1)), 0, now)
    s.phase = "serving"
    return s


@pytest.mark.timeout(10)
def test_judge_names_the_stage_and_the_cause():
    s = _serving()
    assert cs.judge(s, 101.0) is None
    assert cs.judge(s, 102.5) == "stage 0 stalled: no heartbeat for 2.5s"
    s = _serving()
    s = _hear(s, m.RunnerExited(generation=0, slot=1, pid=11, signal=9), 0, 100.5)
    assert cs.judge(s, 100.6).startswith("stage 1 killed by SIGKILL")
    s = _serving()
    s = _hear(s, m.RunnerStopped(generation=0, slot=1, pid=11), 0, 100.5)
    assert "stopped (SIGSTOP)" in cs.judge(s, 100.6)


@pytest.mark.timeout(10)
def test_judge_names_a_group_member_by_its_stage_place_and_slot():
    # One stage, a group of 2: slot 1 is stage 0's member 1. A message naming it "stage 1" would send a user
    # to a stage that does not exist (and the master's event to the face's node).
    names = [runner_name(0, 0, 0, 2), runner_name(0, 1, 1, 2)]
    assert names == ["stage 0", "stage 0 member 1 (runner 1)"]
    s = cs.new_generation(cs.ControllerState(stages=2, config=CFG), 100.0, 2, names=names)
    s.phase = "serving"
    s = _hear(s, m.RunnerStopped(generation=0, slot=1, pid=11), 0, 100.5)
    assert cs.judge(s, 100.6) == "stage 0 member 1 (runner 1) stalled: its process is stopped (SIGSTOP)"
    s = cs.new_generation(cs.ControllerState(stages=2, config=CFG), 100.0, 2, names=names)
    s = _hear(s, m.PeerLost(slot=0, peer=1), 0, 100.5)
    assert s.fault == "stage 0 member 1 (runner 1) vanished: stage 0 lost its link to it"
    # Names that do not fit the generation are not used.
    s = cs.new_generation(s, 101.0, 2, names=names[:1])
    assert cs.runner_label(s, 1) == "stage 1"


@pytest.mark.timeout(10)
def test_judge_uses_the_steps_own_deadline_and_arrival_time():
    s = _serving()
    s = _hear(
        s,
        m.Ready(
            slot=1,
            pid=11,
            weight_bytes=1,
            layers=(1, 2),
            warmup=[m.StepTime(n=1, context=1, seconds=0.5), m.StepTime(n=64, context=64, seconds=2.0)],
        ),
        0,
        100.0,
    )
    beat = m.Heartbeat(slot=1, steps=3, busy=True, busy_for_s=4.0, busy_n=64, busy_context=64)
    s = _hear(s, beat, 0, 100.0)
    assert cs.judge(s, 100.1) is None  # 4 s into a step measured at 2 s: within 10x
    big = beat.model_copy(update={"busy_n": 1, "busy_context": 65, "busy_for_s": 4.0})
    s = _hear(s, big, 0, 100.0)
    assert cs.judge(s, 100.1) is None  # a decode step measured at 0.5 s: its deadline is 5 s
    assert "stalled: one step of 1 positions" in cs.judge(s, 101.5)  # 4 s + 1.5 s since arrival


@pytest.mark.timeout(10)
def test_a_step_that_reserves_a_long_prompts_cache_gets_the_time_to_allocate_it():
    """A long prompt's first chunk allocates the KV cache for the whole prompt: slow, and not a stall."""
    s = _serving()
    warmup = [m.StepTime(n=1, context=1, seconds=0.02), m.StepTime(n=128, context=128, seconds=0.2)]
    s = _hear(s, m.Ready(slot=1, pid=11, weight_bytes=1, layers=(1, 2), warmup=warmup), 0, 100.0)
    plain = m.Heartbeat(slot=1, steps=3, busy=True, busy_for_s=3.0, busy_n=128, busy_context=128)
    s = _hear(s, plain, 0, 100.0)
    assert "stalled: one step of 128 positions" in cs.judge(s, 100.1)  # 3 s for a 0.2 s chunk
    reserving = plain.model_copy(update={"busy_reserve": 16385})
    s = _hear(s, reserving, 0, 100.0)
    assert cs.judge(s, 100.1) is None
    late = reserving.model_copy(update={"busy_for_s": 1000.0})
    s = _hear(s, late, 0, 100.0)
    assert "stalled" in cs.judge(s, 100.1)  # bounded all the same


@pytest.mark.timeout(10)
def test_announced_work_extends_the_silence_and_the_step_deadline_by_its_grace():
    """A runner about to hold the GIL (building the constraint tokenizer) or to compile a large grammar says
    how long that may take, in a beat sent before: neither its silence nor its step is a stall within it."""
    s = _serving()
    warmup = [m.StepTime(n=1, context=1, seconds=0.05), m.StepTime(n=64, context=64, seconds=0.1)]
    s = _hear(s, m.Ready(slot=1, pid=11, weight_bytes=1, layers=(1, 2), warmup=warmup), 0, 100.0)
    s = _hear(s, m.Heartbeat(slot=0, steps=1, busy=False), 0, 100.0)
    quiet = m.Heartbeat(slot=1, steps=3, busy=False, grace_s=5.0)
    s = _hear(s, quiet, 0, 100.0)
    assert cs._stage_problem(s, 106.9, 1) is None  # 2 s timeout + 5 s grace
    assert cs._stage_problem(s, 107.1, 1) == "stage 1 stalled: no heartbeat for 7.1s"
    busy = m.Heartbeat(slot=1, steps=3, busy=True, busy_for_s=1.5, busy_n=1, busy_context=65)
    s = _hear(s, busy, 0, 100.0)
    assert "stalled: one step of 1 positions" in cs._stage_problem(s, 100.1, 1)  # 1 s deadline
    s = _hear(s, busy.model_copy(update={"grace_s": 5.0}), 0, 100.0)
    assert cs._stage_problem(s, 100.1, 1) is None
    assert "stalled: one step of 1 positions" in cs._stage_problem(s, 104.6, 1)  # 1.5 + 4.6 > 1 + 5


@pytest.mark.timeout(10)
def test_other_generations_and_stages_are_dropped():
    s = _serving()
    s = _hear(s, m.RunnerExited(generation=7, slot=0, pid=1, code=1), 7, 100.0)
    s = _hear(s, m.Heartbeat(slot=5, steps=1, busy=True, busy_for_s=1e9), 0, 100.0)
    s = _hear(s, m.GenerationFault(generation=3, why="old"), 0, 100.0)
    assert s.dropped == 3 and cs.judge(s, 100.5) is None


@pytest.mark.timeout(10)
def test_restart_budget_backs_off_then_gives_up():
    s = _serving()
    decisions = []
    for i in range(4):
        s.failures.append(cs.Failure("x", 0, 100.0 + i, 0.0, []))
        decisions.append(cs.after_failure(s, "x", 100.0 + i))
    backoffs = [d.backoff_s for d in decisions if isinstance(d, cs.Retry)]
    assert backoffs == [0.2, 0.4]  # doubling
    assert all(isinstance(d, cs.GiveUp) for d in decisions[2:])
    assert "gave up after 3 failures" in decisions[2].why
    later = cs.after_failure(s, "x", 100.0 + 10 * CFG.restart_window_s)
    assert isinstance(later, cs.Retry)  # old failures leave the window


def _launches(generation: int, agents: list[str]) -> list:
    specs = [
        runner_spec(
            {},
            instance="i",
            generation=generation,
            slot=k,
            stages=len(agents),
            layers=(k, k + 1, len(agents)),
            endpoint="tcp/127.0.0.1:7447",
            kv_budget_bytes=0,
        )
        for k in range(len(agents))
    ]
    return [(agent, m.StartRunner(spec=spec, threads=1)) for agent, spec in zip(agents, specs, strict=True)]


@pytest.mark.timeout(10)
def test_the_fold_asks_for_a_layout_starts_its_runners_and_serves_once_all_are_ready():
    s = cs.initial(CFG, attn_keys=64, instance="i", kv_budget_bytes=1 << 20)
    s, effects = cs.apply(s, cs.Begin(100.0))
    assert effects == [cs.Lay(0, 100.0)] and s.phase == "idle"
    launches = _launches(0, ["agent/a", "agent/b"])
    s, effects = cs.apply(s, cs.LaidOut(0, launches, 100.0))
    assert s.phase == "starting" and s.generation == 0 and s.agents == ["agent/a", "agent/b"]
    assert effects == [cs.ToAgent(key, start) for key, start in launches]
    for stage in range(2):
        ready = m.Ready(slot=stage, pid=10 + stage, weight_bytes=1, layers=(0, 1), kv_bytes_per_token=3)
        s, _ = cs.apply(s, cs.Heard(ready, 0, 100.5))
    s, effects = cs.apply(s, cs.Clock(100.6, 0.0))
    assert s.phase == "serving" and s.kv_bytes_per_token == 6
    assert [e.message for e in effects if isinstance(e, cs.ToFronts)] == [
        m.Serving(generation=0, kv_bytes_per_token=6, kv_budget_bytes=1 << 20, kv_block=CFG.prefill_step)
    ]


@pytest.mark.timeout(10)
def test_a_failure_stops_the_agents_backs_off_then_asks_for_the_next_generation():
    s = _serving()
    s.instance, s.agents = "i", ["agent/a"]
    given = s
    s, effects = cs.apply(s, cs.Clock(102.5, 5.0))  # stage 0 silent past the heartbeat timeout
    assert s.phase == "backoff" and s.retry_at == pytest.approx(102.7)
    assert s.failures == [cs.Failure("stage 0 stalled: no heartbeat for 2.5s", 0, 102.5, 5.0, [], [0, 1])]
    assert [type(e) for e in effects] == [cs.Note, cs.ToAgent, cs.ToFronts]
    assert effects[1].message == m.StopGeneration(instance="i", keep=-1)
    assert isinstance(effects[2].message, m.Recovering)
    assert given.phase == "serving" and given.failures == []  # the state given is never changed
    s, effects = cs.apply(s, cs.Clock(102.6, 5.1))
    assert effects == []
    s, effects = cs.apply(s, cs.Clock(102.8, 5.2))
    assert effects == [cs.Lay(1, 102.8)]


@pytest.mark.timeout(10)
def test_another_roles_fault_and_an_abandoned_instance():
    s = _serving()
    s, _ = cs.apply(s, cs.Broken(7, "node k left", [1]))
    assert s.fault is None  # another generation's
    s, _ = cs.apply(s, cs.Broken(0, "node k left", [1]))
    assert cs.judge(s, 100.1) == "node k left" and cs.suspects(s, 100.1) == [1]
    s, effects = cs.apply(s, cs.Abandon("no layout fits"))
    assert s.phase == "failed" and s.failure == "no layout fits"
    assert effects[-1] == cs.ToFronts(m.InstanceFailed(why="no layout fits"))
