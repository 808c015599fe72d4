"""An instance's runner slots: which (ring stage, member) each runner of a layout is, in one order for all."""

from __future__ import annotations


def runner_slots(stages: int, group: int) -> list[tuple[int, int]]:
    """(ring stage, member) of each runner of an instance, in slot order: the faces first (slot = their
    ring stage, as in a pipeline), then each stage's other members. The engine and the master use this."""
    faces = [(s, 0) for s in range(stages)]
    return faces + [(s, j) for s in range(stages) for j in range(1, group)]
