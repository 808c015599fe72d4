"""A tensor-parallel group member's loop: what its face obeys, in the face's order (runner/tp_mirror.py).

The face checked each step against the same state: a step that does not fit here means the two diverged,
which nothing can mend, so it fails the runner. Waiting for the face's next message is an idle wait: a face
that vanishes breaks its stream (dataplane/group.py), and each step's sums have the step's deadline.
"""

from __future__ import annotations

from typing import NoReturn

from shardline.dataplane import messages as m
from shardline.dataplane.frame import to_mlx
from shardline.dataplane.group import GroupMember
from shardline.runner.signals import StopRunner
from shardline.runner.stage import Compute, ProtocolError, StageCompute


def serve_member(group: GroupMember, stage: StageCompute, compute: Compute) -> NoReturn:
    """Until the face's Stop (StopRunner): each step through `stage` by `compute` (the face sends the
    stage's output), each release and eviction as the face made it."""
    while True:
        msg, payload = group.next_message()
        if isinstance(msg, m.Step):
            if payload is None or msg.tensor is None:
                raise ProtocolError("step without its input")
            compute(msg, to_mlx(payload, msg.tensor.dtype))
        elif isinstance(msg, m.Release):
            stage.release(msg.request_id)
        elif isinstance(msg, m.Evict):
            stage.evict(msg.blocks)
        elif isinstance(msg, m.Stop):
            raise StopRunner
        else:
            raise ProtocolError(f"a group member does not take {msg.kind} messages")
