"""Every request ends, cancel is request state, admission bounds KV, and garbage changes nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from conftest import FAST, PROMPTS, STEP, random_prompt

from shardline.compute.kv import reservation_bytes
from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Keys, Outbox, open_session
from shardline.instance.spec import Fault
from shardline.testing.reference import Reference


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait on a condition with a deadline (polling state other threads change)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        tick.wait(0.02)


def wait_kv_idle(engine, timeout: float = 20.0) -> list[m.Heartbeat]:
    """Heartbeats sent after the call, until every stage holds no request and no KV beyond the prefix
    cache's blocks (the prompt blocks a finished request leaves behind)."""
    deadline = time.monotonic() + timeout
    while True:
        beats = engine.fresh_heartbeats(10)
        if all(b.kv_bytes == b.kv_cached_bytes and b.requests == 0 for b in beats):
            return beats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV never returned to idle: {[(b.slot, b.kv_bytes) for b in beats]}")


@pytest.fixture(scope="module")
def reference(tiny_models):
    return Reference(tiny_models["llama"])


@pytest.mark.timeout(120)
def test_cancel_releases_kv_on_every_stage(tiny_models, start_engine):
    engine = start_engine(tiny_models["llama"], 3, **FAST)
    handle = engine.submit(random_prompt(50, seed=1), max_tokens=2000)
    for n, _ in enumerate(handle.stream(timeout=60), 1):
        if n == 3:
            busy = engine.fresh_heartbeats(10)
            assert all(b.kv_bytes > 0 for b in busy)  # every stage holds the request's KV now
            handle.cancel()
    assert handle.finish_reason == "cancelled"
    wait_kv_idle(engine)


@pytest.mark.timeout(120)
def test_cancel_just_before_a_kill_is_not_resumed(tiny_models, start_engine, reference):
    engine = start_engine(tiny_models["llama"], 2, **FAST)
    pids = engine.runner_pids()
    handle = engine.submit(random_prompt(30, seed=2), max_tokens=2000)
    for n, _ in enumerate(handle.stream(timeout=60), 1):
        if n == 3:
            handle.cancel()
            os.kill(pids[1], signal.SIGKILL)
    assert handle.finish_reason == "cancelled" and 3 <= len(handle.state.generated) < 2000
    assert engine.wait_recovered(1, 60)
    assert engine.recoveries[0].requests_resumed == 0
    wait_kv_idle(engine)
    prompt = random_prompt(15, seed=3)
    assert engine.submit(prompt, max_tokens=6).tokens(timeout=60) == reference.greedy(prompt, 6)[0]


@pytest.mark.timeout(120)
def test_cancel_during_the_rebuild_is_not_resumed(tiny_models, start_engine):
    engine = start_engine(tiny_models["llama"], 2, **{**FAST, "backoff_s": 1.5})
    pids = engine.runner_pids()
    handle = engine.submit(random_prompt(30, seed=4), max_tokens=2000)
    stream = handle.stream(timeout=60)
    for _ in range(3):
        next(stream)
    os.kill(pids[0], signal.SIGKILL)
    wait_for(lambda: not engine.front.serving.is_set(), 20, "the front hears of the recovery")
    handle.cancel()
    assert list(stream) == [] or handle.finish_reason == "cancelled"
    assert handle.finish_reason == "cancelled"
    assert engine.wait_recovered(1, 60)
    assert engine.recoveries[0].requests_resumed == 0
    wait_kv_idle(engine)


@pytest.mark.timeout(180)
def test_recovery_with_concurrent_greedy_and_seeded_requests(tiny_models, start_engine):
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 23, 41, 70)]
    lengths = [30, 22, 26, 18]
    samplings = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(),
        SamplingParams(temperature=1.2, top_p=0.9, seed=12),
    ]

    def run(engine) -> list[list[int]]:
        handles = [
            engine.submit(p, max_tokens=n, sampling=s)
            for p, n, s in zip(prompts, lengths, samplings, strict=True)
        ]
        return [h.tokens(timeout=120) for h in handles]

    expected = run(start_engine(tiny_models["llama"], 2, **FAST))
    faulty = start_engine(
        tiny_models["llama"], 2, faults={1: Fault(phase="decode", action="sigkill", after_steps=40)}, **FAST
    )
    assert run(faulty) == expected
    assert len(faulty.recoveries) == 1  # one fault, one recovery
    assert faulty.recoveries[0].requests_resumed >= 1


