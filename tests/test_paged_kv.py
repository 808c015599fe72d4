"""A paged KV cache computes the bits of mlx-lm's contiguous KVCache, and shares blocks without copies.

Every comparison is bitwise: the blocks hold the values the contiguous buffer holds and attention walks the
positions in the same order (the same tiles in prefill, one pass over the segments in native decode)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from shardline.compute import _qmm
from shardline.compute.attention import BoundedAttention, tiled_causal_attention
from shardline.compute.paged_kv import BlockSeq, PagedKV
from shardline.compute.shard import LayerRange, Shard, load_shard
from shardline.models.registry import resolve_model

Caches = list[PagedKV] | list[KVCache]


def _contiguous(shard: Shard) -> list[KVCache]:
    return [KVCache() for _ in shard.layers]


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.randint(0, 200, (1, n), key=mx.random.key(seed))


def _run(
    shard: Shard, cache: Caches, prompt: mx.array, chunk: int, decode: int, start: int = 0
) -> list[mx.array]:
    """Every step's output: the prompt from `start` in chunks of `chunk` (boundaries at multiples of it
    from 0), then `decode` single positions."""
    outs = []
    pos = start
    while pos < prompt.shape[1]:
        stop = min((pos // chunk + 1) * chunk, prompt.shape[1])
        outs.append(shard.forward(prompt[:, pos:stop], cache))
        mx.eval(outs[-1])
        pos = stop
    for i in range(decode):
        outs.append(shard.forward(mx.array([[5 + 3 * i]]), cache))
        mx.eval(outs[-1])
    return outs


def _assert_same(got: list[mx.array], want: list[mx.array], label: object) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and mx.array_equal(g, w).item(), (label, i)


def _python_decode(shard: Shard) -> Shard:
    """The shard without its native decode plans: mlx-lm's blocks (lone) and `decode_block` (rows)."""
    shard.plans = [None] * len(shard.layers)
    shard.fast_decode = False
    return shard


LOADERS: dict[str, Callable[[Path], Shard]] = {
    "native": load_shard,
    "python": lambda path: _python_decode(load_shard(path)),
}


@pytest.fixture(scope="module")
def shards(tiny_models: dict[str, Path]) -> dict[tuple[str, str], Shard]:
    return {(arch, kind): load(tiny_models[arch]) for arch in tiny_models for kind, load in LOADERS.items()}


