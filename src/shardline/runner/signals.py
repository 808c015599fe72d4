"""How a runner's loops tell its process to stop, or to serve a newer generation: raised deep, caught on top.

Shared by the process (which catches them) and the leader (which raises them), so neither imports the other.
"""

from __future__ import annotations

from shardline.instance.spec import RunnerSpec


class StopRunner(Exception):
    pass


class RejoinRequested(Exception):
    """The node agent hands this process a stage of a newer generation (same layers): relink, keep weights."""

    def __init__(self, spec: RunnerSpec) -> None:
        super().__init__(f"rejoin as generation {spec.generation} stage {spec.slot}")
        self.spec = spec
