"""Sharded greedy output equals single-process mlx-lm, for every chunking edge and stage count."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import STEP, random_prompt

from shardline.testing.reference import Reference

LENGTHS = [1, STEP - 1, STEP, STEP + 1, 5 * STEP + 3]
MAX_TOKENS = 10


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_and_logits_match_single_process(tiny_models, start_engine, arch, stages):
    ref = Reference(tiny_models[arch])
    engine = start_engine(tiny_models[arch], stages)
    for i, n in enumerate(LENGTHS):
        prompt = random_prompt(n, seed=100 * i + n)
        expected, margins, dists = ref.greedy_logprobs(prompt, MAX_TOKENS)
        # The comparison is only meaningful if no greedy choice is a near tie.
        assert min(margins) > 1e-3, f"reference has a near-tied logit (margins {margins})"
        handle = engine.submit(prompt, max_tokens=MAX_TOKENS, want_logits=True)
        got = list(handle)
        assert [t.token for t in got] == expected, f"prompt length {n}"
        want = ref.last_logits(prompt)
        rel = float(mx.abs(got[0].logits - want).max() / mx.abs(want).max())
        assert rel < 1e-4, f"prompt length {n}: last logits differ by {rel:.2e} relative"
        for i, (tok, dist) in enumerate(zip(got, dists, strict=True)):  # every generated position
            mine = tok.logits - mx.logsumexp(tok.logits)
            rel = float(mx.abs(mine - dist).max() / mx.abs(dist).max())
            assert rel < 1e-4, f"prompt length {n}, token {i}: log-probabilities differ by {rel:.2e}"
        assert handle.finish_reason == "length"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("concurrent", [2, 4])
def test_concurrent_requests_equal_alone(tiny_models, start_engine, concurrent):
    model = tiny_models["qwen3"]
    ref = Reference(model)
    engine = start_engine(model, 2)
    prompts = [random_prompt(3 + 7 * i * i, seed=7 + i) for i in range(concurrent)]
    lengths = [6 + 3 * i for i in range(concurrent)]
    expected = [ref.greedy(p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
    handles = [engine.submit(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    got = [h.tokens(timeout=120) for h in handles]
    assert got == expected


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stages", [1, 2])
def test_tiled_attention_path_matches_single_process(tiny_models, start_engine, stages):
    """A tiny score budget forces key-tiled attention on every chunk past the first."""
    ref = Reference(tiny_models["llama"])
    engine = start_engine(tiny_models["llama"], stages, score_budget=64)
    prompt = random_prompt(9 * STEP + 5, seed=11)
    expected, margins = ref.greedy(prompt, MAX_TOKENS)
    assert min(margins) > 1e-3
    got = list(engine.submit(prompt, max_tokens=MAX_TOKENS, want_logits=True))
    assert [t.token for t in got] == expected
    want = ref.last_logits(prompt)
    assert float(mx.abs(got[0].logits - want).max() / mx.abs(want).max()) < 1e-4
