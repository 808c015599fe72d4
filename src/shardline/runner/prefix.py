"""The prefix cache's decisions, on the leader: which prompt blocks are cached, who uses them, what goes.

A block is `block` prompt positions (the prefill chunk), named by a hash chain over the tokens from the
start of the prompt, so equal keys mean equal tokens at equal positions. Stages hold the blocks' KV; this
index is the only place that decides, and every stage obeys in ring order (Step.attach, Step.seal, Evict),
so the stages' caches cannot drift apart.

Exact by construction: a block is cached only when one full, aligned prefill chunk computed it, and a request
resumes after whole blocks, so its remaining chunks have the boundaries they would have had without the cache:
every position is computed by the same operations on the same inputs, with or without it.

The KV budget counts each block once: a running request reserves what it may still allocate (its prompt and
output, less the blocks it attached), and cached blocks that no running request owns count on their own.
Blocks no request uses are evicted, least recently used first, when an admission needs the room; so with
the cache, everything waiting fits whenever it would have fitted without it.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from shardline.compute.kv import round_up

# Without a KV budget (tests, a bare runner), at most this many unused blocks stay cached.
UNBUDGETED_BLOCKS = 512


def chain_keys(tokens: list[int], block: int) -> list[bytes]:
    """The key of each whole block of `tokens`: a hash of the previous block's key and this block's tokens."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[start : start + block]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class Block:
    id: int
    key: bytes
    depth: int  # its index in the prompt
    parent: bytes | None
    refs: int = 0  # running requests holding it (the one that computed it, and those that attached it)
    owner: str | None = None  # the running request that computed it: its reservation pays for the bytes
    last_used: int = 0
    children: set[bytes] = field(default_factory=set)


@dataclass
class Holding:
    """What one running request holds: its reservation, its blocks, and its prompt's keys."""

    reserved: int  # bytes it may still allocate
    keys: list[bytes]
    # The blocks themselves, not their keys: a block evicted while held may be cached anew under the same
    # key by another request, and this request's release must not take that one's reference.
    blocks: list[Block] = field(default_factory=list)
    attached: int = 0  # blocks it started from