@pytest.mark.timeout(240)
def test_admission_reserves_kv_as_used_and_preempts_rather_than_refuses(tiny_models, start_engine, reference):
    per_token = 6 * 2 * 2 * 16 * 4  # tiny llama: layers x (k, v) x kv heads x head dim x float32
    big = reservation_bytes(30, 400, per_token, STEP)  # KV comes in blocks of one prefill chunk
    budget = 2 * big  # two long requests, grown to their end, fill it: four must take turns
    engine = start_engine(tiny_models["llama"], 2, kv_budget_bytes=budget, **FAST)
    long_prompts = [random_prompt(30, seed=100 + i) for i in range(4)]
    short_prompts = [random_prompt(20 + i, seed=200 + i) for i in range(28)]
    expected = [reference.greedy(p, 400)[0] for p in long_prompts]
    expected += [reference.greedy(p, 10)[0] for p in short_prompts]

    handles = [engine.submit(p, max_tokens=400) for p in long_prompts]
    assert engine.front.kv_bytes_per_token == per_token
    handles += [engine.submit(p, max_tokens=10) for p in short_prompts]
    # What a request holds is what it has used: many run at once (reserving max_tokens, two would), the
    # newest go back to the queue when the long ones outgrow the budget, and recompute their tokens exactly
    # when admitted again.
    wait_for(lambda: engine.front.running() >= 8, 60, "more requests running than two at their end")
    assert [h.tokens(timeout=200) for h in handles] == expected
    beats = engine.fresh_heartbeats(10)
    peak = sum(b.kv_peak_bytes for b in beats)
    assert budget / 2 < peak <= budget, (peak, budget)
    assert engine.recoveries == []


@pytest.mark.timeout(120)
def test_garbage_and_other_generations_change_nothing(tiny_models, start_engine, reference):
    engine = start_engine(tiny_models["llama"], 2, **FAST)
    prompt = random_prompt(25, seed=6)
    expected = reference.greedy(prompt, 60)[0]
    gen = engine.generation
    keys = Keys(engine.instance, gen)
    handle = engine.submit(prompt, max_tokens=60)
    peer = open_session([], [engine.endpoint])
    stale = gen + 1
    rid = handle.request_id
    forged = {
        keys.ring(0): m.StepResult(seq=1, request_id=rid, token=7),
        keys.ring(1): m.Step(seq=1, request_id=rid, pos=0, n=1),
        keys.control: m.Cancel(front="x", seq=0, request_id=rid),
        keys.events: m.TokenEvent(request_id=rid, index=3, token=1, logprob=0.0),
        keys.status(0): m.Heartbeat(slot=0, steps=1, busy=True, busy_for_s=1e6, busy_n=1),
        keys.status(1): m.RunnerFailed(slot=1, reason="compute", message="forged"),
    }
    try:
        stream = handle.stream(timeout=60)
        got = [next(stream).token for _ in range(5)]  # decoding now
        outboxes = []
        for key, message in forged.items():
            garbage, other = Outbox(peer, key, gen), Outbox(peer, key, stale)
            garbage.wait_matched(10)
            other.wait_matched(10)
            garbage.send_raw(b"\x00\x01garbage")
            garbage.send_raw(b"\xff" * 64)
            other.send(message)  # well-formed, but of a generation that is not current
            outboxes += [garbage, other]
        for key in (keys.reports, keys.updates, engine.agent_key):
            raw = Outbox(peer, key)
            raw.wait_matched(10)
            raw.send_raw(b"not a frame")
            outboxes.append(raw)
        got += [t.token for t in stream]
        assert got == expected
        assert engine.recoveries == [] and engine.failure is None
        beats = engine.fresh_heartbeats(10)
        assert beats[0].dropped >= 6 and beats[1].dropped >= 3, [b.dropped for b in beats]
        dropped = engine.dropped()
        assert dropped["front"] >= 3 and dropped["controller"] >= 5, dropped
    finally:
        peer.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_eight_requests_without_max_tokens_run_at_once_on_the_default_model(
    model_dir, tokenizer, start_engine
):
    from shardline.cluster.placement import DEFAULT_RESERVE_TOKENS, PlacementRequest
    from shardline.models.footprint import footprint_from_dir

    fp = footprint_from_dir(model_dir)
    # The KV budget a cluster gives the default model's instance (cluster/master_state.py): its default
    # sequences of min(context, 4096) tokens.
    sequences = PlacementRequest().sequences * min(fp.context_length, DEFAULT_RESERVE_TOKENS)
    budget = fp.kv_bytes_per_token_per_layer * fp.layers * sequences
    engine = start_engine(model_dir, 2, prefill_step=64, kv_budget_bytes=budget)
    handles = []
    for question in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        # No max_tokens: what the API allows then is the rest of the context. No end token either, so
        # that none ends while the others start.
        handles.append(engine.submit(ids, max_tokens=fp.context_length - len(ids), stop_tokens=[]))

    def all_running() -> bool:
        return all(h.state.generated for h in handles)

    wait_for(all_running, 300, "a first token of every request")
    assert not any(h.done for h in handles)  # all eight at once: none waited for another to end
    wait_for(lambda: engine.front.running() == len(PROMPTS), 30, "the leader admitting all eight")
    print(f"requests without max_tokens running at once: {engine.front.running()} of {len(PROMPTS)}")
    for h in handles:
        h.cancel()
