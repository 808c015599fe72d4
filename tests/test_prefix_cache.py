"""The prefix cache end to end: conversations and shared prompts give the same tokens and the same logits,
bit for bit, with the cache and without it, on 1 to 3 stages, under eviction and through a killed stage."""

from __future__ import annotations

import os
import signal
import threading

import mlx.core as mx
import pytest
from conftest import FAST, STEP, assert_no_runner_left, random_prompt

from shardline.engine.engine import Engine

REPLY = 6


Result = tuple[list[int], list[mx.array], int]  # tokens, their logits, prompt tokens found cached


def _run(engine: Engine, prompt: list[int]) -> Result:
    handle = engine.submit(prompt, max_tokens=REPLY, want_logits=True)
    got = list(handle)
    return [t.token for t in got], [t.logits for t in got], handle.cached_tokens


def _same(
    a: tuple[list[int], list[mx.array], int],
    b: tuple[list[int], list[mx.array], int],
    what: str,
    exact: bool = True,
) -> None:
    """Equal tokens and logits: bit for bit, or (exact=False) within the rounding of a decode step batched
    with other requests' rows, whose products may sum in another order than a lone row's."""
    assert a[0] == b[0], f"{what}: tokens differ"
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        if exact:
            assert mx.array_equal(x, y).item(), f"{what}: logits of token {i} differ"
        else:
            rel = float(mx.abs(x - y).max() / mx.abs(y).max())
            assert rel < 1e-5, f"{what}: logits of token {i} differ by {rel:.1e} relative"


def _clean(engine: Engine) -> None:
    """No stage refused a step (an attach of blocks it lacks, say) and nothing failed."""
    assert not engine.recoveries
    assert not any(h.dropped for h in engine.fresh_heartbeats(10))


def _conversation(seed: int, turns: int) -> tuple[list[int], list[list[int]]]:
    system = random_prompt(3 * STEP + 2 + seed, seed=seed)
    users = [random_prompt(4 + 3 * i + seed, seed=1000 * seed + i) for i in range(turns)]
    return system, users


def _talk(engine: Engine, system: list[int], users: list[list[int]]) -> list[tuple]:
    """Each turn's prompt is the conversation so far (replies included) and the next user message."""
    history, out = list(system), []
    for user in users:
        prompt = history + user
        result = _run(engine, prompt)
        out.append((prompt, result))
        history = prompt + result[0]
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_conversations_are_identical_with_and_without_the_cache(tiny_models, start_engine, stages):
    cached = start_engine(tiny_models["llama"], stages)
    plain = start_engine(tiny_models["llama"], stages, prefix_cache=False)
    for seed in range(3):
        turns = _talk(cached, *_conversation(seed, 4))
        for i, (prompt, result) in enumerate(turns):
            _same(result, _run(plain, prompt), f"conversation {seed}, turn {i}")
            if i:  # every later turn starts after the whole blocks of the one before
                assert result[2] >= (len(turns[i - 1][0]) // STEP) * STEP
        assert turns[0][1][2] == 0
    _clean(cached)


@pytest.mark.timeout(240)
def test_concurrent_requests_sharing_a_prompt_equal_each_alone(tiny_models, start_engine):
    cached = start_engine(tiny_models["qwen3"], 2)
    plain = start_engine(tiny_models["qwen3"], 2, prefix_cache=False)
    system = random_prompt(6 * STEP, seed=5)
    prompts = [system + random_prompt(1 + 2 * i, seed=50 + i) for i in range(6)] + [system, system]
    results: list[tuple | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = _run(cached, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i, prompt in enumerate(prompts):
        assert results[i] is not None
        # Concurrent, their decode steps run as rows of one batch; alone, as one row.
        _same(results[i], _run(plain, prompt), f"request {i}", exact=False)  # type: ignore[arg-type]
    # The first to run computed the system prompt; the others started after its blocks.
    assert sum(1 for r in results if r and r[2] >= 5 * STEP) >= len(prompts) - 1


@pytest.mark.timeout(240)
def test_eviction_under_a_small_budget_changes_nothing(tiny_models, start_engine):
    plain = start_engine(tiny_models["llama"], 2, prefix_cache=False)
    per_token = plain.front.kv_bytes_per_token
    assert per_token > 0
    # Room for about two conversations' blocks: later turns evict the oldest.
    cached = start_engine(tiny_models["llama"], 2, kv_budget_bytes=per_token * 14 * STEP)
    conversations = [_conversation(seed, 3) for seed in range(4)]
    for round_ in range(2):
        for seed, (system, users) in enumerate(conversations):
            for i, (prompt, result) in enumerate(_talk(cached, system, users)):
                _same(result, _run(plain, prompt), f"round {round_}, conversation {seed}, turn {i}")
    _clean(cached)


@pytest.mark.timeout(240)
def test_a_stage_killed_mid_conversation_changes_nothing(tiny_models, start_engine):
    cached = start_engine(tiny_models["llama"], 2, **FAST)
    plain = start_engine(tiny_models["llama"], 2, prefix_cache=False)
    system, users = _conversation(7, 4)
    before = _talk(cached, system, users[:2])
    history = before[-1][0] + before[-1][1][0]
    old = cached.all_runner_pids()
    # Turn 3, with stage 1 killed after its second token: resumed on a new generation, empty caches.
    prompt = history + users[2]
    handle = cached.submit(prompt, max_tokens=REPLY, want_logits=True)
    got = []
    for tok in handle:
        got.append(tok)
        if len(got) == 2:
            os.kill(old[1], signal.SIGKILL)
    assert cached.recoveries and cached.recoveries[0].recovered_at is not None
    _same(([t.token for t in got], [t.logits for t in got], 0), _run(plain, prompt), "turn 3")
    history = prompt + [t.token for t in got]
    # Turn 4 on the new generation: the resubmitted turn 3 filled its cache again.
    prompt = history + users[3]
    result = _run(cached, prompt)
    _same(result, _run(plain, prompt), "turn 4")
    assert result[2] > 0
    assert_no_runner_left(old)