class PrefixLedger:
    """KV bookkeeping for admission, with or without the prefix cache (`enabled`)."""

    def __init__(self, block: int, block_bytes: int, budget: int, enabled: bool = True) -> None:
        self.block = block
        self.block_bytes = block_bytes  # one block's KV over the whole model
        self.budget = budget  # 0: no limit
        self.enabled = enabled
        self.blocks: dict[bytes, Block] = {}
        self.held: dict[str, Holding] = {}
        self.next_id = 0
        self.clock = 0
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, found cached
        self.dropped: list[int] = []  # evicted by a seal, told to the stages at the next release

    # ---- bytes ----------------------------------------------------------------------------------------

    def need(self, positions: int) -> int:
        """What a request of this many positions (prompt and output) reserves without the cache."""
        return round_up(positions, self.block) // self.block * self.block_bytes

    def used(self) -> int:
        """Bytes counted against the budget: running requests' reservations and cached blocks no running
        request owns."""
        unowned = sum(1 for b in self.blocks.values() if b.owner is None)
        return sum(h.reserved for h in self.held.values()) + unowned * self.block_bytes

    def evictable(self) -> int:
        return sum(1 for b in self.blocks.values() if b.refs == 0)

    # ---- admission --------------------------------------------------------------------------------------

    def admit(self, needs: list[int]) -> tuple[int, list[int]]:
        """How many requests at the head of the FIFO to admit (strict FIFO: a large request at the head is not
        overtaken), and the blocks evicted to make room for them."""
        evicted: list[int] = []
        count = 0
        used = self.used()
        for need in needs:
            if self.budget:
                while used + need > self.budget and (gone := self._evict_one()):
                    evicted += [b.id for b in gone]
                    # A running request's own block goes with its parent, but its reservation still pays.
                    used -= sum(1 for b in gone if b.owner is None) * self.block_bytes
                if used + need > self.budget:
                    break
            used += need
            count += 1
        return count, evicted

    def start(self, request_id: str, need: int, prompt: list[int]) -> None:
        """An admitted request: it reserves `need` bytes until it ends."""
        keys = chain_keys(prompt, self.block) if self.enabled else []
        self.held[request_id] = Holding(reserved=need, keys=keys)

    def attach(self, request_id: str, limit: int, prompt_len: int = 0) -> list[int]:
        """Just before a request's first step: the cached blocks its prompt (`prompt_len` tokens) starts with,
        at most `limit`, now held by it. Its reservation shrinks by them."""
        h = self.held[request_id]
        if not self.enabled or h.blocks:
            return []
        found: list[Block] = []
        for key in h.keys[:limit]:
            b = self.blocks.get(key)
            if b is None:
                break
            found.append(b)
        self.queries += prompt_len or len(h.keys[:limit]) * self.block
        self.hits += len(found) * self.block
        self.clock += 1
        for b in found:
            b.refs += 1
            b.last_used = self.clock
            h.blocks.append(b)
        h.attached = len(found)
        h.reserved = max(0, h.reserved - len(found) * self.block_bytes)
        return [b.id for b in found]

    def seal(self, request_id: str, index: int) -> int | None:
        """The request's step computes block `index` of its prompt as one whole chunk: the id to keep it
        under, or None where it is not worth keeping (cached already, or its parent is not: unreachable)."""
        h = self.held[request_id]
        if not self.enabled or index >= len(h.keys):
            return None
        key = h.keys[index]
        parent = h.keys[index - 1] if index else None
        if key in self.blocks or (parent is not None and parent not in self.blocks):
            return None
        if self.budget == 0 and len(self.blocks) >= UNBUDGETED_BLOCKS:
            gone = self._evict_one()
            if not gone:
                return None
            self.dropped += [g.id for g in gone]
        self.clock += 1
        b = Block(self.next_id, key, index, parent, refs=1, owner=request_id, last_used=self.clock)
        self.next_id += 1
        self.blocks[key] = b
        if parent is not None:
            self.blocks[parent].children.add(key)
        h.blocks.append(b)
        return b.id

    def release(self, request_id: str) -> list[int]:
        """A request ended: its blocks stay cached, unowned. Returns the blocks evicted since the last release
        (by seals, and now to stay within the unbudgeted cap), for the stages to drop."""
        evicted, self.dropped = self.dropped, []
        h = self.held.pop(request_id, None)
        if h is None:
            return evicted
        for b in h.blocks:  # an evicted one included: it is out of the index, its count no longer matters
            b.refs -= 1
            if b.owner == request_id:
                b.owner = None
        while self.budget == 0 and len(self.blocks) > UNBUDGETED_BLOCKS and (gone := self._evict_one()):
            evicted += [b.id for b in gone]
        return evicted

    def cached_tokens(self, request_id: str) -> int:
        h = self.held.get(request_id)
        return h.attached * self.block if h else 0

    # ---- eviction ---------------------------------------------------------------------------------------

    def _evict_one(self) -> list[Block]:
        """Drop the least recently used block no request holds (the deepest first among equals), with the
        blocks cached after it, which no lookup could reach any more.

        A block after it that a running request holds is that request's own (one that attached it would hold
        this one too): its reservation still pays for it, and the request keeps its arrays."""
        victims = [b for b in self.blocks.values() if b.refs == 0]
        if not victims:
            return []
        victim = min(victims, key=lambda b: (b.last_used, -b.depth))
        gone: list[Block] = []
        stack = [victim.key]
        while stack:
            b = self.blocks.pop(stack.pop())
            stack.extend(k for k in b.children if k in self.blocks)
            gone.append(b)
        if victim.parent is not None and victim.parent in self.blocks:
            self.blocks[victim.parent].children.discard(victim.key)
        return gone
