"""A stage's decode of several requests at once computes, for each, the bits it computes alone.

With the bundled reference BLAS (this process's) a matmul's row does not depend on the other rows, so any
difference would come from the batched block itself: its cache updates, positions or attention."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shardline.compute.shard import load_shard

BLOCK = 16  # KV positions per cache block: small, so that a request's cache spans several


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rows_equal_each_alone_bitwise(tiny_models, arch):
    assert_rows_equal_each_alone(load_shard(tiny_models[arch]), arch)


def assert_rows_equal_each_alone(shard, label: str) -> None:
    """Three requests of different lengths, 3 decode steps: batched rows give each request its lone bits."""
    lengths = [3, 17, 40]

    def prefilled(n: int, seed: int) -> list:
        cache = shard.make_cache(BLOCK)
        prompt = mx.random.randint(0, 200, (1, n), key=mx.random.key(seed))
        mx.eval(shard.forward(prompt, cache))
        return cache

    alone = [prefilled(n, i) for i, n in enumerate(lengths)]
    together = [prefilled(n, i) for i, n in enumerate(lengths)]
    for step in range(3):
        tokens = mx.array([[7 + step], [11 + step], [13 + step]])
        want = [shard.forward(tokens[i : i + 1], alone[i]) for i in range(len(lengths))]
        got = shard.forward_rows(tokens, together)
        mx.eval(want, got)
        for i in range(len(lengths)):
            assert mx.array_equal(want[i], got[i]).item(), (label, step, i)
