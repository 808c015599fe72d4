"""zenoh sessions, point-to-point keys and in-order inboxes with deadlines.

Each link has exactly one publisher. zenoh keeps per-publisher order over a reliable, blocking (never
dropping) channel; sequence numbers in the messages let the receiver prove it.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import zenoh
from pydantic import TypeAdapter

from shardline.dataplane import frame


class DeadlineExceeded(TimeoutError):
    pass


class TransportError(RuntimeError):
    pass


def session_config(listen: list[str], connect: list[str]) -> zenoh.Config:
    config = zenoh.Config()
    config.insert_json5("mode", '"peer"')
    # Multicast scouting would announce us on the machine's real interfaces: peers are named explicitly.
    config.insert_json5("scouting/multicast/enabled", "false")
    config.insert_json5("listen/endpoints", json.dumps(listen))
    config.insert_json5("connect/endpoints", json.dumps(connect))
    return config


def open_session(listen: list[str], connect: list[str]) -> zenoh.Session:
    return zenoh.open(session_config(listen, connect))


@dataclass(frozen=True)
class Keys:
    """Key space of one instance generation: stale messages of an older generation never match."""

    instance: str
    generation: int

    @property
    def root(self) -> str:
        return f"shardline/{self.instance}/g{self.generation}"

    def ring(self, to_stage: int) -> str:
        return f"{self.root}/ring/{to_stage}"

    @property
    def control(self) -> str:
        return f"{self.root}/control"

    @property
    def events(self) -> str:
        return f"{self.root}/events"

    def status(self, stage: int) -> str:
        return f"{self.root}/status/{stage}"

    @property
    def status_all(self) -> str:
        return f"{self.root}/status/*"


class Outbox:
    """The single sender of one link."""

    def __init__(self, session: zenoh.Session, key: str) -> None:
        self._matched = threading.Event()
        self._pub = session.declare_publisher(
            key, congestion_control=zenoh.CongestionControl.BLOCK, express=True
        )
        self._listener = self._pub.declare_matching_listener(self._on_matching)
        if self._pub.matching_status.matching:
            self._matched.set()
        self.key = key

    def _on_matching(self, status: zenoh.MatchingStatus) -> None:
        if status.matching:
            self._matched.set()
        else:
            self._matched.clear()

    def wait_matched(self, timeout: float) -> None:
        if not self._matched.wait(timeout):
            raise DeadlineExceeded(f"no receiver on {self.key} within {timeout:.1f}s")

    def send(self, message: Any, tensor: Any = None) -> None:
        try:
            self._pub.put(frame.encode(message, tensor))
        except zenoh.ZError as exc:
            raise TransportError(f"send on {self.key} failed: {exc}") from exc

    def close(self) -> None:
        try:
            self._listener.undeclare()
            self._pub.undeclare()
        except zenoh.ZError:
            pass


@dataclass
class Envelope:
    source: str
    message: Any
    payload: Any  # numpy view of the frame, or an MLX array for local delivery

    @property
    def tensor(self) -> Any:
        # Queued messages stay plain bytes; MLX memory is taken only when a message is processed.
        if not isinstance(self.payload, np.ndarray):
            return self.payload
        return frame.to_mlx(self.payload, self.message.tensor.dtype)


class Inbox:
    """Merges several subscriptions into one queue; each subscription keeps its own arrival order."""

    def __init__(self, session: zenoh.Session) -> None:
        self._session = session
        self._queue: queue.Queue[Envelope | BaseException] = queue.Queue()
        self._subs: list[Any] = []

    def subscribe(self, key: str, adapter: TypeAdapter, source: str) -> None:
        def on_sample(sample: zenoh.Sample) -> None:
            try:
                message, tensor = frame.decode(bytes(sample.payload.to_bytes()), adapter)
            except Exception as exc:  # a malformed frame is a typed protocol failure, raised to the owner
                self._queue.put(frame.FrameError(f"bad message on {sample.key_expr}: {exc}"))
                return
            self._queue.put(Envelope(source, message, tensor))

        self._subs.append(self._session.declare_subscriber(key, on_sample))

    def put_local(self, source: str, message: Any, tensor: Any = None) -> None:
        self._queue.put(Envelope(source, message, tensor))

    def get(self, timeout: float | None) -> Envelope:
        """Wait for the next message; timeout None means an idle wait, which has no deadline."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise DeadlineExceeded(f"no message within {timeout:.1f}s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def get_nowait(self) -> Envelope | None:
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        for sub in self._subs:
            try:
                sub.undeclare()
            except zenoh.ZError:
                pass
        self._subs.clear()
