"""The leader's decisions as pure functions over its state: which step goes around the ring next.

A request is a list of known tokens (prompt, then tokens generated so far) and a count of tokens fed through
the ring. Prompt tokens go in chunks, later tokens one at a time, so a resumed request replays exactly the
steps the original made. The step that feeds the last known token samples the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from shardline.dataplane.messages import RequestSpec


@dataclass
class LeaderRequest:
    spec: RequestSpec
    arrival: int
    known: list[int] = field(default_factory=list)
    fed: int = 0
    in_flight: int = 0
    done: bool = False  # finished or cancelled: no more steps, release once nothing is in flight
    released: bool = False
    last_served: int = -1

    def __post_init__(self) -> None:
        if not self.known:
            self.known = [*self.spec.prompt, *self.spec.generated]

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt)

    @property
    def generated(self) -> int:
        return len(self.known) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return self.fed >= self.prompt_len


@dataclass(frozen=True)
class FeedStep:
    request_id: str
    pos: int
    n: int
    sample: bool


@dataclass(frozen=True)
class FeedBatch:
    """One decode position of each of several requests, in one step: the stage reads its weights once."""

    rows: tuple[FeedStep, ...]


@dataclass(frozen=True)
class ReleaseRequest:
    request_id: str


Action = FeedStep | FeedBatch | ReleaseRequest


def next_chunk(req: LeaderRequest, prefill_step: int) -> FeedStep | None:
    if req.done or req.fed >= len(req.known):
        return None
    if req.fed < req.prompt_len:
        n = min(prefill_step, req.prompt_len - req.fed)
    else:
        n = 1
    return FeedStep(req.spec.request_id, req.fed, n, sample=req.fed + n == len(req.known))


def plan(
    requests: list[LeaderRequest],
    in_flight: int,
    window: int,
    prefill_step: int,
    batches: int = 1,
    max_batch: int = 1,
    batches_in_flight: int = 0,
) -> Action | None:
    """One action, or None to wait for results. Releases first, then decode steps, then prefill chunks.

    Decoding streams go in micro-batches of up to ceil(decoding / batches) rows (at most max_batch), at
    most `batches` in flight (see micro_batches): rows that come back while all are out wait for the next
    to return and join it, so batches that started small merge. The window's last
    free slot goes to a prefill chunk when one is ready: decoding streams would otherwise keep the window
    full between them, and a new request would wait for one to finish.
    """
    for req in requests:
        if req.done and not req.released and req.in_flight == 0:
            return ReleaseRequest(req.spec.request_id)
    if in_flight >= window:
        return None
    # The least recently served go first, so streams share the ring.
    decoding = sorted((r for r in requests if r.decoding), key=lambda r: (r.last_served, r.arrival))
    ready = [step for r in decoding if (step := next_chunk(r, prefill_step)) is not None]
    prefill = next(
        (
            step
            for r in sorted((r for r in requests if not r.decoding), key=lambda r: r.arrival)
            if (step := next_chunk(r, prefill_step)) is not None
        ),
        None,
    )
    if prefill is not None and (not ready or in_flight == window - 1):
        return prefill
    if not ready:
        return None
    if max_batch <= 1:
        return ready[0]
    if batches_in_flight >= batches:
        return prefill
    size = min(max_batch, -(-len(decoding) // max(1, batches)))
    return FeedBatch(tuple(ready[:size]))


BATCHES_MARGIN = 1.03  # fewer micro-batches than stages only when they are clearly faster


def micro_batches(
    streams: int, stages: int, max_batch: int, cost: Callable[[int], list[float] | None], rest_s: float
) -> int:
    """How many micro-batches the decoding streams go in: the count that yields the most tokens a second.

    cost(rows) is each stage's seconds for a step of that many rows. k batches of ceil(streams / k) rows
    make one cycle: a batch goes around the ring in the sum of the stages' times plus the rest (hops, the
    leader), and the busiest stage must run all k of them within the cycle. One batch per stage is the
    default, and the choice until every stage's cost is known.
    """
    default = max(1, min(stages, streams))
    best_k, best_rate = default, 0.0
    for k in range(default, 0, -1):
        rows = min(max_batch, -(-streams // k))
        times = cost(rows)
        if times is None:
            return default
        cycle = max(sum(times) + rest_s, k * max(times))
        rate = min(streams, k * rows) / cycle if cycle > 0 else 0.0
        if rate > best_rate * BATCHES_MARGIN:
            best_k, best_rate = k, rate
    return best_k


def apply_step_sent(req: LeaderRequest, step: FeedStep, tick: int) -> None:
    req.fed = step.pos + step.n
    req.in_flight += 1
    req.last_served = tick


def apply_token(req: LeaderRequest, token: int) -> Literal["stop", "length"] | None:
    """Record a sampled token; returns a finish reason when the request is complete."""
    if token in req.spec.stop_tokens:
        req.done = True
        return "stop"
    req.known.append(token)
    if req.generated >= req.spec.max_tokens:
        req.done = True
        return "length"
    return None


# ---- KV as it is used -------------------------------------------------------------------------------------


def grown_blocks(covered: int, positions: int, block: int) -> int:
    """Blocks a request must add to hold `positions` when its reservation covers `covered` positions."""
    return max(0, -(-positions // block) - -(-covered // block))


def make_room(
    requests: list[LeaderRequest], requester: str
) -> tuple[Literal["wait", "preempt", "truncate"], str | None]:
    """The KV budget cannot hold `requester`'s next block: what the leader does.

    Requests that ended but still have steps in flight free their blocks when those come back: wait for
    them. Otherwise the newest running request goes back to the queue (the requester itself when it is the
    newest) and recomputes later from its tokens; a request alone that outgrows the whole budget ends there,
    as a request reaching the context's end does.
    """
    if any(r.done and not r.released and r.spec.request_id != requester for r in requests):
        return "wait", None
    live = [r for r in requests if not r.done]
    victim = max(live, key=lambda r: r.arrival)
    if len(live) == 1 and victim.spec.request_id == requester:
        return "truncate", requester
    return "preempt", victim.spec.request_id
