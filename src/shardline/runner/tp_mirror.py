"""A tensor-parallel face's stage: each message the stage obeys goes to the group's other members first.

The members (dataplane/group.py GroupMember, runner/member.py) run the same steps and drop the same KV, in the
face's order, so their caches follow the face's; each step's sums then meet inside the group.
"""

from __future__ import annotations

import mlx.core as mx

from shardline.compute.shard import Shard
from shardline.dataplane.group import GroupFace
from shardline.dataplane.messages import Evict, Release, Step, StepResult, Stop
from shardline.runner.stage import StageCompute


class TensorParallelMirror:
    """A StageCompute whose every obeyed message reaches the group first (the runner's `Stage`)."""

    def __init__(self, stage: StageCompute, face: GroupFace, stop_deadline_s: float) -> None:
        self.stage = stage
        self.face = face
        self.stop_deadline_s = stop_deadline_s  # for the Stop that ends the members with the ring

    @property
    def shard(self) -> Shard:
        return self.stage.shard

    @property
    def steps(self) -> int:
        return self.stage.steps

    @property
    def kv_bytes_per_token(self) -> int:
        return self.stage.kv_bytes_per_token

    def check(self, step: Step, x: mx.array) -> None:
        self.stage.check(step, x)

    def run(self, step: Step, x: mx.array) -> tuple[Step | StepResult, mx.array | None]:
        """A step that fits goes to the members, then runs here (one that does not is never forwarded)."""
        self.stage.check(step, x)
        self.face.forward(step, x, self.face.deadline_s)
        return self.stage.run_checked(step, x)

    def release(self, request_id: str) -> None:
        self.face.forward(Release(request_id=request_id), None, self.face.deadline_s)
        self.stage.release(request_id)

    def evict(self, blocks: list[int]) -> None:
        self.face.forward(Evict(blocks=blocks), None, self.face.deadline_s)
        self.stage.evict(blocks)

    def stop(self) -> None:
        """The ring stops: so do the members (the same message, in order)."""
        self.face.forward(Stop(), None, self.stop_deadline_s)

    def finish_head(self, step: Step, packed: mx.array) -> tuple[StepResult, mx.array | None]:
        return self.stage.finish_head(step, packed)
