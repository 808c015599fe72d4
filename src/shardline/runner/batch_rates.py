"""How many micro-batches the decoding streams go in, settled by the tokens a second each count really got.

`schedule.micro_batches` predicts from each stage's step cost, but not what else shares the stages' cores:
the leader's own work, the hops, other processes on the machine. On two stages that share a host with the
rest of the system, two streams as one batch of two rows beat two batches of one that keep both cores full;
on machines of their own the reverse holds. So the leader measures: decode runs in segments of a fixed
count, each segment's tokens a second are folded into that count's figure (per number of streams), every
count is tried once, and afterwards the best measured one runs, with another tried now and then to follow
changes. Segments disturbed by a prefill step or a change in the streams are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEGMENT_RESULTS = 8  # batched results per measured segment (after the first, which only starts the clock)
EXPLORE_EVERY = 8  # every this many segments, the least recently measured count runs instead of the best
KEEP = 0.5  # weight of what was known when a new segment's rate is folded in
MAX_STREAM_COUNTS = 64  # stream counts remembered


@dataclass
class CountRate:
    tokens_per_s: float
    last_segment: int


def decide(rates: dict[int, CountRate], candidates: list[int], predicted: int, segment: int) -> int:
    """The micro-batch count for the next segment: an unmeasured candidate first (the predicted one before
    others), then the best measured, except every EXPLORE_EVERY-th segment, which re-measures the stalest."""
    unmeasured = [k for k in candidates if k not in rates]
    if unmeasured:
        return predicted if predicted in unmeasured else unmeasured[0]
    best = max(candidates, key=lambda k: (rates[k].tokens_per_s, k == predicted))
    if segment % EXPLORE_EVERY == EXPLORE_EVERY - 1:
        others = [k for k in candidates if k != best]
        if others:
            return min(others, key=lambda k: rates[k].last_segment)
    return best


@dataclass
class BatchRates:
    streams: int = 0
    count: int = 1
    segments: int = 0
    rates: dict[int, dict[int, CountRate]] = field(default_factory=dict)  # streams -> count -> rate
    _candidates: list[int] = field(default_factory=lambda: [1])
    _predicted: int = 1
    _started: float | None = None  # arrival of the segment's first result
    _tokens: int = 0
    _results: int = 0

    def pick(self, streams: int, predicted: int, most: int) -> int:
        """The count to use now for `streams` decoding streams, from 1 to `most` (one per stage at most);
        `predicted` is the cost model's choice."""
        candidates = list(range(1, max(1, most) + 1)) if streams > 1 else [1]
        if streams != self.streams or self.count not in candidates:
            self.streams = streams
            self.disturb()
            self.count = self._decide(candidates, predicted) if len(candidates) > 1 else 1
        self._candidates, self._predicted = candidates, predicted
        return self.count

    def disturb(self) -> None:
        """Something other than these streams' decode ran: the segment so far says nothing."""
        self._started, self._tokens, self._results = None, 0, 0

    def observe(self, now: float, tokens: int) -> None:
        """A batched decode result arrived with `tokens` sampled tokens."""
        if self.streams < 2:
            return
        if self._started is None:
            self._started, self._tokens, self._results = now, 0, 0
            return
        self._tokens += tokens
        self._results += 1
        if self._results < SEGMENT_RESULTS or now <= self._started:
            return
        rate = self._tokens / (now - self._started)
        by_count = self.rates.setdefault(self.streams, {})
        if len(self.rates) > MAX_STREAM_COUNTS:
            del self.rates[next(iter(self.rates))]
        old = by_count.get(self.count)
        mean = rate if old is None else KEEP * old.tokens_per_s + (1.0 - KEEP) * rate
        by_count[self.count] = CountRate(mean, self.segments)
        self.segments += 1
        previous = self.count
        self.count = self._decide(self._candidates, self._predicted)
        if self.count == previous:
            self._started, self._tokens, self._results = now, 0, 0  # the next segment runs on at once
        else:
            self.disturb()  # the new count's first cycle is a transition

    def _decide(self, candidates: list[int], predicted: int) -> int:
        return decide(self.rates.get(self.streams, {}), candidates, predicted, self.segments)
