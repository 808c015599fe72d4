"""zenoh sessions, point-to-point keys and in-order inboxes with deadlines.

Each link has exactly one publisher per sender. zenoh keeps per-publisher order over a reliable, blocking
(never dropping) channel; sequence numbers in the messages let the receiver prove it. An inbox trusts
nothing it reads: a frame that fails to parse or names another generation is dropped and counted.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zenoh
from pydantic import TypeAdapter

from shardline.dataplane import frame
from shardline.trust import seal
from shardline.trust.credentials import Credentials

log = logging.getLogger("shardline.transport")


class DeadlineExceeded(TimeoutError):
    pass


class TransportError(RuntimeError):
    pass


@dataclass(frozen=True)
class Link:
    """How a session joins its cluster: transport lease, multicast scouting, key and TLS."""

    lease_ms: int = 2000  # a peer silent this long is gone (zenoh's default is 10 s)
    multicast_interface: str | None = None  # None: multicast scouting off (peers named explicitly)
    credentials: Credentials = field(
        default_factory=Credentials
    )  # a peer without the same key or CA cannot connect


def session_config(listen: list[str], connect: list[str], link: Link | None = None) -> zenoh.Config:
    """The session's configuration, less its credentials (Credentials.applied adds them)."""
    link = link or Link()
    listen = [link.credentials.endpoint(e) for e in listen]
    connect = [link.credentials.endpoint(e) for e in connect]
    config = zenoh.Config()
    config.insert_json5("mode", '"peer"')
    # Multicast scouting would announce us on the machine's real interfaces unless an interface is named.
    config.insert_json5("scouting/multicast/enabled", json.dumps(link.multicast_interface is not None))
    if link.multicast_interface is not None:
        config.insert_json5("scouting/multicast/interface", json.dumps(link.multicast_interface))
    config.insert_json5("listen/endpoints", json.dumps(listen))
    config.insert_json5("connect/endpoints", json.dumps(connect))
    # zenoh would copy messages above 3 KB to a peer on the same host through a 16 MiB shared-memory pool,
    # mapped at the first such message and kept: a weight copy left a node daemon 16 MiB larger, and each
    # runner held 26 MB more at its peak for no measured speed (a prefill chunk's hidden states go in
    # well under a millisecond over loopback TCP; `bench engine`'s streams were as fast without it).
    config.insert_json5("transport/shared_memory/enabled", "false")
    config.insert_json5("transport/link/tx/lease", str(link.lease_ms))
    config.insert_json5("transport/link/tx/keep_alive", "4")
    return config


def open_session(listen: list[str], connect: list[str], link: Link | None = None) -> zenoh.Session:
    # zenoh closes a link to a vanished peer with a 10 s socket linger, blocking the receive thread that
    # closes it; with its default two receive threads a pulled cable stalls the whole session that long.
    os.environ.setdefault("ZENOH_RUNTIME", "(rx: (worker_threads: 8))")
    link = link or Link()
    with link.credentials.applied(session_config(listen, connect, link)) as config:
        return zenoh.open(config)


@dataclass(frozen=True)
class Keys:
    """Key space of one instance; per-generation keys keep an old generation's traffic apart."""

    instance: str
    generation: int = 0
    namespace: str = "shardline"  # the cluster's: clusters with different namespaces never see each other

    @property
    def base(self) -> str:
        return f"{self.namespace}/i/{self.instance}"

    def at(self, generation: int) -> Keys:
        return Keys(self.instance, generation, self.namespace)

    @property
    def root(self) -> str:
        return f"{self.base}/g{self.generation}"

    def ring(self, to_stage: int) -> str:
        return f"{self.root}/ring/{to_stage}"

    @property
    def control(self) -> str:
        return f"{self.root}/control"

    @property
    def events(self) -> str:
        return f"{self.root}/events"

    @property
    def events_any(self) -> str:
        # Fronts listen before they know the generation: a leader's events must match a receiver at once.
        return f"{self.base}/*/events"

    def reply(self, front: str) -> str:
        """One front's own events (its requests' tokens and ends): no front receives another's traffic."""
        return f"{self.root}/events/{front}"

    def replies_any(self, front: str) -> str:
        return f"{self.base}/*/events/{front}"

    def status(self, stage: int) -> str:
        return f"{self.root}/status/{stage}"

    @property
    def status_any(self) -> str:
        return f"{self.base}/*/status/*"

    @staticmethod
    def parse_status(key: str) -> tuple[Keys, int]:
        """The keys (at their generation) and the stage of a key `status` made; ValueError for any other."""
        *head, i, instance, gen, status, stage = key.split("/")
        if i != "i" or status != "status" or not gen.startswith("g"):
            raise ValueError(f"not a status key: {key!r}")
        return Keys(instance, int(gen[1:]), "/".join(head)), int(stage)

    def runner(self, runner_id: str) -> str:
        return f"{self.base}/runner/{runner_id}"  # node agent -> one runner process, across generations

    @property
    def reports(self) -> str:
        return f"{self.base}/reports"  # node agents and fronts -> controller

    @property
    def updates(self) -> str:
        return f"{self.base}/updates"  # controller -> fronts


