"""Sampling: filters keep exactly the right tokens, draws follow softmax(logits / T), replay is deterministic.

Everything runs real MLX sampling; references are computed independently in float64 numpy.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from shardline.compute.sampling import SamplingParams, apply_repetition_penalty, sample

# Chi-square critical values at p = 1e-4 (scipy is not a dependency), by degrees of freedom.
CHI2_CRIT_1E4 = {7: 29.878}


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax64(x: np.ndarray) -> np.ndarray:
    z = x - x.max()
    return z - math.log(np.exp(z).sum())


def expected_allowed(logits: np.ndarray, p: SamplingParams) -> tuple[set[int], np.ndarray, float]:
    """Reference filters in float64, in the implementation's order: top-k, min-p, then top-p on what is left.

    Returns the allowed set, the renormalised distribution and the smallest distance of any value from its
    filter's threshold (the test requires a clear margin so float32 and float64 cannot disagree).
    """
    s = logits.astype(np.float64) / p.temperature
    keep = np.ones(s.shape, dtype=bool)
    margin = math.inf
    if p.top_k and p.top_k < s.size:
        kth = np.sort(s)[-p.top_k]
        keep &= s >= kth
    if p.min_p > 0.0:
        floor = s.max() + math.log(p.min_p)
        margin = min(margin, float(np.abs(s - floor).min()))
        keep &= s >= floor
    if p.top_p < 1.0:
        probs = softmax64(np.where(keep, s, -np.inf))
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # Smallest prefix (by descending probability) whose mass reaches top_p.
        size = int(np.searchsorted(cum, p.top_p)) + 1
        margin = min(margin, float(np.abs(cum - p.top_p).min()))
        top = np.zeros_like(keep)
        top[order[:size]] = True
        keep &= top
    dist = softmax64(np.where(keep, s, -np.inf))
    return {int(i) for i in np.flatnonzero(keep)}, dist, margin


def distinct_logits(vocab: int, seed: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    # Evenly spaced and shuffled: no ties, so every filter's kept set is unambiguous.
    rng = np.random.default_rng(seed)
    return rng.permutation(np.linspace(lo, hi, vocab)).astype(np.float32)


FILTER_CASES = [
    pytest.param(dict(temperature=1.0, top_k=4), id="top_k"),
    pytest.param(dict(temperature=0.8, top_k=1), id="top_k_1"),
    pytest.param(dict(temperature=1.0, top_p=0.9), id="top_p"),
    pytest.param(dict(temperature=1.0, top_p=0.2), id="top_p_single"),
    pytest.param(dict(temperature=1.0, min_p=0.1), id="min_p"),
    # min-p is relative to the tempered distribution: a hotter temperature keeps more tokens.
    pytest.param(dict(temperature=2.0, min_p=0.1), id="min_p_hot"),
    # top-p measures mass after top-k renormalises: 3 tokens kept here, 4 if it used the full softmax.
    pytest.param(dict(temperature=1.0, top_k=4, top_p=0.75), id="top_k_top_p"),
    pytest.param(dict(temperature=1.3, top_k=10, min_p=0.05, top_p=0.8), id="all_three"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("settings", FILTER_CASES)
def test_filters_keep_exactly_the_allowed_set(settings: dict[str, float]) -> None:
    vocab = 16
    logits_np = distinct_logits(vocab, seed=7)
    logits = mx.array(logits_np)
    base = SamplingParams(**settings)
    allowed, dist, margin = expected_allowed(logits_np, base)
    assert margin > 1e-3, "case too close to a filter threshold to be decided in float32"
    assert 0 < len(allowed) < vocab, "case must exclude something and keep something"
    p_min = float(dist[sorted(allowed)].min())
    # Enough draws that missing any allowed token has probability below 1e-9.
    draws = math.ceil(math.log(1e-9) / math.log1p(-p_min)) if p_min < 1.0 else 20
    assert draws <= 2000, "case design: an allowed token is too rare to be seen in a fast test"
    params = [base.model_copy(update={"seed": s}) for s in range(5)]
    seen: set[int] = set()
    for i in range(draws):
        token = sample(logits, params[i % 5], position=i, context=[]).token
        assert token in allowed, f"token {token} drawn outside the allowed set {sorted(allowed)}"
        seen.add(token)
    assert seen == allowed


@pytest.mark.timeout(60)
def test_top_p_renormalises_after_top_k() -> None:
    # Pins the case above: the set differs depending on whether top-p renormalises after top-k.
    logits_np = distinct_logits(16, seed=7)
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.75)
    allowed, _, _ = expected_allowed(logits_np, params)
    assert len(allowed) == 3
    full = softmax64(logits_np.astype(np.float64))
    top4 = np.sort(full)[::-1][:4]
    assert top4[:3].sum() < 0.75, "without renormalisation all 4 would be kept"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("top_p", "kept"), [(0.45, 1), (0.55, 2), (0.7, 2), (0.8, 3), (0.95, 4)])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p: float, kept: int) -> None:
    # Probabilities 1/2, 1/4, 0.15, 0.1 (mass above each: 0, 0.5, 0.75, 0.9); a candidate stays while
    # the mass strictly above it is < top_p, i.e. the smallest prefix whose mass reaches top_p.
    probs = np.array([0.15, 0.5, 0.1, 0.25])
    logits = mx.array(np.log(probs).astype(np.float32))
    want = set([1, 3, 0, 2][:kept])
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(4)]
    seen = {sample(logits, params[i % 4], position=i, context=[]).token for i in range(300)}
    assert seen == want


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_draws_follow_tempered_softmax(temperature: float) -> None:
    logits_np = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2], dtype=np.float32)
    logits = mx.array(logits_np)
    draws = 4000
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    counts = np.zeros(logits_np.size)
    for i in range(draws):
        counts[sample(logits, params[i % 4], position=i, context=[]).token] += 1
    target = softmax64(logits_np.astype(np.float64) / temperature)
    assert (draws * target).min() >= 5, "chi-square needs every expected count >= 5"
    crit = CHI2_CRIT_1E4[logits_np.size - 1]
    assert chi_square(counts, target) < crit
    # The same draws must reject the untempered softmax, or this test could not tell temperatures apart.
    assert chi_square(counts, softmax64(logits_np.astype(np.float64))) > crit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("vocab", [1, 2, 17, 1000])
def test_greedy_picks_argmax(vocab: int) -> None:
    logits_np = distinct_logits(vocab, seed=vocab)
    logits = mx.array(logits_np)
    # Greedy ignores the stochastic filters and the seed.
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5, seed=11)
    tokens = {sample(logits, params, position=pos, context=[]).token for pos in range(20)}
    assert tokens == {int(np.argmax(logits_np))}


@pytest.mark.timeout(60)
def test_same_seed_and_position_replay_and_positions_vary() -> None:
    logits = mx.zeros((64,))  # uniform: any repetition across positions would be a broken key
    params = SamplingParams(temperature=1.0, seed=3)
    first = [sample(logits, params, position=pos, context=[]).token for pos in range(64)]
    # Interleave other draws: no sampler state may leak between calls.
    sample(logits, SamplingParams(temperature=1.0, seed=99), position=5, context=[])
    again = [sample(logits, params, position=pos, context=[]).token for pos in reversed(range(64))]
    assert first == again[::-1]
    assert len(set(first)) > 20, "64 uniform draws over 64 tokens give ~40 distinct values"
    other_seed = [
        sample(logits, SamplingParams(temperature=1.0, seed=4), position=pos, context=[]).token
        for pos in range(64)
    ]
    assert other_seed != first


@pytest.mark.timeout(60)
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_exact_and_leaves_caller_logits_alone(penalty: float) -> None:
    logits = mx.array([2.0, -1.0, 0.5, -3.0, 4.0, 0.0, 1.0, -0.5], dtype=mx.float32)
    before = np.array(logits, copy=True)
    context = [0, 1, 1, 3, 5, 0, 7]
    out = apply_repetition_penalty(logits, context, penalty)
    mx.eval(out)
    assert np.array_equal(np.array(logits), before), "caller's logits were modified"
    want = before.astype(np.float64).copy()
    for t in set(context):
        want[t] = want[t] * penalty if want[t] < 0 else want[t] / penalty
    got = np.array(out).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    untouched = [i for i in range(before.size) if i not in set(context)]
    assert np.array_equal(got[untouched], before[untouched])


@pytest.mark.timeout(60)
def test_repetition_penalty_noop_cases_and_sample_does_not_mutate() -> None:
    logits = mx.array([3.0, 2.9, -1.0, 0.5], dtype=mx.float32)
    before = np.array(logits, copy=True)
    assert np.array_equal(np.array(apply_repetition_penalty(logits, [0, 1], 1.0)), before)
    assert np.array_equal(np.array(apply_repetition_penalty(logits, [], 2.0)), before)
    # Penalising token 0 hands greedy the runner-up, and the caller's array still shows the original.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sample(logits, params, position=0, context=[0]).token == 1
    assert np.array_equal(np.array(logits), before)
    assert sample(logits, params, position=0, context=[]).token == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_log_softmax_of_penalised_logits(temperature: float) -> None:
    vocab = 50
    logits_np = distinct_logits(vocab, seed=5, lo=-4.0, hi=4.0)
    logits = mx.array(logits_np)
    context = [int(np.argmax(logits_np)), 3, 3, 10]
    params = SamplingParams(temperature=temperature, top_k=5, repetition_penalty=1.2, top_logprobs=7, seed=1)
    penalised = logits_np.astype(np.float64).copy()
    for t in set(context):
        penalised[t] = penalised[t] * 1.2 if penalised[t] < 0 else penalised[t] / 1.2
    ref = log_softmax64(penalised)  # untempered: logprobs report the model's distribution
    want_top = [int(i) for i in np.argsort(-ref)[:7]]
    for pos in range(10):
        out = sample(logits, params, position=pos, context=context)
        assert out.logprob == pytest.approx(ref[out.token], abs=1e-5)
        assert [t for t, _ in out.top_logprobs] == want_top
        values = [v for _, v in out.top_logprobs]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, ref[want_top], atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("vocab", "k", "want"), [(5, 20, 5), (50, 0, 0), (50, 1, 1), (50, 20, 20)])
def test_top_logprobs_length(vocab: int, k: int, want: int) -> None:
    logits = mx.array(distinct_logits(vocab, seed=2))
    out = sample(logits, SamplingParams(temperature=1.0, top_logprobs=k), position=0, context=[])
    assert len(out.top_logprobs) == want
    assert len({t for t, _ in out.top_logprobs}) == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("spread", "top_p"), [(8.0, 0.9), (8.0, 0.5), (0.01, 0.9), (0.01, 0.2)])
def test_nucleus_over_a_large_vocabulary_equals_the_full_sort(spread: float, top_p: float) -> None:
    """Peaked logits take the candidates' shortcut; nearly flat ones need more than the candidates hold."""
    from shardline.compute.sampling import NUCLEUS_CANDIDATES, _nucleus

    vocab = 8 * NUCLEUS_CANDIDATES
    logits = mx.random.normal((vocab,), key=mx.random.key(5)) * spread
    probs = np.array(mx.softmax(logits))
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    want = set(order[before < top_p].tolist())
    got = set(np.nonzero(np.array(_nucleus(logits, top_p)) > -np.inf)[0].tolist())
    assert got == want
    if spread < 1:
        assert len(want) > NUCLEUS_CANDIDATES  # the fallback was needed
