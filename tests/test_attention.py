"""Bounded attention equals the stock kernel for every tiling of the keys."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shardline.compute.attention import BoundedAttention, tiled_causal_attention


def _stock(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):  # mlx-lm's signature
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _qkv(n: int, length: int, heads: int = 6, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, heads, n, dim), key=keys[0])
    k = mx.random.normal((1, kv_heads, length, dim), key=keys[1])
    v = mx.random.normal((1, kv_heads, length, dim), key=keys[2])
    return q, k, v


TILINGS = [(8, 8, 3), (8, 40, 8), (8, 41, 16), (5, 100, 64), (16, 200, 7)]  # queries, keys, keys per tile


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "length", "block"), TILINGS)
def test_tiled_equals_stock(n, length, block):
    q, k, v = _qkv(n, length, seed=n + length)
    want = _stock(q, k, v, scale=0.25, mask="causal")
    got = tiled_causal_attention(q, k, v, 0.25, block)
    assert float(mx.abs(got - want).max()) < 1e-5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", [1, 64, 8 * 24, 8 * 1000])
def test_bounded_attention_equals_stock_at_any_budget(budget):
    q, k, v = _qkv(8, 96, seed=budget)
    bounded = BoundedAttention(_stock, budget)
    got = bounded(q, k, v, cache=None, scale=0.25, mask="causal")
    want = _stock(q, k, v, scale=0.25, mask="causal")
    assert float(mx.abs(got - want).max()) < 1e-5


@pytest.mark.timeout(60)
def test_scratch_does_not_grow_with_the_context():
    """Past the budget the peak above the inputs stays flat, however many keys a chunk attends to."""
    n, budget = 32, 32 * 256
    bounded = BoundedAttention(_stock, budget)

    def scratch(length: int) -> int:
        q, k, v = _qkv(n, length, heads=8, kv_heads=2, dim=64, seed=length)
        mx.eval(q, k, v)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(bounded(q, k, v, cache=None, scale=0.125, mask="causal"))
        return mx.get_peak_memory() - base

    at_budget, short, long = scratch(256), scratch(1024), scratch(16384)
    assert long <= 1.2 * short, (short, long)
    assert short <= 2 * at_budget, (at_budget, short)  # and near the stock kernel's at the budget


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "length", "block"), TILINGS)
def test_fast_exp_tiled_equals_stock(n, length, block):
    q, k, v = _qkv(n, length, seed=3 * n + length)
    want = _stock(q, k, v, scale=0.25, mask="causal")
    got = tiled_causal_attention(q, k, v, 0.25, block, fast_exp=True)
    assert float(mx.abs(got - want).max()) < 1e-5


@pytest.mark.timeout(60)
def test_fast_exp_on_model_shaped_scores():
    """Scaled like a real model's heads (wide logits, keys far below the maximum): the stock answer."""
    q, k, v = _qkv(128, 1500, heads=9, kv_heads=3, dim=64, seed=7)
    q = q * 4.0  # scores spread over tens of units, so many keys sit far below each row's maximum
    want = _stock(q, k, v, scale=0.125, mask="causal")
    got = BoundedAttention(_stock, 128 * 768)(q, k, v, cache=None, scale=0.125, mask="causal")
    assert float(mx.abs(got - want).max()) < 1e-4


@pytest.mark.timeout(60)
def test_bench_attention_times_every_kernel_and_checks_them():
    from shardline.bench.attention import measure

    out = measure({"heads": 4, "kv_heads": 2, "head_dim": 16}, [64, 200], n=8, rounds=2)
    assert set(out) == {"64", "200"}
    for figures in out.values():
        assert set(figures["seconds"]) == {"stock", "tiled_exp", "runner"}
        assert all(len(t) == 2 and min(t) > 0 for t in figures["seconds"].values())
        assert max(figures["max_abs_error"].values()) < 1e-5


@pytest.mark.timeout(60)
def test_decode_position_equals_stock():
    """One query position (decode) takes `decode_attention` on CPU: the stock result, grouped heads too."""
    q, k, v = _qkv(1, 57, seed=5)
    want = _stock(q, k, v, scale=0.25)
    got = BoundedAttention(_stock)(q, k, v, cache=None, scale=0.25, mask=None)
    assert got.shape == want.shape
    assert float(mx.abs(got - want).max()) < 1e-5
