"""Deadlines scale with the work: slow-but-progressing is never dead, a hang and a lost message always are."""

from __future__ import annotations

import re

import pytest
from conftest import FAST, random_prompt

from shardline.instance.deadline import DeadlinePolicy, Speed, work
from shardline.instance.spec import Fault
from shardline.testing.reference import Reference


@pytest.fixture(scope="module")
def reference(tiny_models):
    return Reference(tiny_models["llama"])


# ---- the rule itself ------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_deadline_grows_with_chunk_size_and_context():
    speed = Speed(attn_keys=384)
    speed.observe(1, 1, 0.02)  # warm-up: one position
    speed.observe(256, 256, 0.5)  # warm-up: one chunk
    policy = DeadlinePolicy(floor=0.1, ceiling=1000.0, slack=10.0)
    decode = policy.step(speed, 1, 100)
    chunk = policy.step(speed, 256, 256)
    late_chunk = policy.step(speed, 256, 8192)
    assert decode < chunk < late_chunk
    assert chunk == pytest.approx(10 * 0.5, rel=0.01)  # the measured chunk, with the slack
    assert work(256, 8192, 384) > 20 * work(256, 0, 384)


@pytest.mark.timeout(10)
def test_deadline_grows_with_the_cache_a_step_reserves():
    speed = Speed(attn_keys=384)
    speed.observe(1, 1, 0.02)
    speed.observe(128, 128, 0.2)
    policy = DeadlinePolicy(floor=0.1, ceiling=1000.0, slack=10.0)
    plain = policy.step(speed, 128, 128)
    small, large = policy.step(speed, 128, 128, reserve=1024), policy.step(speed, 128, 128, reserve=16384)
    assert plain < small < large
    assert large - plain == pytest.approx(16 * (small - plain), rel=1e-6)  # proportional to the reserve
    # A reserving step's allocation is not read as slow compute: later steps keep their deadlines.
    speed.observe(128, 128, 0.2 + 0.1 * 16384 * speed.per_work_s, reserve=16384)
    assert policy.step(speed, 128, 128) == pytest.approx(plain, rel=1e-6)


@pytest.mark.timeout(10)
def test_deadline_is_clamped_and_speed_only_grows():
    speed = Speed(attn_keys=100)
    policy = DeadlinePolicy(floor=2.0, ceiling=30.0, slack=10.0)
    assert policy.step(speed, 255, 255) == 30.0  # nothing measured yet: the ceiling, whatever the size
    speed.observe(1, 1, 0.01)
    assert policy.step(speed, 1, 1) == 2.0  # a fast step: the floor
    # A decode step says nothing about a prefill chunk: until one is measured, the chunk gets the ceiling
    # (a CI run called the ring's first 255-position warm-up step stalled at the 2 s floor).
    assert policy.step(speed, 255, 255) == 30.0
    speed.observe(255, 255, 0.05)
    assert policy.step(speed, 255, 255) == 2.0
    speed.observe(8, 8, 100.0)
    assert policy.step(speed, 8, 8) == 30.0  # a monster step: the ceiling
    before = speed.estimate(8, 8)
    speed.observe(8, 8, 0.001)  # one fast step does not shorten what a slow one proved
    assert speed.estimate(8, 8) == before


# ---- real processes -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_slow_stage_completes_without_recovery(tiny_models, start_engine, reference):
    """Every step of stage 1 takes 3x the deadline floor, from warm-up on: slow, not dead."""
    slow = Fault(phase="warmup", action="slow", seconds=1.5)
    engine = start_engine(tiny_models["llama"], 2, faults={1: slow}, **{**FAST, "step_deadline_floor": 0.5})
    prompt = random_prompt(12, seed=4)  # 2 chunks of 8, then decode
    expected = reference.greedy(prompt, 3)[0]
    assert engine.submit(prompt, max_tokens=3).tokens(timeout=90) == expected
    assert engine.recoveries == []
    beats = engine.fresh_heartbeats(10)
    assert beats[1].last_step is not None and beats[1].last_step.seconds >= 1.5  # it really was slow


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_hang_is_caught_by_the_step_deadline_while_heartbeats_flow(
    tiny_models, start_engine, reference, phase
):
    after = {"prefill": 4, "decode": 12}[phase]
    hang = Fault(phase=phase, action="hang", after_steps=after)
    engine = start_engine(tiny_models["llama"], 2, faults={1: hang}, **FAST)
    prompt = random_prompt(40, seed=5)  # 5 chunks of 8
    expected = reference.greedy(prompt, 12)[0]
    assert engine.submit(prompt, max_tokens=12).tokens(timeout=90) == expected
    assert len(engine.recoveries) == 1
    why = engine.recoveries[0].why
    assert why.startswith("stage 1 stalled: one step of"), why  # the controller's deadline, not silence


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_hang_is_caught_by_the_runners_own_watchdog(tiny_models, start_engine, reference, phase):
    """With the watchdog earlier than the controller's deadline, the wedged runner exits by itself."""
    after = {"prefill": 4, "decode": 12}[phase]
    hang = Fault(phase=phase, action="hang", after_steps=after)
    engine = start_engine(tiny_models["llama"], 2, faults={1: hang}, watchdog_factor=0.3, **FAST)
    prompt = random_prompt(40, seed=6)
    expected = reference.greedy(prompt, 12)[0]
    assert engine.submit(prompt, max_tokens=12).tokens(timeout=90) == expected
    assert len(engine.recoveries) == 1
    why = engine.recoveries[0].why
    # Its last words (the typed status, or the same line read from its output) name the watchdog.
    assert why.startswith("stage 1") and "(deadline): step running for" in why, why


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "action", "names"),
    [
        (1, "drop_message", r"stage 0 .*\(deadline\).*result of step \d+ not back"),  # never comes back
        (0, "drop_token", r"lost message: token \d+ of \w+ arrived while the client holds"),  # a gap
    ],
    ids=["result", "token"],
)
def test_dropped_message_costs_one_recovery_and_no_token(
    tiny_models, start_engine, reference, stage, action, names
):
    drop = Fault(phase="decode", action=action, after_steps=10)
    engine = start_engine(tiny_models["llama"], 2, faults={stage: drop}, **FAST)
    prompt = random_prompt(20, seed=7)
    expected = reference.greedy(prompt, 16)[0]
    handle = engine.submit(prompt, max_tokens=16)
    got = list(handle.stream(timeout=90))
    assert [t.token for t in got] == expected  # the exact text, never a shortened answer
    assert [t.index for t in got] == list(range(16))
    assert handle.finish_reason == "length"
    assert len(engine.recoveries) == 1
    assert re.search(names, engine.recoveries[0].why), engine.recoveries[0].why
