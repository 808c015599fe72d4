"""One layer's KV cache of one request in fixed-size blocks, so that requests can share a prompt's blocks.

mlx-lm's `KVCache` keeps one contiguous buffer and grows it by concatenation, so a prefix it holds cannot
be handed to another request without a copy. Here positions live in blocks of `block` positions: a request
may start from blocks that another one filled (`shared`), and only its own last, partly filled block is
ever written. A write is a slice assignment into that block, which MLX performs in place while nothing else
holds the block's buffer (a held view or a sharer would make it copy, never change what they see).

The values stored are the contiguous cache's, and every reader walks positions in the same order, so the
attention computed over a `PagedKV` is bit for bit the attention over a `KVCache` with the same contents.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask


class BlockSeq:
    """The valid positions of a cache's blocks, as `update_and_fetch` hands them to attention: readers
    take whole ranges (`concat`) or tiles (`slice`) without ever joining more blocks than they touch.

    `blocks` is the cache's own list (the cache only appends to it, and a write to its last block leaves
    the positions before `length` as they were), so this stays valid for the step that fetched it."""

    __slots__ = ("block", "blocks", "length")

    def __init__(self, blocks: list[mx.array], length: int, block: int) -> None:
        self.blocks = blocks
        self.length = length
        self.block = block

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, heads, _, dim = self.blocks[0].shape
        return (b, heads, self.length, dim)

    @property
    def dtype(self) -> mx.Dtype:
        return self.blocks[0].dtype

    def concat(self) -> mx.array:
        """All valid positions as one array (1, Hkv, length, D)."""
        return self.slice(0, self.length)

    def slice(self, start: int, stop: int) -> mx.array:
        """Positions [start, stop) as one array: a view where they lie in one block, else the touched
        blocks' parts joined."""
        if not 0 <= start < stop <= self.length:
            raise ValueError(f"positions [{start}, {stop}) out of the {self.length} held")
        size = self.block
        pieces = []
        for i in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start - i * size, 0), min(stop - i * size, size)
            blk = self.blocks[i]
            pieces.append(blk if lo == 0 and hi == size else blk[..., lo:hi, :])
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


class PagedKV:
    """One layer's KV of one request: keys (1, Hkv, block, D) and values (1, Hkv, block, Dv) per block,
    each block allocated when the first position lands in it.

    `shared` blocks are full and owned by others too (a prefix cache, other requests): they are read,
    never written, and the cache starts after them (`offset`)."""

    def __init__(self, block: int, shared: Sequence[tuple[mx.array, mx.array]] = ()) -> None:
        if block < 1:
            raise ValueError(f"block must be positive, got {block}")
        for k, v in shared:
            if k.shape[2] != block or v.shape[2] != block:
                raise ValueError(f"a shared block holds {k.shape[2]} positions, not {block}")
        self.block = block
        self.shared = len(shared)
        self.offset = len(shared) * block  # mlx-lm reads it for the positions (RoPE)
        self._keys: list[mx.array] = [k for k, _ in shared]
        self._values: list[mx.array] = [v for _, v in shared]
        # What the native decode op reads: every full block, then a view of the valid part of the last
        # one (made on demand, dropped before the next write so that the write stays in place).
        self._key_segs: list[mx.array] = list(self._keys)
        self._value_segs: list[mx.array] = list(self._values)
        self._tail_view = False

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Store n new positions: keys (1, Hkv, n, D), values (1, Hkv, n, Dv)."""
        if self._tail_view:
            self._key_segs.pop()
            self._value_segs.pop()
            self._tail_view = False
        n, size = keys.shape[2], self.block
        at = self.offset % size
        if at and at + n < size:  # a decode position, inside the last block and not filling it
            self._keys[-1][..., at : at + n, :] = keys
            self._values[-1][..., at : at + n, :] = values
            self.offset += n
            return
        done = 0
        while done < n:
            at = self.offset % size
            take = min(size - at, n - done)
            # The usual case writes the arrays as given, not a slice of them.
            k = keys if take == n else keys[..., done : done + take, :]
            v = values if take == n else values[..., done : done + take, :]
            if take == size:
                # A whole block at once: MLX would make the assignment return the update itself, in the
                # projections' layout (positions outer, heads inner), which the decode op then reads
                # strided and measurably slower; the block is laid out (1, Hkv, block, D) instead.
                self._keys.append(mx.contiguous(k))
                self._values.append(mx.contiguous(v))
            else:
                if at == 0:  # every block is full: a new one
                    b, heads, _, dim = keys.shape
                    self._keys.append(mx.zeros((b, heads, size, dim), keys.dtype))
                    self._values.append(mx.zeros((b, heads, size, values.shape[3]), values.dtype))
                self._keys[-1][..., at : at + take, :] = k
                self._values[-1][..., at : at + take, :] = v
            done += take
            self.offset += take
            if at + take == size:  # the block is full from here on: never written again
                self._key_segs.append(self._keys[-1])
                self._value_segs.append(self._values[-1])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[BlockSeq, BlockSeq]:
        """mlx-lm's cache protocol: store the new positions, return every valid one (as BlockSeq)."""
        self.append(keys, values)
        return BlockSeq(self._keys, self.offset, self.block), BlockSeq(self._values, self.offset, self.block)

    def segments(self) -> tuple[list[mx.array], list[mx.array]]:
        """The valid parts of the blocks, in order: full blocks as they are, the last one sliced to its
        valid length. The lists are the cache's own: read them before the next write."""
        valid = self.offset % self.block
        if valid and not self._tail_view:
            self._key_segs.append(self._keys[-1][..., :valid, :])
            self._value_segs.append(self._values[-1][..., :valid, :])
            self._tail_view = True
        return self._key_segs, self._value_segs

    def block_pair(self, i: int) -> tuple[mx.array, mx.array]:
        """Block i's keys and values (full once i < offset // block: the ones a prefix cache may keep)."""
        return self._keys[i], self._values[i]

    def blocks_held(self) -> Iterator[mx.array]:
        """Every key and value block this cache holds, shared ones included (for counting unique bytes)."""
        yield from self._keys
        yield from self._values

    @property
    def nbytes(self) -> int:
        """Bytes of all the blocks it holds, shared ones included."""
        if not self._keys:
            return 0
        return len(self._keys) * (self._keys[0].nbytes + self._values[0].nbytes)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        """As mlx-lm's KVCache: "causal" for a chunk, None for one position."""
        return create_attention_mask(*args, offset=self.offset, **kwargs)
