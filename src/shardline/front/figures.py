"""What the leader's beats say about an instance as a whole: requests held, tokens made, first-token waits,
the prefix cache's lookups and hits.

Every front of an instance hears every beat, so any node can show figures for all of its traffic. A new
generation's leader counts from zero again; the totals here only ever grow.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shardline.dataplane.messages import LeaderBeat

TTFT_KEEP = 512


@dataclass
class LeaderFigures:
    running: int = 0
    waiting: int = 0
    tokens: int = 0  # sampled by this instance's leaders, all generations
    ttfts: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TTFT_KEEP))  # (when, s)
    # Prefix cache, all generations: prompt tokens looked up and found; the blocks the leader caches now.
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_blocks: int = 0
    prefix_block_tokens: int = 0
    prefix_off: str = ""
    _generation: int | None = None
    _leader: dict[str, int] = field(default_factory=dict)  # the serving leader's own counts, last beat

    def take(self, beat: LeaderBeat, generation: int, now: float | None = None) -> None:
        if generation != self._generation:
            self._generation = generation
            self._leader.clear()
        self.tokens += self._grown("tokens", beat.tokens)
        self.prefix_queries += self._grown("prefix_queries", beat.prefix_queries)
        self.prefix_hits += self._grown("prefix_hits", beat.prefix_hits)
        self.prefix_blocks = beat.prefix_blocks
        self.prefix_block_tokens = beat.prefix_block_tokens
        self.prefix_off = beat.prefix_off
        self.running = beat.running
        self.waiting = len(beat.requests) - beat.running
        now = time.monotonic() if now is None else now
        self.ttfts.extend((now, s) for s in beat.ttft_s)

    def _grown(self, name: str, count: int) -> int:
        """How much a leader's own count grew since its last beat; a beat out of order takes nothing back
        (and the next one counts from the highest seen, not twice)."""
        last = self._leader.get(name, 0)
        self._leader[name] = max(last, count)
        return max(0, count - last)

    def idle(self) -> None:
        """Between generations nothing runs: what the old leader held is resubmitted to the next, and its
        cached blocks went with it."""
        self.running = self.waiting = 0
        self.prefix_blocks = 0
