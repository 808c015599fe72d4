"""Live figures per instance, sampled on a period into a short history: the dashboard's sparklines."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel

from shardline.front.figures import LeaderFigures

SAMPLE_S = 2.0
HISTORY = 180  # six minutes of samples
TTFT_WINDOW_S = 60.0


class LivePoint(BaseModel):
    at: float  # wall clock
    tokens_per_s: float
    running: int
    queued: int
    ttft_s: float | None  # median of the first-token waits seen in the sample's period, if any
    # Prompt tokens the prefix cache held / those looked up in the sample's period; None: none looked up.
    prefix_hit_rate: float | None = None
    prefix_blocks: int = 0


@dataclass
class InstanceHistory:
    points: deque[LivePoint] = field(default_factory=lambda: deque(maxlen=HISTORY))
    tokens: int | None = None
    prefix: tuple[int, int] = (0, 0)  # the figures' prefix queries and hits at the last sample
    at: float = 0.0  # monotonic time of the last sample


def sample(h: InstanceHistory, f: LeaderFigures, now: float, wall: float) -> LivePoint:
    """One point from the figures' growth since the previous sample."""
    rate = 0.0
    if h.tokens is not None and now > h.at:
        rate = max(0, f.tokens - h.tokens) / (now - h.at)
    since = h.at if h.tokens is not None else now - SAMPLE_S
    waits = [s for t, s in list(f.ttfts) if t > since]
    queries, hits = f.prefix_queries - h.prefix[0], f.prefix_hits - h.prefix[1]
    point = LivePoint(
        at=wall,
        tokens_per_s=round(rate, 2),
        running=f.running,
        queued=f.waiting,
        ttft_s=round(statistics.median(waits), 3) if waits else None,
        prefix_hit_rate=hit_rate(queries, hits),
        prefix_blocks=f.prefix_blocks,
    )
    h.points.append(point)
    h.tokens, h.prefix, h.at = f.tokens, (f.prefix_queries, f.prefix_hits), now
    return point


def hit_rate(queries: int, hits: int) -> float | None:
    """Share of the prompt tokens looked up that the prefix cache held; None before any lookup."""
    return round(min(1.0, hits / queries), 4) if queries > 0 else None


def recent_ttft(f: LeaderFigures, now: float) -> float | None:
    waits = [s for t, s in list(f.ttfts) if now - t <= TTFT_WINDOW_S]
    return round(statistics.median(waits), 3) if waits else None


class Histories:
    def __init__(self) -> None:
        self.by_instance: dict[str, InstanceHistory] = {}

    def sample_all(self, figures: dict[str, LeaderFigures], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        wall = time.time()
        for instance, f in figures.items():
            sample(self.by_instance.setdefault(instance, InstanceHistory()), f, now, wall)
        for gone in set(self.by_instance) - set(figures):
            del self.by_instance[gone]

    def points(self, instance: str) -> list[LivePoint]:
        h = self.by_instance.get(instance)
        return list(h.points) if h else []