# --- the cache alone --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("block", "writes"), [(8, [1, 3, 4, 8, 13, 1, 20]), (4, [9]), (16, [16, 16, 1]), (5, [1] * 12)]
)
def test_blocks_hold_what_the_contiguous_cache_holds(block, writes):
    paged, flat = PagedKV(block), KVCache()
    for i, n in enumerate(writes):
        k, v = (mx.random.normal((1, 2, n, 8), key=mx.random.key(10 * i + j)) for j in range(2))
        got_k, got_v = paged.update_and_fetch(k, v)
        want_k, want_v = flat.update_and_fetch(k, v)
        assert isinstance(got_k, BlockSeq) and got_k.shape == want_k.shape and got_k.dtype == want_k.dtype
        assert mx.array_equal(got_k.concat(), want_k).item() and mx.array_equal(got_v.concat(), want_v).item()
        segs_k, segs_v = paged.segments()
        assert mx.array_equal(mx.concatenate(segs_k, axis=2), want_k).item()
        assert mx.array_equal(mx.concatenate(segs_v, axis=2), want_v).item()
        assert paged.offset == flat.offset
        assert len(list(paged.blocks_held())) == 2 * -(-paged.offset // block)
        assert paged.nbytes == sum(b.nbytes for b in paged.blocks_held())
    length = paged.offset
    seq_k, _ = paged.update_and_fetch(mx.zeros((1, 2, 0, 8)), mx.zeros((1, 2, 0, 8)))
    for start in range(length):
        for stop in range(start + 1, length + 1):
            assert mx.array_equal(seq_k.slice(start, stop), want_k[:, :, start:stop]).item(), (start, stop)
    for n in (1, 7):  # as mlx-lm's models ask (base.create_attention_mask)
        h = mx.zeros((1, n, 4))
        for return_array in (False, True):
            got = create_attention_mask(h, paged, return_array=return_array)
            want = create_attention_mask(h, flat, return_array=return_array)
            assert type(got) is type(want)
            assert not isinstance(want, mx.array) or mx.array_equal(got, want).item()


@pytest.mark.timeout(60)
def test_a_shared_block_is_never_written():
    block = 4
    owner = PagedKV(block)
    owner.append(*(mx.random.normal((1, 2, 10, 8), key=mx.random.key(j)) for j in range(2)))
    shared = [owner.block_pair(0), owner.block_pair(1)]
    before = [np.array(a) for pair in shared for a in pair]
    ids = [id(a) for pair in shared for a in pair]
    sharer = PagedKV(block, shared)
    assert sharer.offset == 2 * block
    for n in (1, 3, 1, 6):
        sharer.update_and_fetch(
            *(mx.random.normal((1, 2, n, 8), key=mx.random.key(50 + n)) for _ in range(2))
        )
        mx.eval(*sharer.segments())
    assert [id(a) for i in range(2) for a in sharer.block_pair(i)] == ids  # the very arrays, not copies
    after = [np.array(a) for i in range(2) for a in sharer.block_pair(i)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(
        np.array_equal(np.array(a), b) for a, b in zip((a for p in shared for a in p), before, strict=True)
    )
    with pytest.raises(ValueError, match="positions"):
        PagedKV(8, shared)  # blocks of another size


def _address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


@pytest.mark.timeout(60)
def test_a_decode_write_lands_in_place():
    """A step's write goes into the last block's own buffer even after the native op read the segments:
    a held view of the block would make MLX copy the whole block at every position."""
    cache = PagedKV(64)
    cache.append(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    mx.eval(cache.block_pair(0))
    address = _address(cache.block_pair(0)[0])
    for _ in range(5):
        cache.append(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
        out = _qmm.decode_attention(mx.ones((1, 1, 16)), *cache.segments(), 0.5)
        mx.eval(out)
        assert _address(cache.block_pair(0)[0]) == address


@pytest.mark.timeout(60)
@pytest.mark.parametrize("writes", [[8], [3, 8, 5], [20]])
def test_blocks_are_laid_out_by_head_whatever_the_writes(writes):
    """Keys arrive from the projections positions-outer; a block filled by one write must not keep that
    layout (the decode op would read its rows strided, measurably slower)."""
    cache = PagedKV(8)
    for n in writes:
        k = mx.random.normal((1, n, 2, 16)).transpose(0, 2, 1, 3)
        cache.append(k, k)
    for block in cache.blocks_held():
        mx.eval(block)
        assert np.asarray(block).strides == (2 * 8 * 16 * 4, 8 * 16 * 4, 16 * 4, 4)


# --- the native op ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cuts", [[0, 1], [0, 64, 128], [0, 1, 2, 50, 51, 300], [0, 100, 228, 300], [0, 37]])
def test_native_decode_attention_over_segments_equals_one_array(cuts):
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    q = mx.random.normal((1, 1, heads * dim), key=mx.random.key(1))
    # Each segment a view into a larger block, as a paged cache's last block is handed out.
    blocks_k = [mx.random.normal((1, kv_heads, 256, dim), key=mx.random.key(2 + i)) for i in range(len(cuts))]
    blocks_v = [
        mx.random.normal((1, kv_heads, 256, dim), key=mx.random.key(90 + i)) for i in range(len(cuts))
    ]
    lens = [b - a for a, b in pairwise(cuts)]
    segs_k = [blk[:, :, :n] for blk, n in zip(blocks_k, lens, strict=False)]
    segs_v = [blk[:, :, :n] for blk, n in zip(blocks_v, lens, strict=False)]
    joined_k, joined_v = mx.concatenate(segs_k, axis=2), mx.concatenate(segs_v, axis=2)
    got = _qmm.decode_attention(q, segs_k, segs_v, scale)
    want = _qmm.decode_attention(q, [joined_k], [joined_v], scale)
    assert mx.array_equal(got, want).item()
    with pytest.raises(ValueError, match="segments"):
        _qmm.decode_attention(q, segs_k, segs_v[:-1] + [segs_v[-1][:, :1]] * 2, scale)


# --- attention over blocks --------------------------------------------------------------------------------


def _paged(k: mx.array, v: mx.array, block: int) -> tuple[BlockSeq, BlockSeq]:
    cache = PagedKV(block)
    return cache.update_and_fetch(k, v)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("n", "length", "tile", "block"), [(8, 40, 8, 8), (8, 41, 16, 7), (5, 100, 64, 16), (16, 200, 7, 32)]
)
def test_tiles_over_blocks_equal_tiles_over_one_array(n, length, tile, block):
    keys = mx.random.split(mx.random.key(length), 3)
    q = mx.random.normal((1, 6, n, 16), key=keys[0])
    k = mx.random.normal((1, 2, length, 16), key=keys[1])
    v = mx.random.normal((1, 2, length, 16), key=keys[2])
    pk, pv = _paged(k, v, block)
    for fast_exp in (False, True):
        want = tiled_causal_attention(q, k, v, 0.25, tile, fast_exp)
        assert mx.array_equal(tiled_causal_attention(q, pk, pv, 0.25, tile, fast_exp), want).item()


def _stock(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):  # type: ignore[no-untyped-def]  # mlx-lm's
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.timeout(60)
def test_bounded_attention_takes_blocks_on_every_path():
    keys = mx.random.split(mx.random.key(3), 3)
    k = mx.random.normal((1, 2, 50, 16), key=keys[1])
    v = mx.random.normal((1, 2, 50, 16), key=keys[2])
    pk, pv = _paged(k, v, 8)
    bounded = BoundedAttention(_stock, 64)
    for n, mask in ((1, None), (6, "causal"), (6, mx.ones((6, 50), dtype=mx.bool_))):
        q = mx.random.normal((1, 6, n, 16), key=keys[0])
        want = bounded(q, k, v, cache=None, scale=0.25, mask=mask)
        assert mx.array_equal(bounded(q, pk, pv, cache=None, scale=0.25, mask=mask), want).item(), n


@pytest.mark.timeout(120)
def test_prefill_scratch_over_blocks_does_not_grow_with_the_context():
    """Tiles join only the blocks they span: a chunk's peak over a long paged context stays a short one's."""
    n, budget, block = 32, 32 * 256, 64  # tiles of 256 keys, each joining 4 blocks
    bounded = BoundedAttention(_stock, budget)

    def scratch(length: int) -> int:
        keys = mx.random.split(mx.random.key(length), 3)
        q = mx.random.normal((1, 8, n, 64), key=keys[0])
        cache = PagedKV(block)
        for start in range(0, length, block):  # filled a block at a time, as a prefill does
            size = min(block, length - start)
            cache.append(*(mx.random.normal((1, 2, size, 64), key=keys[i]) for i in (1, 2)))
            mx.eval(*cache.segments())
        pk, pv = cache.update_and_fetch(mx.zeros((1, 2, 0, 64)), mx.zeros((1, 2, 0, 64)))
        mx.eval(q)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(bounded(q, pk, pv, cache=None, scale=0.125, mask="causal"))
        return mx.get_peak_memory() - base

    short, long = scratch(1024), scratch(16384)
    assert long < 1.25 * short, (short, long)


# --- whole shards: paged equals contiguous ----------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("block", "chunk"), [(8, 8), (8, 5), (4, 13), (16, 64)])
def test_prefill_then_decode_equals_contiguous(shards, arch, kind, block, chunk):
    shard = shards[arch, kind]
    prompt = _tokens(45, seed=block + chunk)
    want = _run(shard, _contiguous(shard), prompt, chunk, decode=6)
    got = _run(shard, shard.make_cache(block), prompt, chunk, decode=6)
    _assert_same(got, want, (arch, kind, block, chunk))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_rows_equal_contiguous(shards, arch, kind):
    """Rows of different lengths (one of them exactly at a block's end) decode to the contiguous bits."""
    shard, block = shards[arch, kind], 8
    lengths = [3, 16, 41]

    def prefilled(make: Callable[[], Caches]) -> list[Caches]:
        caches = []
        for i, n in enumerate(lengths):
            cache = make()
            mx.eval(shard.forward(_tokens(n, seed=i), cache))
            caches.append(cache)
        return caches

    paged, flat = prefilled(lambda: shard.make_cache(block)), prefilled(lambda: _contiguous(shard))
    for step in range(10):  # the first row crosses into its second block, the second into its third
        tokens = mx.array([[7 + step], [11 + step], [13 + step]])
        got, want = shard.forward_rows(tokens, paged), shard.forward_rows(tokens, flat)
        mx.eval(got, want)
        assert mx.array_equal(got, want).item(), (arch, kind, step)
    alone_got = shard.forward_rows(mx.array([[3]]), paged[1:2])
    alone_want = shard.forward_rows(mx.array([[3]]), flat[1:2])
    assert mx.array_equal(alone_got, alone_want).item()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_request_continues_from_shared_blocks(shards, arch, kind):
    """Request B starts from the first 3 full blocks request A filled (the same 24 prompt tokens) and must
    compute what it computes from scratch with the same chunk boundaries; A's blocks stay untouched and A
    goes on as if nothing had shared them."""
    shard, block, shared_blocks = shards[arch, kind], 8, 3
    prompt_a = _tokens(37, seed=1)
    prompt_b = mx.concatenate([prompt_a[:, : block * shared_blocks], _tokens(19, seed=2)], axis=1)
    cache_a = shard.make_cache(block)
    _run(shard, cache_a, prompt_a, block, decode=0)
    shared = [[c.block_pair(i) for i in range(shared_blocks)] for c in cache_a]
    before = [np.array(a) for layer in shared for pair in layer for a in pair]

    want = _run(shard, shard.make_cache(block), prompt_b, block, decode=5)
    cache_b = shard.make_cache(block, shared)
    assert all(c.offset == block * shared_blocks for c in cache_b)
    got = _run(shard, cache_b, prompt_b, block, decode=5, start=block * shared_blocks)
    _assert_same(got, want[shared_blocks:], (arch, kind))

    after = [np.array(a) for layer in shared for pair in layer for a in pair]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    for layer_a, layer_b in zip(cache_a, cache_b, strict=True):
        for i in range(shared_blocks):
            assert all(x is y for x, y in zip(layer_a.block_pair(i), layer_b.block_pair(i), strict=True))
    fresh = shard.make_cache(block)
    _run(shard, fresh, prompt_a, block, decode=0)
    steps = [mx.array([[9]]), mx.array([[4]])]
    for x in steps:
        assert mx.array_equal(shard.forward(x, cache_a), shard.forward(x, fresh)).item()
    with pytest.raises(ValueError, match="layers"):
        shard.make_cache(block, shared[:-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_paged_equals_contiguous():
    """The default model's first stage: chunks of 40 in tiles of 64 keys over blocks of 96, then rows."""
    shard = load_shard(resolve_model(None, progress=False), LayerRange(0, 15, 30), score_budget=40 * 64)
    prompt = mx.random.randint(0, 1000, (1, 230), key=mx.random.key(0))
    flat, paged = _contiguous(shard), shard.make_cache(96)
    _assert_same(_run(shard, paged, prompt, 40, decode=4), _run(shard, flat, prompt, 40, decode=4), "alone")
    others = [(shard.make_cache(96), _contiguous(shard)) for _ in range(2)]
    for i, (p, f) in enumerate(others):
        _run(shard, p, prompt[:, : 50 + 60 * i], 40, decode=0)
        _run(shard, f, prompt[:, : 50 + 60 * i], 40, decode=0)
    rows_paged, rows_flat = [paged, *(p for p, _ in others)], [flat, *(f for _, f in others)]
    for step in range(3):
        tokens = mx.array([[7 + step], [11 + step], [13 + step]])
        got, want = shard.forward_rows(tokens, rows_paged), shard.forward_rows(tokens, rows_flat)
        assert mx.array_equal(got, want).item(), step
