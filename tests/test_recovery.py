"""Real failures of real runner processes: every request completes with the fault-free tokens."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from conftest import assert_no_runner_left, random_prompt

from shardline.engine.engine import EngineError
from shardline.engine.request import RequestError
from shardline.runner.spec import Fault
from shardline.testing.reference import Reference

FAST = dict(
    heartbeat_s=0.2,
    heartbeat_timeout=1.5,
    step_deadline_floor=1.0,
    step_timeout=5.0,
    backoff_s=0.05,
)
DETECT_MARGIN = 2.0  # seconds beyond the configured deadline: monitor tick, signal delivery, a loaded CI box


def _all_pids(engine) -> list[int]:
    return [r.proc.pid for r in engine.runners]


@pytest.fixture(scope="module")
def reference(tiny_models):
    return Reference(tiny_models["llama"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_signal_during_decode_resumes_exactly(tiny_models, start_engine, reference, stage, sig):
    engine = start_engine(tiny_models["llama"], 3, **FAST)
    prompt = random_prompt(19, seed=stage)
    expected = reference.greedy(prompt, 300)[0]
    old = _all_pids(engine)
    got, killed_at = [], None
    for tok in engine.submit(prompt, max_tokens=300):
        got.append(tok.token)
        if len(got) == 5:
            killed_at = time.monotonic()
            os.kill(old[stage], sig)
    assert got == expected
    assert engine.recoveries, "the failure was never detected"
    rec = engine.recoveries[0]
    assert f"stage {stage}" in rec.why, rec.why  # the failed stage is named, not guessed
    deadline = FAST["heartbeat_timeout"] if sig == signal.SIGSTOP else 0.5
    assert rec.detected_at - killed_at < deadline + DETECT_MARGIN, rec
    assert rec.recovered_at is not None and rec.requests_resumed == 1
    assert_no_runner_left(old)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2])
def test_sigkill_during_long_prefill_resumes_exactly(tiny_models, start_engine, reference, stage):
    engine = start_engine(tiny_models["llama"], 3, **FAST)
    prompt = random_prompt(2000, seed=40 + stage)  # 250 chunks of 8
    expected = reference.greedy(prompt, 6)[0]
    old = _all_pids(engine)
    handle = engine.submit(prompt, max_tokens=6)
    os.kill(old[stage], signal.SIGKILL)
    assert handle.tokens(timeout=100) == expected
    assert engine.recoveries and engine.recoveries[0].recovered_at is not None
    assert_no_runner_left(old)


INJECTED = [
    (0, Fault(phase="load", action="raise")),
    (1, Fault(phase="warmup", action="exit")),
    (2, Fault(phase="load", action="ring_abort")),
    (1, Fault(phase="prefill", action="raise", after_steps=3)),
    (2, Fault(phase="prefill", action="ring_abort", after_steps=2)),
    (0, Fault(phase="decode", action="raise", after_steps=12)),
    (1, Fault(phase="decode", action="hang", after_steps=12)),
    (2, Fault(phase="decode", action="ring_abort", after_steps=12)),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "fault"), INJECTED, ids=[f"{s}-{f.phase}-{f.action}" for s, f in INJECTED])
def test_injected_failure_is_recovered(tiny_models, start_engine, reference, stage, fault):
    engine = start_engine(tiny_models["llama"], 3, faults={stage: fault}, **FAST)
    prompt = random_prompt(45, seed=7)
    expected = reference.greedy(prompt, 20)[0]
    assert engine.submit(prompt, max_tokens=20).tokens(timeout=100) == expected
    assert engine.recoveries, "the injected failure was never seen"
    assert f"stage {stage}" in engine.recoveries[0].why
    if fault.action == "hang":
        assert "stalled" in engine.recoveries[0].why


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
    pids = _all_pids(engine)
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
