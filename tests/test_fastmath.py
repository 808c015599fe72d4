"""The vectorised exponentials against MLX's own."""

import math

import mlx.core as mx
import pytest

from shardline.compute.fastmath import exp2_nonpositive, logsumexp


@pytest.mark.timeout(60)
def test_exp2_nonpositive_matches_exp2_without_subnormals():
    x = mx.concatenate(
        [mx.linspace(-125.0, 0.0, 200_001), mx.array([-126.0, -126.5, -200.0, -1e30, -math.inf])]
    )
    got = exp2_nonpositive(x)
    want = mx.power(2.0, x)
    normal = x >= -125.0
    rel = mx.abs(got - want) / mx.maximum(want, 1e-38)
    assert float(mx.where(normal, rel, 0.0).max()) < 1e-6
    # At and below 2**-126 the result is exactly 0, and nothing anywhere is a subnormal.
    assert float(mx.where(normal, 0.0, got).max()) == 0.0
    assert bool(mx.all((got == 0) | (got >= 2.0**-126)).item())
    assert float(exp2_nonpositive(mx.array([0.0])).item()) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spread", [0.1, 5.0, 40.0, 300.0])
def test_logsumexp_matches_mlx(spread):
    x = mx.random.normal((49_152,), key=mx.random.key(7)) * spread
    assert float(logsumexp(x).item()) == pytest.approx(
        float(mx.logsumexp(x).item()), abs=2e-6 * spread + 1e-6
    )


@pytest.mark.timeout(60)
def test_logsumexp_edges():
    assert float(logsumexp(mx.array([-math.inf, -math.inf])).item()) == -math.inf
    assert float(logsumexp(mx.array([-math.inf, 0.0])).item()) == pytest.approx(0.0, abs=1e-6)
    assert float(logsumexp(mx.array([1e30, 0.0])).item()) == pytest.approx(1e30)
