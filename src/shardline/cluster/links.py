"""Each node measures its links to its peers: what placement weighs tensor parallelism's sums against.

A node answers pings on its own key (a queryable that returns as many bytes as asked, up to MAX_ASKED), and
on a period asks each live peer: small queries for the round trip (the best of a few), and one of
BULK_BYTES for the bandwidth. A reply is sent on zenoh's own thread, so the bulk one stays small: a large
reply to a peer whose link is down would hold that thread (and the node's other traffic) until it drains.
The figures go in its report (facts live with who owns them); placement reads the slowest pair.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable

import zenoh

from shardline.cluster import messages as cm

log = logging.getLogger("shardline.links")
PERIOD_S = 60.0  # links change slowly; a probe costs each peer a few small queries and three 64 KB replies
SMALL_TRIES = 5
BULK_TRIES = 3  # the best of a few: one reply's time is as noisy as a small query's
BULK_BYTES = 64 << 10
MAX_ASKED = BULK_BYTES  # a ping never makes a node send more than this
TIMEOUT_S = 2.0


def ping_key(namespace: str, node: str) -> str:
    return f"{namespace}/node/{node}/ping"


class LinkProber:
    def __init__(
        self, session: zenoh.Session, namespace: str, node_id: str, peers: Callable[[], list[str]]
    ) -> None:
        self.session, self.namespace, self.node_id, self.peers = session, namespace, node_id, peers
        self.links: dict[str, cm.LinkFact] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._queryable = session.declare_queryable(ping_key(namespace, node_id), self._on_ping)
        self._thread = threading.Thread(target=self._run, daemon=True, name="link-prober")

    def start(self) -> LinkProber:
        self._thread.start()
        return self

    def _on_ping(self, query: zenoh.Query) -> None:
        try:
            raw = query.payload.to_bytes() if query.payload is not None else b""
            (asked,) = struct.unpack("<I", raw[:4]) if len(raw) >= 4 else (0,)
            query.reply(query.key_expr, bytes(min(asked, MAX_ASKED)))
        except (zenoh.ZError, struct.error):
            pass

    def _ask(self, peer: str, nbytes: int) -> float | None:
        start = time.perf_counter()
        for reply in self.session.get(
            ping_key(self.namespace, peer), payload=struct.pack("<I", nbytes), timeout=TIMEOUT_S
        ):
            if reply.ok is not None and len(reply.ok.payload.to_bytes()) == nbytes:
                return time.perf_counter() - start
        return None

    def _best(self, peer: str, nbytes: int, tries: int) -> float | None:
        times = [t for t in (self._ask(peer, nbytes) for _ in range(tries)) if t is not None]
        return min(times) if times else None

    def measure(self, peer: str) -> cm.LinkFact | None:
        rtt = self._best(peer, 16, SMALL_TRIES)
        bulk = self._best(peer, BULK_BYTES, BULK_TRIES)
        if rtt is None or bulk is None:
            return None
        return cm.LinkFact(rtt_us=rtt * 1e6, bytes_per_s=BULK_BYTES / max(bulk - rtt, 1e-6))

    def snapshot(self) -> dict[str, cm.LinkFact]:
        with self._lock:
            return dict(self.links)

    def _run(self) -> None:
        while not self._closed.is_set():
            peers = [p for p in self.peers() if p != self.node_id]
            for peer in peers:
                if self._closed.is_set():
                    return
                try:
                    fact = self.measure(peer)
                except zenoh.ZError:
                    fact = None
                with self._lock:
                    if fact is not None:
                        self.links[peer] = fact
                    else:
                        self.links.pop(peer, None)
            with self._lock:
                for gone in set(self.links) - set(peers):
                    del self.links[gone]
            # Soon after start (peers appear), then on the period.
            self._closed.wait(2.0 if not self.links and not peers else PERIOD_S)

    def close(self) -> None:
        self._closed.set()
        try:
            self._queryable.undeclare()
        except zenoh.ZError:
            pass
