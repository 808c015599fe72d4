"""How long a step may take: a function of the step's work and the stage's measured speed.

One rule serves the controller (judging heartbeats), the runner's own watchdog and the leader's wait for
results, so the three never disagree about what "too slow" means. Speed is the slowest seen, seeded by
warm-up: a deadline errs long, and slow-but-progressing is never called dead.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_STEP = 4  # steps this small cost what reading the weights costs, whatever their size
# A position of KV cache that a step reserves (allocated and zeroed before use) costs at most this share of a
# computed position: 0.03 measured on the default model (a 16,385-position reservation added 1.0 s to a
# 0.22 s first chunk), less on larger models, whose compute per position grows faster than their KV bytes.
RESERVE_WORK = 0.1


def work(n: int, context: int, attn_keys: int, reserve: int = 0) -> float:
    """Work units of n positions attending to `context` keys: one per position, plus attention's share,
    plus the KV positions the step reserves.

    attn_keys is the context at which attention costs as much as the rest of a layer (about 6x the hidden
    size: a layer's matmuls are ~24 h^2 flops a token, attention 4 h flops a key).
    """
    return n * (1.0 + context / max(1, attn_keys)) + RESERVE_WORK * reserve


@dataclass
class Speed:
    attn_keys: int = 4096
    base_s: float = 0.0  # slowest small step: fixed cost of a step (weights read, framework overhead)
    per_work_s: float = 0.0  # slowest cost per work unit of larger steps, beyond base_s
    small_seen: bool = False
    large_seen: bool = False  # per_work_s may stay 0 (a large step as fast as a small one) yet be measured

    def observe(self, n: int, context: int, seconds: float, reserve: int = 0) -> None:
        if n <= SMALL_STEP:
            self.small_seen = True
            self.base_s = max(self.base_s, seconds)
        else:
            self.large_seen = True
            extra = max(0.0, seconds - self.base_s)
            self.per_work_s = max(self.per_work_s, extra / work(n, context, self.attn_keys, reserve))

    def estimate(self, n: int, context: int, reserve: int = 0) -> float:
        return self.base_s + self.per_work_s * work(n, context, self.attn_keys, reserve)

    def covers(self, n: int) -> bool:
        """Whether a step of n positions has been measured in its own size class: a decode step's time
        says nothing about a prefill chunk's, so it must not set that chunk's deadline."""
        return self.small_seen if n <= SMALL_STEP else self.large_seen


@dataclass(frozen=True)
class DeadlinePolicy:
    floor: float = 2.0
    ceiling: float = 60.0
    slack: float = 10.0

    def clamp(self, estimate_s: float) -> float:
        return min(self.ceiling, max(self.floor, self.slack * estimate_s))

    def step(self, speed: Speed, n: int, context: int, reserve: int = 0) -> float:
        if not speed.covers(n):  # not measured yet (the ring's own warm-up): err long, never call it dead
            return self.ceiling
        return self.clamp(speed.estimate(n, context, reserve))
