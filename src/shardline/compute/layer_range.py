"""A stage's contiguous range of a model's layers, and the even split of a model into stages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerRange:
    start: int
    end: int  # exclusive
    total: int

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.total


def split_layers(total: int, stages: int) -> list[LayerRange]:
    """Even contiguous split; earlier stages take the remainder (the last one also holds the head)."""
    if not 1 <= stages <= total:
        raise ValueError(f"cannot split {total} layers into {stages} stages")
    base, extra = divmod(total, stages)
    ranges, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        ranges.append(LayerRange(start, start + size, total))
        start += size
    return ranges
