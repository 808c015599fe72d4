"""What the API hears from the cluster, off zenoh's threads: it follows the master's view (a front for every
instance, so live figures are everywhere; the fronts of removed instances closed, see front/lifecycle.py),
fans cluster events out to /events listeners (server-sent events), samples the dashboard's figures, and
observes each stage's steps from its heartbeats in /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zenoh

from shardline.api.live import SAMPLE_S, Histories
from shardline.api.metrics import Metrics
from shardline.api.steps import StepCounts
from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterClient, ClusterError
from shardline.dataplane import messages as m
from shardline.dataplane.frame import decode
from shardline.dataplane.transport import Keys
from shardline.errors import EngineError
from shardline.front.figures import LeaderFigures

log = logging.getLogger("shardline.api")


class Events:
    def __init__(
        self,
        client: ClusterClient,
        metrics: Metrics,
        run_deferred: Callable[[], None],
        max_queue: int,
    ) -> None:
        """run_deferred: the service's closes handed over by finalisers, run from this thread (no lock held).
        max_queue: the waiting requests each front takes (the node's max_pending)."""
        self.client = client
        self.metrics = metrics
        self._run_deferred = run_deferred
        self._max_queue = max_queue
        self._events_seen: set[tuple[float, str, str, str]] = set()
        self.recent_events: deque[cm.ClusterEvent] = deque(maxlen=500)
        # /events listeners: asyncio queues on the server's loop.
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[tuple[str, Any]]]] = set()
        self._listeners_lock = threading.Lock()
        self._views: deque[cm.ClusterView] = deque(maxlen=1)
        self._view_ready = threading.Event()
        self._closed = threading.Event()
        self._steps = StepCounts()
        self.histories = Histories()
        self._status_sub = client.session.declare_subscriber(
            Keys("*", namespace=client.namespace).status_any, self._on_status
        )
        client.listen(self._on_view)
        self._thread = threading.Thread(target=self._follow, daemon=True, name="api-views")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._view_ready.set()
        self._thread.join(timeout=5)
        try:
            self._status_sub.undeclare()
        except zenoh.ZError:
            pass

    def figures(self) -> dict[str, LeaderFigures]:
        """Each instance's figures from its leader's beats (every node's traffic), by instance."""
        return {i: f.figures for i, f in self.client.fronts.all().items()}

    # ---- the master's view ---------------------------------------------------------------------------------

    def _on_view(self, view: cm.ClusterView) -> None:
        self._views.append(view)
        self._view_ready.set()

    def _follow(self) -> None:
        """Off zenoh's thread: fronts for every instance (live figures everywhere), events to listeners."""
        sampled = time.monotonic()
        while not self._closed.is_set():
            self._view_ready.wait(timeout=max(0.0, sampled + SAMPLE_S - time.monotonic()))
            self._view_ready.clear()
            self._run_deferred()
            if time.monotonic() - sampled >= SAMPLE_S:
                sampled = time.monotonic()
                self.histories.sample_all(self.figures(), sampled)
                self._broadcast("view", None)  # the sparklines move even when the cluster does not
            try:
                view = self._views.pop()
            except IndexError:
                continue
            try:
                self._take(view)
            except Exception:
                log.exception("api: following the view failed")

    def _take(self, view: cm.ClusterView) -> None:
        for instance in self.client.fronts.close_unlisted({r.instance for r in view.instances}):
            self._steps.forget(instance)
            self.metrics.forget_instance(instance)
        for rec in view.instances:
            if rec.phase != "failed" and self.client.fronts.get(rec.instance) is None:
                try:
                    self.client.front(rec.instance, max_queue=self._max_queue)
                except (ClusterError, EngineError):
                    pass
        new = []
        for e in view.events:
            key = (e.at, e.kind, e.node, e.instance)
            if key not in self._events_seen:
                self._events_seen.add(key)
                new.append(e)
                self.recent_events.append(e)
                self.metrics.cluster_events.labels(e.kind).inc()
        if len(self._events_seen) > 5000:  # keep the dedup set bounded: views carry only the newest few
            self._events_seen = {(e.at, e.kind, e.node, e.instance) for e in view.events}
        for e in new:
            self._broadcast("cluster", e.model_dump(mode="json"))
        self._broadcast("view", None)

    # ---- server-sent events --------------------------------------------------------------------------------

    def _broadcast(self, kind: str, data: Any) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for loop, q in listeners:
            try:
                loop.call_soon_threadsafe(_offer, q, (kind, data))
            except RuntimeError:  # its loop closed
                pass

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)
        with self._listeners_lock:
            self._listeners.add((asyncio.get_running_loop(), q))
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        with self._listeners_lock:
            self._listeners = {(lp, x) for lp, x in self._listeners if x is not q}

    # ---- step metrics --------------------------------------------------------------------------------------

    def _on_status(self, sample: zenoh.Sample) -> None:
        try:
            msg, _ = decode(bytes(sample.payload.to_bytes()), m.STATUS)
        except Exception:
            return
        if not isinstance(msg, m.Heartbeat) or msg.last_step is None:
            return
        try:
            keys, _ = Keys.parse_status(str(sample.key_expr))
        except ValueError:
            return
        if self._steps.advance(keys.instance, msg.slot, msg.steps):
            self.metrics.observe_step(keys.instance, msg.slot, msg.last_step.seconds)


def _offer(q: asyncio.Queue[tuple[str, Any]], item: tuple[str, Any]) -> None:
    if q.full():  # a slow listener misses events rather than holding memory; it can re-read /state
        try:
            q.get_nowait()
        except asyncio.QueueEmpty:
            pass
    q.put_nowait(item)
