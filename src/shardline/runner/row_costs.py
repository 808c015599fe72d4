"""What a decode step of r rows costs each stage, learnt from the traces of the steps the leader sent.

The leader sizes its micro-batches with it (schedule.micro_batches): on stages of unequal cost (the last
one also holds the head and samples), two streams go faster as one batch than as two that queue at the
slower stage; on equal stages, one batch per stage hides the hops. Only the steps' own numbers decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEEP = 0.8  # weight of what was known in each running mean: a few steps follow a change of machine speed
PRIOR_ROW_SHARE = 0.05  # each row beyond the first, as a share of a one-row step, until two sizes are seen
MAX_SIZES = 64  # row counts remembered per stage (a batch has at most max_batch rows)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else KEEP * old + (1.0 - KEEP) * new


@dataclass
class StageRowCost:
    by_rows: dict[int, float] = field(default_factory=dict)  # rows -> running mean of step seconds

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self.by_rows and len(self.by_rows) >= MAX_SIZES:
            del self.by_rows[max(self.by_rows, key=lambda r: abs(r - rows))]
        self.by_rows[rows] = _mean(self.by_rows.get(rows), seconds)

    def estimate(self, rows: int) -> float | None:
        """Seconds for a step of `rows` rows: a line through the sizes seen (its slope never negative)."""
        points = self.by_rows
        if not points:
            return None
        if rows in points:
            return points[rows]
        if len(points) == 1:
            ((r0, t0),) = points.items()
            return max(0.0, t0 * (1.0 + PRIOR_ROW_SHARE * (rows - r0)))
        n = len(points)
        mr = sum(points) / n
        mt = sum(points.values()) / n
        var = sum((r - mr) ** 2 for r in points)
        slope = max(0.0, sum((r - mr) * (t - mt) for r, t in points.items()) / var)
        return max(0.0, mt + slope * (rows - mr))


@dataclass
class RowCosts:
    stages: list[StageRowCost]
    rest_s: float = 0.0  # a step's time around the ring beyond the stages' compute: hops, framing, the leader

    @classmethod
    def for_stages(cls, stages: int) -> RowCosts:
        return cls([StageRowCost() for _ in range(stages)])

    def observe(self, rows: int, trace: list[float], round_trip_s: float | None) -> None:
        """One batched step's trace; round_trip_s only when nothing else was in flight (no queueing in it)."""
        if len(trace) != len(self.stages):
            return
        for stage, seconds in zip(self.stages, trace, strict=True):
            stage.observe(rows, seconds)
        if round_trip_s is not None:
            self.rest_s = _mean(self.rest_s or None, max(0.0, round_trip_s - sum(trace)))

    def estimate(self, rows: int) -> list[float] | None:
        """Each stage's seconds for a step of `rows` rows; None until every stage has been seen."""
        out = [s.estimate(rows) for s in self.stages]
        return None if any(t is None for t in out) else [t for t in out if t is not None]
