"""Injected failures, so tests and the chaos bench exercise the real failure paths of a runner."""

from __future__ import annotations

import os
import sys
import threading

from shardline.runner.spec import Fault

RING_ABORT_LINE = "[ring] Too many send/recv errors. Aborting..."


class InjectedFault(RuntimeError):
    pass


def maybe_fire(fault: Fault | None, phase: str, steps: int) -> None:
    if fault is None or fault.phase != phase or steps < fault.after_steps:
        return
    if fault.action == "raise":
        raise InjectedFault(f"injected failure in {phase}")
    if fault.action == "exit":
        os._exit(17)
    if fault.action == "ring_abort":
        # What the transport of the system this project replaces printed before wedging forever.
        print(RING_ABORT_LINE, file=sys.stderr, flush=True)
    threading.Event().wait()  # hang: a wedged runner that never exits by itself
