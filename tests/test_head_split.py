"""A tied output head split between the first and the last stage computes the full model's logits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shardline.compute.shard import LayerRange, load_shard, split_layers

BLOCK = 16  # KV positions per cache block: small, so that a request's cache spans several


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_split_head_logits_equal_whole_model(tiny_models, arch):
    model = tiny_models[arch]
    whole = load_shard(model)
    first_range, last_range = split_layers(whole.range.total, 2)
    first, last = load_shard(model, first_range), load_shard(model, last_range)
    vocab = int(whole.config["vocab_size"])
    assert whole.head_split == 0  # one stage holds the whole head
    assert first.head_split == last.head_split == vocab // 2

    x = mx.random.randint(0, vocab, (1, 9), key=mx.random.key(3))
    want = whole.forward(x, whole.make_cache(BLOCK))
    packed = last.forward(first.forward(x, first.make_cache(BLOCK)), last.make_cache(BLOCK))
    assert packed.shape == (whole.hidden_size + vocab - vocab // 2,)
    got = first.finish_head(packed)
    assert got.shape == want.shape == (vocab,)
    assert float(mx.abs(got - want).max() / mx.abs(want).max()) < 1e-5

    # Batched decode rows take the same path: (rows, D + upper) -> (rows, vocab).
    rows = mx.random.normal((3, 1, whole.hidden_size), key=mx.random.key(4))
    caches = [last.make_cache(BLOCK) for _ in range(3)]
    for c in caches:  # each row continues a one-token context
        last.forward(mx.random.normal((1, 1, whole.hidden_size), key=mx.random.key(5)), c)
    assert first.finish_head(last.forward_rows(rows, caches)).shape == (3, vocab)


@pytest.mark.timeout(60)
def test_head_is_not_split_without_tied_weights_or_between_middle_stages(tiny_models):
    llama = tiny_models["llama"]  # untied: the last stage holds lm_head alone
    total = load_shard(llama).range.total
    assert all(load_shard(llama, r).head_split == 0 for r in split_layers(total, 2))
    qwen = tiny_models["qwen2"]
    total = load_shard(qwen).range.total
    middle = split_layers(total, 3)[1]
    assert load_shard(qwen, LayerRange(middle.start, middle.end, total)).head_split == 0
