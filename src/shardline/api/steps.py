"""The last step count seen from each stage's heartbeats, so each new step is observed once in /metrics.

Bounded: instances come and go for as long as a node runs, and a key per stage of every instance ever seen
would grow without end. The least recently beating stages are forgotten first (a forgotten stage that beats
again costs one unobserved step, nothing more), and an instance's stages are dropped when it is removed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_STAGES = 1024  # far above the stages one cluster runs at once


class StepCounts:
    def __init__(self, limit: int = MAX_STAGES) -> None:
        self.limit = limit
        self._last: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._lock = threading.Lock()  # beats arrive on zenoh's thread, removals on the view thread

    def advance(self, instance: str, stage: int, steps: int) -> bool:
        """Record `steps` for the stage; True when it is a new step of a stage already known (observe it)."""
        key = (instance, stage)
        with self._lock:
            last = self._last.get(key)
            if last is not None and last >= steps:
                return False
            self._last[key] = steps
            self._last.move_to_end(key)
            while len(self._last) > self.limit:
                self._last.popitem(last=False)
            return last is not None

    def forget(self, instance: str) -> None:
        with self._lock:
            for key in [k for k in self._last if k[0] == instance]:
                del self._last[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._last)
