"""Talking to a cluster from outside a node (CLI, tests, benches) or from a node's own API.

A client holds a zenoh session connected to any node, follows the master's view, sends queries to the
master, and holds fronts (front/front.py, their lifecycle in front/lifecycle.py): the request state of what
it submits lives here, so a failure of any node but the one this client is connected through costs a pause,
never a request.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zenoh
from pydantic import ValidationError

from shardline.cluster import election
from shardline.cluster import messages as cm
from shardline.cluster.keys import ClusterKeys
from shardline.cluster.placement import PlacementRequest
from shardline.dataplane import messages as m
from shardline.dataplane.frame import decode
from shardline.dataplane.transport import Link, open_session
from shardline.errors import EngineError
from shardline.front.front import Front, ModelLimits
from shardline.front.lifecycle import Fronts, catch_up
from shardline.trust.credentials import Credentials
from shardline.trust.refusals import refuse
from shardline.trust.seal import Checker

DOWNLOAD_STALL_S = 120.0  # a download whose bytes stop this long is given up (its size never bounds it)


class ClusterError(EngineError):
    """The cluster refused or could not do what was asked; the message says why (with numbers)."""


class ClusterClient:
    def __init__(
        self,
        connect: list[str],
        namespace: str = "shardline",
        credentials: Credentials | None = None,
        session: zenoh.Session | None = None,
    ) -> None:
        self.keys = ClusterKeys(namespace)
        self.namespace = namespace
        self._own_session = session is None
        link = Link(multicast_interface=None, credentials=credentials or Credentials())
        self.session = session or open_session([], connect, link)
        self.view: cm.ClusterView | None = None
        self.view_arrivals: dict[int, float] = {}  # term -> when its first view arrived (monotonic)
        self._cond = threading.Condition()
        self.fronts = Fronts(self.session, namespace)  # by instance
        self._listeners: list[Callable[[cm.ClusterView], None]] = []
        self._closed = False
        # Views are believed only under their master's seal (trust/seal.py), on a keyed or TLS cluster.
        self._checker = Checker(credentials) if credentials is not None else None
        self._sub = self.session.declare_subscriber(self.keys.view, self._on_view)

    def _on_view(self, sample: zenoh.Sample) -> None:
        data = bytes(sample.payload.to_bytes())
        try:
            view, _ = decode(data, cm.REPORTS)
        except Exception:
            return  # not obeyed, never fatal
        if not isinstance(view, cm.ClusterView):
            return
        attachment = sample.attachment.to_bytes() if sample.attachment is not None else None
        if self._checker is not None and (why := self._checker.check(view.master, data, attachment)):
            refuse("view", "seal", f"from {view.master!r}: {why}")
            return
        with self._cond:
            old = self.view
            if old is not None and not (
                election.newer(view.term, view.master, old.term, old.master) or view.term == old.term
            ):
                return
            self.view = view
            self.view_arrivals.setdefault(view.term, time.monotonic())
            fronts = self.fronts.all()
            listeners = list(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            listener(view)
        for rec in view.instances:
            front = fronts.get(rec.instance)
            if front is not None and (update := _update_of(rec, view.term)) is not None:
                catch_up(front, update)

    # ---- the view ------------------------------------------------------------------------------------------

    def listen(self, listener: Callable[[cm.ClusterView], None]) -> None:
        """Call `listener` with each newer view, from zenoh's thread: it must return at once."""
        with self._cond:
            self._listeners.append(listener)

    def wait(self, predicate, timeout: float, what: str) -> cm.ClusterView:  # type: ignore[no-untyped-def]
        """Wait for a view that satisfies predicate(view); ClusterError naming `what` past the timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.view is not None and predicate(self.view), timeout):
                raise ClusterError(f"{what} not seen within {timeout:.0f}s")
            assert self.view is not None
            return self.view

    def instance(self, instance: str) -> cm.InstanceRecord | None:
        view = self.view
        return next((r for r in view.instances if r.instance == instance), None) if view else None

    def wait_ready(self, instance: str, timeout: float) -> cm.InstanceRecord:
        def ready(v: cm.ClusterView) -> bool:
            rec = next((r for r in v.instances if r.instance == instance), None)
            if rec is not None and rec.phase == "failed":
                raise ClusterError(f"instance {instance} failed: {rec.why}")
            return rec is not None and rec.phase == "ready"

        self.wait(ready, timeout, f"instance {instance} ready")
        rec = self.instance(instance)
        assert rec is not None
        return rec

    # ---- queries to the master -----------------------------------------------------------------------------

    def ask(self, query: cm.Place | cm.Remove | cm.Forget, timeout: float = 30.0) -> cm.MasterReply:
        """Send a query to whichever node is master; retried until one answers within the timeout."""
        deadline = time.monotonic() + timeout
        if not query.nonce:
            query = query.model_copy(update={"nonce": uuid.uuid4().hex})
        while True:
            left = deadline - time.monotonic()
            replies = self.session.get(
                self.keys.query, payload=query.model_dump_json(), timeout=max(0.5, min(5, left))
            )
            for reply in replies:
                if reply.ok is not None:
                    return cm.MasterReply.model_validate_json(reply.ok.payload.to_bytes())
            if time.monotonic() >= deadline:
                raise ClusterError(f"no master answered within {timeout:.0f}s")
            self.wait(lambda v: True, max(0.1, min(1.0, deadline - time.monotonic())), "a master")

    def place(
        self,
        model: str,
        request: PlacementRequest | None = None,
        dry_run: bool = False,
        *,
        source: str = "",
        via: str = "",
        on_download: Callable[[cm.Download, cm.DownloadProgress | None], None] | None = None,
        stall_s: float = DOWNLOAD_STALL_S,
    ) -> cm.MasterReply:
        """Place `model`. With `source`, a model no live node holds is downloaded first, by one node for the
        whole cluster: this waits for it (as long as its bytes keep coming, `stall_s` at most without
        progress), telling `on_download` how far it got, then places it."""
        while True:
            reply = self._command(
                lambda: cm.Place(
                    model=model,
                    request=request or PlacementRequest(),
                    dry_run=dry_run,
                    source=source,
                    via=via,
                ),
                f"{model!r} is not a model name (letters, digits, '.', '_', '-')",
                pending_ok=True,
            )
            if reply.download is None:
                return reply
            self._await_download(reply.download, on_download, stall_s)

    def _await_download(
        self,
        d: cm.Download,
        on_download: Callable[[cm.Download, cm.DownloadProgress | None], None] | None,
        stall_s: float,
    ) -> None:
        """Until the view no longer lists the download (the model is held: place it) or its node says it
        failed (ClusterError with its reason); a download whose bytes stop for stall_s is given up."""
        last: tuple[int, str] | None = None
        moved = time.monotonic()
        while True:
            view = self.wait(lambda v: True, 30.0, "a view")
            current = next((x for x in view.downloads if x.model == d.model), None)
            if current is None:
                return
            node = next((n for n in view.nodes if n.node_id == current.node_id), None)
            p = node.downloads.get(d.model) if node is not None else None
            if p is not None and p.source != current.source:
                p = None
            if on_download is not None:
                on_download(current, p)
            if p is not None and p.phase == "failed":
                what = f"downloading {current.source} on node {current.node_id}"
                raise ClusterError(f"{what} failed: {p.error}")
            mark = (p.done_bytes, p.phase) if p is not None else None
            if mark != last:
                last, moved = mark, time.monotonic()
            elif time.monotonic() - moved > stall_s:
                what = f"downloading {current.source} on node {current.node_id}"
                raise ClusterError(f"{what} made no progress for {stall_s:.0f}s")
            seq = (view.term, view.seq)
            try:  # the master publishes a view at least every VIEW_PERIOD_S; a quiet spell just loops
                self.wait(lambda v, seq=seq: (v.term, v.seq) != seq, 2.0, "a newer view")
            except ClusterError:
                pass

    def remove(self, instance: str) -> None:
        self._command(lambda: cm.Remove(instance=instance), f"{instance!r} is not an instance id")

    def forget(self, node: str) -> None:
        """Remove a member that died from the agreed membership (it no longer counts against the quorum)."""
        self._command(lambda: cm.Forget(node=node), f"{node!r} is not a node id")

    def _command(self, make: Callable[[], Any], invalid: str, pending_ok: bool = False) -> cm.MasterReply:
        """Ask the master what `make` builds; ClusterError saying `invalid` when it cannot be built, or the
        master's own error when it refuses (a download it waits on is no refusal, with `pending_ok`)."""
        try:
            query = make()
        except ValidationError as exc:
            raise ClusterError(invalid) from exc
        reply = self.ask(query)
        if pending_ok and reply.download is not None:
            return reply
        if not reply.ok:
            raise ClusterError(reply.error)
        return reply

    # ---- requests ------------------------------------------------------------------------------------------

    def front(self, instance: str, **kw: object) -> Front:
        """This client's front for an instance (made once); it serves as soon as the instance is ready."""
        with self._cond:
            if self._closed:
                raise EngineError("client is closed")
            front = self.fronts.get(instance)
            rec = self.instance(instance)
            if front is None:
                if rec is None:
                    raise ClusterError(f"no instance {instance!r} in the cluster")
                limits = ModelLimits(rec.vocab_size or 2**31, rec.context_length or 2**31)
                front = self.fronts.open(instance, limits, **kw)
            term = self.view.term if self.view is not None else 0
        update = _update_of(rec, term) if rec is not None else None
        if update is not None:
            catch_up(front, update)
        return front

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self.fronts.close_all("client closed")
        try:
            self._sub.undeclare()
            if self._own_session:
                self.session.close()
        except zenoh.ZError:
            pass

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _update_of(rec: cm.InstanceRecord, term: int) -> m.Serving | m.InstanceFailed | None:
    """What a view of master term `term` says the controller announced of an instance (front/lifecycle.py's
    catch_up tells a front that missed it)."""
    if rec.phase == "ready":
        return m.Serving(
            generation=rec.generation,
            term=term,
            kv_bytes_per_token=rec.kv_bytes_per_token,
            kv_budget_bytes=rec.kv_budget_bytes,
        )
    if rec.phase == "failed":
        return m.InstanceFailed(why=rec.why, term=term)
    return None
