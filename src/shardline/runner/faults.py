"""Injected failures, so tests and the chaos bench exercise the real failure paths of a runner."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from shardline.dataplane.messages import Step
from shardline.instance.spec import Fault

RING_ABORT_LINE = "[ring] Too many send/recv errors. Aborting..."
PHASES = ("load", "warmup", "prefill", "decode")
_ONE_SHOT = ("raise", "exit", "hang", "ring_abort", "sigkill", "sigstop")


def step_phase(step: Step) -> str:
    """The phase a step's faults fire at: one new position of one request, or rows, is a decode step."""
    return "decode" if step.rows or (step.n == 1 and step.pos > 0) else "prefill"


class InjectedFault(RuntimeError):
    pass


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def hold_gil(seconds: float) -> None:
    """One native call of `seconds` that keeps the GIL (a PyDLL call never releases it): no other thread of
    this process runs meanwhile, its heartbeat included, as in a long tokenizer build."""
    ts = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    ctypes.PyDLL(None).nanosleep(ctypes.byref(ts), None)


def _announce(fault: Fault, phase: str) -> None:
    # The moment of the fault, for tests that measure how fast it is detected.
    print(
        f"shardline fault injected: {fault.action} in {phase} at {time.time():.6f}",
        file=sys.stderr,
        flush=True,
    )


class Faults:
    """The one fault this runner was told to inject, and whether it already has."""

    def __init__(self, fault: Fault | None) -> None:
        self.fault = fault
        self.fired = False

    def _due(self, phase: str, steps: int, exact_phase: bool) -> bool:
        f = self.fault
        if f is None or steps < f.after_steps:
            return False
        if exact_phase:
            return f.phase == phase
        return PHASES.index(phase) >= PHASES.index(f.phase)

    def maybe_fire(self, phase: str, steps: int) -> None:
        """Raise, exit, signal or hang here, once, if this is the fault's moment."""
        f = self.fault
        if f is None or f.action not in _ONE_SHOT or self.fired or not self._due(phase, steps, True):
            return
        self.fired = True
        _announce(f, phase)
        if f.action in ("sigkill", "sigstop"):
            os.kill(os.getpid(), signal.SIGKILL if f.action == "sigkill" else signal.SIGSTOP)
            return
        if f.action == "raise":
            raise InjectedFault(f"injected failure in {phase}")
        if f.action == "exit":
            os._exit(17)
        if f.action == "ring_abort":
            # What the transport of the system this project replaces printed before wedging forever.
            print(RING_ABORT_LINE, file=sys.stderr, flush=True)
        threading.Event().wait()  # hang: a wedged runner that never exits by itself

    def slow_s(self, phase: str, steps: int) -> float:
        """Extra seconds for a step: a slow stage stays slow from its phase on."""
        f = self.fault
        if f is None or f.action != "slow" or not self._due(phase, steps, False):
            return 0.0
        if not self.fired:
            self.fired = True
            _announce(f, phase)
        return f.seconds

    def at_tokenizer_build(self) -> None:
        """Where a stage builds its constraint tokenizer: hold the GIL once, if told to."""
        f = self.fault
        if f is None or f.action != "hold_gil" or self.fired:
            return
        self.fired = True
        _announce(f, f.phase)
        hold_gil(f.seconds)

    def take_drop(self, action: str, phase: str, steps: int) -> bool:
        """True once, at the fault's moment: the caller swallows one message."""
        f = self.fault
        if f is None or f.action != action or self.fired or not self._due(phase, steps, False):
            return False
        self.fired = True
        _announce(f, phase)
        return True