class Outbox:
    """The single sender of one link; frames carry the sender's generation."""

    def __init__(
        self,
        session: zenoh.Session,
        key: str,
        generation: int = 0,
        on_lost: Callable[[], None] | None = None,
        lost_grace_s: float = 0.5,
        sealed: bool = False,
    ) -> None:
        """on_lost: called (on its own thread) when a receiver that was there is gone for lost_grace_s.
        sealed: every frame carries the seal of the node that owns the session (trust/seal.py), if any."""
        self._sealer = seal.sealer_of(session) if sealed else None
        self._on_lost = on_lost
        self._lost_grace_s = lost_grace_s
        self._matched = threading.Event()
        self._pub = session.declare_publisher(
            key, congestion_control=zenoh.CongestionControl.BLOCK, express=True
        )
        self._listener = self._pub.declare_matching_listener(self._on_matching)
        if self._pub.matching_status.matching:
            self._matched.set()
        self.key = key
        self.generation = generation

    def _on_matching(self, status: zenoh.MatchingStatus) -> None:
        if status.matching:
            self._matched.set()
        else:
            was = self._matched.is_set()
            self._matched.clear()
            if was and self._on_lost is not None:
                threading.Thread(target=self._confirm_lost, daemon=True, name="outbox-lost").start()

    def _confirm_lost(self) -> None:
        # A route re-formed around a peer that left can blink: only a receiver gone for the grace is lost.
        if not self._matched.wait(self._lost_grace_s) and self._on_lost is not None:
            self._on_lost()

    def wait_matched(self, timeout: float, abort: Callable[[], None] | None = None) -> None:
        """Wait for a receiver; `abort` is called every 0.1 s and may raise to give up the wait early."""
        deadline = time.monotonic() + timeout
        while not self._matched.wait(min(0.1, max(0.0, deadline - time.monotonic())) if abort else timeout):
            if time.monotonic() >= deadline or abort is None:
                raise DeadlineExceeded(f"no receiver on {self.key} within {timeout:.1f}s")
            abort()

    def send(self, message: Any, tensor: Any = None) -> None:
        try:
            data = frame.encode(message, tensor, self.generation)
            self._pub.put(data, attachment=self._sealer.seal(data) if self._sealer is not None else None)
        except zenoh.ZError as exc:
            raise TransportError(f"send on {self.key} failed: {exc}") from exc

    def send_raw(self, data: bytes) -> None:
        """Bytes as they are (tests of what receivers do with garbage)."""
        self._pub.put(data)

    def close(self) -> None:
        self._on_lost = None  # closing is not losing
        try:
            self._listener.undeclare()
            self._pub.undeclare()
        except zenoh.ZError:
            pass


@dataclass
class Envelope:
    source: str
    message: Any
    payload: Any  # numpy view of the frame
    generation: int = 0
    received_at: float = field(default_factory=time.monotonic)  # stamped on arrival, not when read

    @property
    def tensor(self) -> Any:
        # Queued messages stay plain bytes; MLX memory is taken only when a message is processed.
        if self.payload is None:
            return None
        return frame.to_mlx(self.payload, self.message.tensor.dtype)


