"""A follower's loop: a ring stage past the first, obeying the ring's messages strictly in arrival order.

It waits for the next message without a deadline (a follower only reacts; the leader's result deadline and
each stage's watchdog catch a loss), drops and counts what does not fit, and never decides anything.
"""

from __future__ import annotations

from typing import NoReturn

from shardline.dataplane import messages as m
from shardline.dataplane.frame import FrameError
from shardline.dataplane.transport import Inbox, Outbox
from shardline.instance.spec import RunnerSpec
from shardline.runner.faults import Faults, step_phase
from shardline.runner.signals import RejoinRequested, StopRunner
from shardline.runner.stage import Compute, ProtocolError, Stage


def serve_follower(
    spec: RunnerSpec, inbox: Inbox, stage: Stage, compute: Compute, downstream: Outbox, faults: Faults
) -> NoReturn:
    """Until Stop (StopRunner) or a Rejoin (RejoinRequested): each step through `stage` by `compute`, its
    output to the next stage; releases, evictions and the Stop passed on in order (the last stage's next
    is the leader, which sent them)."""
    while True:
        env = inbox.get(timeout=None)  # idle wait: a follower only reacts
        msg = env.message
        if isinstance(msg, m.Step):
            try:
                x = env.tensor
                if x is None:
                    raise ProtocolError("step without hidden states")
                stage.check(msg, x)
            except (ProtocolError, FrameError, ValueError) as exc:
                inbox.drop(str(exc))
                continue
            out, tensor = compute(msg, x)
            if faults.take_drop("drop_message", step_phase(msg), stage.steps):
                continue
            downstream.send(out, tensor)
        elif isinstance(msg, m.Release | m.Evict):
            if isinstance(msg, m.Release):
                stage.release(msg.request_id)
            else:
                stage.evict(msg.blocks)
            if not spec.is_last:
                downstream.send(msg)
        elif isinstance(msg, m.Stop):
            stage.stop()
            if not spec.is_last:
                downstream.send(msg)
            raise StopRunner
        elif isinstance(msg, m.Rejoin):
            raise RejoinRequested(msg.spec)
        else:
            inbox.drop(f"stage {spec.slot} does not take {msg.kind} messages")
