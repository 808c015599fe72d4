"""What a tensor-parallel group's face and members share (dataplane/group.py): the step's sums.

Each sum is tagged with the current step and its index within it and waits at most the step's deadline; the
sums run as an MLX op where they can (NATIVE_SUMS), else in Python on the same frames. Their timings feed the
heartbeat.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from shardline.compute import quantized
from shardline.dataplane import frame
from shardline.dataplane.group_stream import SPIN_S, Stream
from shardline.dataplane.transport import DeadlineExceeded, TransportError
from shardline.instance.deadline import SMALL_STEP

log = logging.getLogger("shardline.group")
# Sums as an MLX op (csrc/qmm/group_sum.h) where the streams are plain TCP and the device the CPU: a step's
# layers are then one graph. TLS streams (Python's ssl) and other devices sum here, in Python, on the same
# frames. SHARDLINE_GROUP_SUM=python forces Python's (to compare the two).
NATIVE_SUMS = os.environ.get("SHARDLINE_GROUP_SUM", "native") != "python"


class Sums:
    """The part face and members share: the current step's tag, deadline and sum counter, and timings.

    on_lost(slot) is called before an error on a peer's stream propagates: the runner says which runner it
    lost (the controller blames that one, and placement avoids its machine when it looks cut off)."""

    def __init__(self, on_lost: Callable[[int], None] = lambda slot: None) -> None:
        self.on_lost = on_lost
        self.seq = -1
        self.index = 0
        self.deadline_s = 60.0
        self.deadline = 0.0
        # This process's wall time inside each recent sum, apart for decode steps and prefill chunks (the
        # heartbeat reports them; `bench tp` too).
        self.timings_us: dict[bool, deque[float]] = {True: deque(maxlen=4096), False: deque(maxlen=4096)}
        self.count = 0
        self.native: Any = None  # a _qmm.SumLink over `_streams`, once the group met (_go_native)
        self._streams: list[Stream] = []
        self._clock = 0.0  # time.monotonic() minus the op's clock (they may differ in origin)

    def _go_native(self, streams: list[Stream], face: bool, pair: bool) -> None:
        """Sum with the MLX op from now on, where it can (plain sockets, the CPU device, the op built)."""
        qmm = quantized.native()
        plain = not any(isinstance(s.sock, ssl.SSLSocket) for s in streams)
        built = qmm is not None and hasattr(qmm, "SumLink")
        if not (NATIVE_SUMS and plain and built and mx.default_device() == mx.cpu):
            why = "asked" if not NATIVE_SUMS else "TLS" if not plain else "no op" if not built else "device"
            log.info("group sums in Python (%s)", why)
            return
        log.info("group sums as an MLX op")
        self._streams = streams
        self.native = qmm.SumLink([s.sock.fileno() for s in streams], face, pair, SPIN_S)
        self._clock = time.monotonic() - qmm.monotonic()

    def _native_sum(self, x: mx.array) -> mx.array | None:
        """The sum as a lazy op (None where this sum goes through Python)."""
        if self.native is None or x.dtype != mx.float32:
            return None
        positions = x.size // max(1, x.shape[-1])
        return quantized.native().group_sum(  # type: ignore[union-attr]
            x, self.native, self.seq, self._next(), self.deadline - self._clock, positions <= SMALL_STEP
        )

    def check(self) -> None:
        """After a step's evaluation, before anything of it leaves this runner: the op's sums' timings, and
        their failure raised here as Python's sums raise it (the peer named and reported lost)."""
        if self.native is None:
            return
        for small, us in self.native.drain():
            self.timings_us[small].append(us)
            self.count += 1
        kind, k, message = self.native.error()
        if kind == 0:
            return
        stream = self._streams[k]
        self.on_lost(stream.slot)
        error = DeadlineExceeded if kind == 1 else TransportError if kind == 2 else frame.FrameError
        raise error(f"{stream.peer} {message}" if kind != 3 else f"{stream.peer}: {message}")

    @contextmanager
    def _blame(self, stream: Stream) -> Iterator[None]:
        try:
            yield
        except (TransportError, DeadlineExceeded):
            self.on_lost(stream.slot)
            raise

    def begin(self, seq: int, deadline_s: float) -> None:
        """A step starts: its sums are tagged with seq, each waits at most deadline_s from now."""
        self.seq, self.index = seq, 0
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s

    def _next(self) -> int:
        index, self.index = self.index, self.index + 1
        return index

    def _partial(self, x: mx.array) -> tuple[int, float, np.ndarray]:
        """A sum starts: its index, its start time (after the partial is computed: that is not the sum's
        time) and the partial as float32 numpy."""
        index = self._next()
        mx.eval(x)
        self.check()  # the op's sums that x depends on ran just now
        started = time.perf_counter()
        return index, started, np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))

    def _took(self, x: mx.array, started: float) -> None:
        self.count += 1
        positions = x.size // max(1, x.shape[-1])
        self.timings_us[positions <= SMALL_STEP].append((time.perf_counter() - started) * 1e6)

    def percentiles(self, decode: bool) -> tuple[float, float]:
        """(p50, p99) in microseconds of the recent sums of decode steps (or prefill chunks)."""
        xs = sorted(self.timings_us[decode])
        if not xs:
            return (0.0, 0.0)
        return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))])


def sum_like(total: np.ndarray, x: mx.array) -> mx.array:
    """The sum as an MLX array of the partial's dtype (no cast op when it is float32 already)."""
    out = mx.array(total)
    return out if x.dtype == mx.float32 else out.astype(x.dtype)
