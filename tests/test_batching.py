"""Continuous batching: concurrent requests share decode steps, and each gets what it would get alone.

The runners here use the reference BLAS, whose rows do not depend on how many rows a matmul has, so a
batched request must equal itself alone bit for bit: this checks the batching logic (caches, positions,
sampling per row), not a kernel. OpenBLAS picks kernels by row count, so there a row can differ in the last
bits; `shardline bench engine` counts what that changes on the default model (`batched_outputs_mismatched`).
"""

from __future__ import annotations

import threading

import pytest
from conftest import FAST, random_prompt, wait_for

from shardline.compute.sampling import SamplingParams
from shardline.instance.spec import Fault

REQUESTS = 6


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setenv("SHARDLINE_BLAS", "reference")


def _cases() -> list[tuple[list[int], int, SamplingParams]]:
    cases = []
    for i in range(REQUESTS):
        # Varied prompts (one chunk, several, a partial one) and lengths, so requests leave at different
        # times; every other request samples with its own seed.
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i) if i % 2 else SamplingParams()
        cases.append((random_prompt(3 + 5 * i * i, seed=70 + i), 8 + 3 * i, sampling))
    return cases


def _alone(engine, cases) -> list[list[int]]:
    return [engine.submit(p, max_tokens=n, sampling=s).tokens(timeout=60) for p, n, s in cases]


def _staggered(engine, cases) -> list[list[int]]:
    """Request k joins once request k-1 has streamed two tokens: requests join and leave mid-batch."""
    got: list[list[int]] = [[] for _ in cases]
    threads = []
    for k, (p, n, s) in enumerate(cases):
        if k:
            wait_for(lambda k=k: len(got[k - 1]) >= 2, 60, f"request {k - 1} decoding")
        handle = engine.submit(p, max_tokens=n, sampling=s)

        def follow(k: int = k, handle=handle) -> None:
            for t in handle:
                got[k].append(t.token)

        threads.append(threading.Thread(target=follow))
        threads[-1].start()
    for t in threads:
        t.join(timeout=120)
    return got


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_batched_requests_equal_each_alone(tiny_models, start_engine, exact, stages):
    engine = start_engine(tiny_models["qwen3"], stages)
    cases = _cases()
    alone = _alone(engine, cases)
    assert [len(a) for a in alone] == [n for _, n, _ in cases]
    assert _staggered(engine, cases) == alone
    # All at once as well: the widest batches.
    handles = [engine.submit(p, max_tokens=n, sampling=s) for p, n, s in cases]
    assert [h.tokens(timeout=120) for h in handles] == alone


@pytest.mark.timeout(240)
def test_batches_are_formed(tiny_models, start_engine, exact):
    """Concurrent streams take fewer ring steps than they have tokens: several ride in one step."""
    engine = start_engine(tiny_models["llama"], 2)
    cases = [(random_prompt(4, seed=90 + i), 30, SamplingParams()) for i in range(4)]
    before = sum(h.steps for h in engine.fresh_heartbeats(30) if h.slot == 0)
    handles = [engine.submit(p, max_tokens=n, sampling=s) for p, n, s in cases]
    tokens = sum(len(h.tokens(timeout=120)) for h in handles)
    after = sum(h.steps for h in engine.fresh_heartbeats(30) if h.slot == 0)
    assert tokens == 120
    assert after - before < 0.75 * tokens  # one step per token would be 120 (plus 4 prompt steps)


@pytest.mark.timeout(240)
def test_batched_requests_survive_sigkill_exactly(tiny_models, start_engine, exact):
    cases = _cases()[:4]
    clean = start_engine(tiny_models["llama"], 2)
    alone = _alone(clean, cases)
    clean.shutdown()
    engine = start_engine(
        tiny_models["llama"], 2, faults={1: Fault(phase="decode", action="sigkill", after_steps=10)}, **FAST
    )
    handles = [engine.submit(p, max_tokens=n, sampling=s) for p, n, s in cases]
    assert [h.tokens(timeout=120) for h in handles] == alone
    assert engine.recoveries and engine.recoveries[0].requests_resumed == len(cases)
