"""Real failures of real runner processes: every request completes with the fault-free tokens.

The matrix: stage 0, the middle and the last stage, during load, warm-up, prefill of a long prompt and
decode, each hit by SIGKILL, SIGSTOP, an exception, and a ring-abort line followed by a hang. The runner
signals itself at the exact phase (a real signal, delivered by the kernel); later tests also signal runners
from outside at a moment the test picks.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import FAST, STEP, assert_no_runner_left, random_prompt

from shardline.engine.engine import EngineError
from shardline.errors import RequestError
from shardline.instance.spec import Fault
from shardline.testing.reference import Reference

DETECT_MARGIN = 2.0  # seconds beyond the configured deadline: monitor tick, signal delivery, a loaded CI box
PROMPT_LEN = 75 * STEP  # a long prompt: 75 chunks
MAX_TOKENS = 12
PHASE_STEPS = {"load": 0, "warmup": 0, "prefill": 20, "decode": 75 + 5}
ACTIONS = ["sigkill", "sigstop", "raise", "ring_abort"]


def _all_pids(engine) -> list[int]:
    return engine.runner_pids()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return Reference(tiny_models["llama"])


@pytest.fixture(scope="module")
def long_case(reference):
    prompt = random_prompt(PROMPT_LEN, seed=99)
    return prompt, reference.greedy(prompt, MAX_TOKENS)[0]


def _fault_time(engine, stage: int) -> float:
    """When the runner says it injected its fault (wall clock, written just before it acts)."""
    text = engine.stage_log(stage).read_text()
    stamps = [float(line.rsplit(" at ", 1)[1]) for line in text.splitlines() if "fault injected" in line]
    assert stamps, f"stage {stage} never injected its fault"
    return stamps[0]


def _detect_deadline(action: str) -> float:
    # SIGSTOP is seen when heartbeats stop; the others at once (exit, typed failure, fatal diagnostic).
    return FAST["heartbeat_timeout"] if action == "sigstop" else 0.5


# Every (phase, action) pair once; the stage rotates so that every (stage, phase) and (stage, action) pair is
# covered too: 16 runs instead of 48, no pair of factors left out.
MATRIX = [
    (((p + a) % 3), phase, action) for p, phase in enumerate(PHASE_STEPS) for a, action in enumerate(ACTIONS)
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "phase", "action"), MATRIX)
def test_failure_matrix_recovers_exactly(tiny_models, start_engine, long_case, stage, phase, action):
    prompt, expected = long_case
    fault = Fault(phase=phase, action=action, after_steps=PHASE_STEPS[phase])
    engine = start_engine(tiny_models["llama"], 3, faults={stage: fault}, **FAST)
    handle = engine.submit(prompt, max_tokens=MAX_TOKENS)
    assert handle.tokens(timeout=100) == expected
    assert engine.recoveries, "the failure was never detected"
    rec = engine.recoveries[0]
    assert f"stage {stage}" in rec.why, rec.why  # the failed stage is named, not guessed
    fault_at = _fault_time(engine, stage)
    assert rec.detected_wall - fault_at < _detect_deadline(action) + DETECT_MARGIN, (rec, fault_at)
    assert rec.recovered_at is not None
    assert_no_runner_left(rec.pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "sig"), [(0, signal.SIGKILL), (1, signal.SIGSTOP)], ids=["0-SIGKILL", "1-SIGSTOP"]
)
def test_external_signal_during_decode_resumes_exactly(tiny_models, start_engine, reference, stage, sig):
    engine = start_engine(tiny_models["llama"], 3, **FAST)
    prompt = random_prompt(19, seed=stage)
    expected = reference.greedy(prompt, 300)[0]
    old = _all_pids(engine)
    got, killed_at = [], 0.0
    for tok in engine.submit(prompt, max_tokens=300):
        got.append(tok.token)
        if len(got) == 5:
            killed_at = time.monotonic()
            os.kill(old[stage], sig)
    assert got == expected
    rec = engine.recoveries[0]
    assert f"stage {stage}" in rec.why, rec.why
    deadline = FAST["heartbeat_timeout"] if sig == signal.SIGSTOP else 0.5
    assert rec.detected_at - killed_at < deadline + DETECT_MARGIN, rec
    assert rec.recovered_at is not None and rec.requests_resumed == 1
    assert_no_runner_left(old)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2])
def test_external_sigkill_during_long_prefill_resumes_exactly(tiny_models, start_engine, reference, stage):
    engine = start_engine(tiny_models["llama"], 3, **FAST)
    prompt = random_prompt(2000, seed=40 + stage)  # 250 chunks of 8
    expected = reference.greedy(prompt, 6)[0]
    old = _all_pids(engine)
    handle = engine.submit(prompt, max_tokens=6)
    os.kill(old[stage], signal.SIGKILL)
    assert handle.tokens(timeout=100) == expected
    assert engine.recoveries and engine.recoveries[0].recovered_at is not None
    assert_no_runner_left(old)


@pytest.mark.timeout(120)
def test_fast_resume_continues_the_stream(tiny_models, start_engine, reference):
    """One prefill of prompt + emitted: the stream continues without gaps or duplicates."""
    engine = start_engine(
        tiny_models["llama"],
        2,
        resume="fast",
        faults={1: Fault(phase="decode", action="sigkill", after_steps=12)},
        **FAST,
    )
    prompt = random_prompt(30, seed=8)
    handle = engine.submit(prompt, max_tokens=25)
    tokens = list(handle)
    assert [t.index for t in tokens] == list(range(25))
    assert engine.recoveries and engine.recoveries[0].requests_resumed == 1
    # Tiny models keep wide margins, so here even the fast path reproduces greedy output.
    assert [t.token for t in tokens] == reference.greedy(prompt, 25)[0]


@pytest.mark.timeout(120)
def test_crash_loop_at_start_ends_in_clear_error(tiny_models, start_engine):
    started = time.monotonic()
    with pytest.raises(EngineError, match="gave up after 3 failures"):
        start_engine(
            tiny_models["llama"],
            2,
            faults={1: Fault(phase="load", action="raise")},
            faults_every_generation=True,
            max_restarts=2,
            **FAST,
        )
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_crash_loop_in_decode_fails_the_waiting_request(tiny_models, start_engine):
    engine = start_engine(
        tiny_models["llama"],
        2,
        faults={1: Fault(phase="decode", action="exit", after_steps=3)},
        faults_every_generation=True,
        max_restarts=2,
        **FAST,
    )
    handle = engine.submit(random_prompt(10, seed=3), max_tokens=50)
    with pytest.raises(RequestError, match="gave up"):
        handle.tokens(timeout=100)
    pids = [p for rec in engine.recoveries for p in rec.pids]
    assert_no_runner_left(pids)