class Inbox:
    """Merges several subscriptions into one queue; each subscription keeps its own arrival order.

    generation: accept only frames of this generation (None: any; the receiver sorts them out).
    capacity: messages queued at most. Past it a message is dropped and counted, never waited for: a reader
    that fell behind must not stall zenoh's receive threads, and through them every sender on the session
    (a loss is caught like any other, by a deadline or an index gap). Senders that matter bound their own
    traffic well below it (the ring's window, the fronts' queues).
    """

    def __init__(
        self,
        session: zenoh.Session,
        generation: int | None = None,
        name: str = "inbox",
        capacity: int = 4096,
    ) -> None:
        self._session = session
        self._generation = generation
        self._name = name
        self._queue: queue.Queue[Envelope] = queue.Queue(maxsize=capacity)
        self._subs: list[Any] = []
        self._watchers: dict[str, tuple[Callable[[Envelope], None], bool]] = {}
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()  # the producers' (zenoh's receive threads and inject)
        self.dropped = 0
        self.last_drop = ""

    def drop(self, why: str) -> None:
        """Count a refused message (here, or by the owner for a reason only it can judge)."""
        with self._lock:
            self.dropped += 1
            self.last_drop = why
            n = self.dropped
        if n <= 5 or n % 100 == 0:  # say it, without letting a flood fill the log
            log.warning("%s dropped message %d: %s", self._name, n, why)

    def subscribe(
        self,
        key: str,
        adapter: TypeAdapter,
        source: str,
        check: Callable[[bytes, bytes | None], str | None] | None = None,
    ) -> None:
        """check(frame, attachment): why a frame is refused before it is decoded (None: taken)."""

        def on_sample(sample: zenoh.Sample) -> None:
            received = time.monotonic()
            try:
                data = bytes(sample.payload.to_bytes())
                generation = frame.generation_of(data)
                if self._generation is not None and generation != self._generation:
                    self.drop(f"frame of generation {generation} on {sample.key_expr}")
                    return
                attachment = sample.attachment.to_bytes() if sample.attachment is not None else None
                if check is not None and (why := check(data, attachment)) is not None:
                    self.drop(f"frame on {sample.key_expr} refused: {why}")
                    return
                message, tensor = frame.decode(data, adapter)
            except Exception as exc:  # never obeyed, never fatal: a real loss is caught by a deadline
                self.drop(f"bad frame on {sample.key_expr}: {str(exc)[:200]}")
                return
            self._put(Envelope(source, message, tensor, generation, received))

        self._subs.append(self._session.declare_subscriber(key, on_sample))

    def watch(self, source: str, callback: Callable[[Envelope], None], queued_only: bool = False) -> None:
        """Also hand messages from `source` to `callback` as they arrive (for a wait that cannot read).
        queued_only: only those the queue takes (what counts as received must be what a reader will see)."""
        self._watchers[source] = (callback, queued_only)

    def queued(self, source: str) -> list[Any]:
        """The messages from `source` waiting to be read, in order (a snapshot: more may come)."""
        with self._queue.mutex:
            return [e.message for e in self._queue.queue if e.source == source]

    def inject(self, source: str, message: Any) -> None:
        """Queue a message as if it had arrived (what a late receiver learns from elsewhere)."""
        self._put(Envelope(source, message, None))

    def _put(self, env: Envelope) -> None:
        """Queue a message, or drop it when full. Its watcher hears only a message that is queued (a Submit
        dropped here must not count as received) when it asked for that, and before a reader can take it."""
        with self._put_lock:
            # Only producers, all under this lock, fill the queue: a slot seen free here stays free.
            full = self._queue.full()
            watcher, queued_only = self._watchers.get(env.source, (None, False))
            if watcher is not None and not (full and queued_only):
                try:
                    watcher(env)
                except Exception:
                    log.exception("watcher of %s failed", env.source)
            if full:
                self.drop(
                    f"{type(env.message).__name__} from {env.source}: {self._queue.maxsize} messages queued"
                )
                return
            self._queue.put_nowait(env)

    def get(self, timeout: float | None) -> Envelope:
        """Wait for the next message; timeout None means an idle wait, which has no deadline."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise DeadlineExceeded(f"no message within {timeout:.1f}s") from None

    def get_nowait(self) -> Envelope | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        for sub in self._subs:
            try:
                sub.undeclare()
            except zenoh.ZError:
                pass
        self._subs.clear()
