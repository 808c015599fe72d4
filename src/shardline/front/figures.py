"""What the leader's beats say about an instance as a whole: requests held, tokens made, first-token waits.

Every front of an instance hears every beat, so any node can show figures for all of its traffic. A new
generation's leader counts from zero again; the total here only ever grows.
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
    _generation: int | None = None
    _leader_tokens: int = 0

    def take(self, beat: LeaderBeat, generation: int, now: float | None = None) -> None:
        if generation != self._generation:
            self._generation, self._leader_tokens = generation, 0
        self.tokens += max(0, beat.tokens - self._leader_tokens)
        self._leader_tokens = beat.tokens
        self.running = beat.running
        self.waiting = len(beat.requests) - beat.running
        now = time.monotonic() if now is None else now
        self.ttfts.extend((now, s) for s in beat.ttft_s)

    def idle(self) -> None:
        """Between generations nothing runs: what the old leader held is resubmitted to the next."""
        self.running = self.waiting = 0
