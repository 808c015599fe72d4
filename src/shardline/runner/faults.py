"""Injected failures, so tests and the chaos bench exercise the real failure paths of a runner."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from shardline.runner.spec import Fault

RING_ABORT_LINE = "[ring] Too many send/recv errors. Aborting..."


class InjectedFault(RuntimeError):
    pass


def maybe_fire(fault: Fault | None, phase: str, steps: int) -> None:
    if fault is None or fault.phase != phase or steps < fault.after_steps:
        return
    # The moment of the fault, for tests that measure how fast it is detected.
    print(
        f"shardline fault injected: {fault.action} in {phase} at {time.time():.6f}",
        file=sys.stderr,
        flush=True,
    )
    if fault.action in ("sigkill", "sigstop"):
        os.kill(os.getpid(), signal.SIGKILL if fault.action == "sigkill" else signal.SIGSTOP)
        return
    if fault.action == "raise":
        raise InjectedFault(f"injected failure in {phase}")
    if fault.action == "exit":
        os._exit(17)
    if fault.action == "ring_abort":
        # What the transport of the system this project replaces printed before wedging forever.
        print(RING_ABORT_LINE, file=sys.stderr, flush=True)
    threading.Event().wait()  # hang: a wedged runner that never exits by itself
