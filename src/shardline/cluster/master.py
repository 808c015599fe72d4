"""The master role, on one node at a time: the shell around cluster/master_state.py.

The node loop thread is the only one that changes the master's state: it calls `step` once per loop step
with what was posted to it since the last (queries, controllers' updates) and a snapshot of the node's
ClusterState, folds them in with `master_state.apply`, and carries out the effects that come back.
Other threads only post events: the zenoh queryable's callback posts each query (the zenoh Query is kept
and answered from the loop), and each InstanceController (one per instance, controller/controller.py, with
its own thread) posts an InstanceUpdate when it changes and a Laid event when it lays out a generation. A
layout is `layouts.layout` over the newest state, which is immutable: a controller reads it without
a lock.

A new master rebuilds its instances from the newest records in the view and in node reports, adopting
generations that still serve: a master change alone never restarts a runner.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zenoh

from shardline.cluster import layouts
from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster.experts import measured_load
from shardline.cluster.keys import ClusterKeys
from shardline.controller.controller import InstanceController, Launch
from shardline.controller.state import ControllerConfig, Failure, stage_phase
from shardline.dataplane.transport import Keys
from shardline.instance.settings import InstanceSettings

log = logging.getLogger("shardline.master")
CONTROLLERS_END_S = 12.0  # a controller's end joins its thread for up to 10 s; they end in parallel


@dataclass(frozen=True)
class Posted:
    """An event for one master, through its node's event queue (a deposed master's are dropped)."""

    master: Master
    event: ms.Event


class Master:
    def __init__(
        self,
        session: zenoh.Session,
        config: ms.MasterConfig,
        runners: InstanceSettings,
        term: int,
        snapshot: ms.Snapshot,
        post: Callable[[Posted], None],
        publish: Callable[[cm.ClusterView], None],
        log_events: Callable[[list[cm.ClusterEvent]], None],
        reuse: bool = True,
        forget: Callable[[str], str] = lambda node: "membership changes are not served here",
    ) -> None:
        """post: puts an event on the node's loop queue (it comes back through `step`); publish: sends a
        view to the cluster; log_events: keeps cluster events in the node's state (the views show them)."""
        self.config = config
        self.runners = runners
        self.reuse = reuse
        self.term = term
        self.state = ms.initial(config, term, snapshot)  # replaced, never changed: controllers read it
        self.controllers: dict[str, InstanceController] = {}  # the loop thread's alone
        self._session = session
        self._keys = ClusterKeys(config.namespace)
        self._post = post
        self._publish = publish
        self._log_events = log_events
        self._forget = forget  # an operator's removal of a dead member: why not, or ""
        self._pending: dict[int, zenoh.Query] = {}
        self._qids = itertools.count()
        self._closed = False
        self._queryable = session.declare_queryable(self._keys.query, self._on_query)

    def close(self, stop_runners: bool = True, wait: bool = True) -> None:
        """Stop the role. stop_runners=False (deposed): the instances live on under the new master.

        Each controller's end joins its thread (up to 10 s): they end in parallel, each on a thread of its
        own. wait=False returns at once (a deposed master, on the node's loop, which must go on); wait=True
        returns once all have ended or CONTROLLERS_END_S has passed, whichever is first."""
        self._closed = True
        try:
            self._queryable.undeclare()
        except zenoh.ZError:
            pass
        for q in list(self._pending.values()):  # unanswered: the client asks the next master
            q.drop()
        self._pending.clear()
        controllers, self.controllers = list(self.controllers.values()), {}
        ends = [
            threading.Thread(
                target=(lambda c=c: c.stop(grace_s=2.0)) if stop_runners else c.detach,
                daemon=True,
                name="instance-end",
            )
            for c in controllers
        ]
        for t in ends:
            t.start()
        if wait:
            deadline = time.monotonic() + CONTROLLERS_END_S
            for t in ends:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    # ---- from other threads: post only ---------------------------------------------------------------------

    def _on_query(self, query: zenoh.Query) -> None:
        try:
            q = cm.QUERY.validate_json(query.payload.to_bytes() if query.payload else b"")
        except Exception as exc:  # a bad query gets an error, never reaches the master's state
            reply = cm.MasterReply(ok=False, error=f"{type(exc).__name__}: {exc}", term=self.term)
            self._send(query, reply)
            return
        if isinstance(q, cm.Forget):  # the agreed membership is the node's (cluster/state.py: forget)
            why = self._forget(q.node)
            self._send(query, cm.MasterReply(ok=not why, error=why, term=self.term))
            return
        qid = next(self._qids)
        self._pending[qid] = query
        self._post(Posted(self, ms.QueryIn(qid, q, salt=uuid.uuid4().hex[:6], at=time.time())))

    def _layout(self, instance: str, generation: int, c: InstanceController) -> list[Launch]:
        """Called from the instance's controller thread, under its lock (c.state is its own to read)."""
        state = self.state  # immutable: the loop thread may replace it meanwhile
        rec = state.records.get(instance)
        keep: dict[str, tuple[int, int]] = {}
        avoid: set[str] = set()
        if rec is not None:
            keep = layouts.keep_layers(rec, c.state.failures) if c.reuse else {}
            avoid = layouts.unreachable(rec, c.state.failures)
        # The routing the last generation's expert groups saw: a new map spreads its hot experts.
        faces = [
            (v.ready.layers[0], v.heartbeat.routed)
            for v in c.state.views
            if v.ready is not None and v.heartbeat is not None and v.heartbeat.routed
        ]
        load = measured_load(faces)
        stages, launches, why = layouts.layout(state, instance, generation, keep, avoid, load)
        digest = (
            launches[0][1].digest if launches else ""
        )  # kept in the record: views carry it to a new master
        self._post(Posted(self, ms.Laid(instance, generation, stages, digest, why)))
        return launches

    def _changed(self, instance: str, c: InstanceController) -> None:
        """Called from the controller's thread: a copy of what it knows, for the loop to fold in."""
        with c._cond:
            s = c.state
            stages = []
            for v in s.views:
                w = v.weights
                path = v.ready.path if v.ready is not None else ""
                done, total = (w.done, w.total) if w else (0, 0)
                stages.append(ms.StageInfo(stage_phase(v), v.pid, done, total, path))
            update = ms.InstanceUpdate(
                instance=instance,
                generation=s.generation,
                controller_phase=s.phase,
                stages=tuple(stages),
                failures=len(s.failures),
                failure=s.failure or "",
                last_failure=s.failures[-1].why if s.failures else "",
                kv_bytes_per_token=c.kv_bytes_per_token,
                at=time.time(),
            )
        self._post(Posted(self, update))

    # ---- the loop thread -----------------------------------------------------------------------------------

    def step(self, events: list[ms.Event], snapshot: Callable[[], ms.Snapshot], changed: bool) -> None:
        """Fold what was posted, then a Seen with a fresh snapshot (the events just logged included)."""
        for e in events:
            self._apply(e)
        self._apply(ms.Seen(snapshot(), changed))

    def _apply(self, event: ms.Event) -> None:
        self.state, commands = ms.apply(self.state, event)  # first: a controller started now reads it
        logged = [cmd.event for cmd in commands if isinstance(cmd, ms.Log)]
        if logged:
            self._log_events(logged)
        for cmd in commands:
            try:
                self._do(cmd)
            except Exception:  # one command failing must not lose the others (replies above all)
                log.exception("master command %s failed", type(cmd).__name__)

    def _do(self, cmd: ms.Effect) -> None:
        if isinstance(cmd, ms.Reply):
            query = self._pending.pop(cmd.qid, None)
            if query is not None:
                self._send(query, cmd.reply)
        elif isinstance(cmd, ms.PublishView):
            self._publish(cmd.view)
        elif isinstance(cmd, ms.StartInstance):
            self._start(cmd)
        elif isinstance(cmd, ms.StopInstance):
            c = self.controllers.pop(cmd.instance, None)
            if c is not None:  # stopping waits for its thread: not in the loop
                threading.Thread(target=c.stop, args=(2.0,), daemon=True, name="instance-stop").start()
        elif isinstance(cmd, ms.FaultGeneration):
            c = self.controllers.get(cmd.instance)
            if c is not None:
                c.fault(cmd.generation, cmd.why, list(cmd.stages))

    def _send(self, query: zenoh.Query, reply: cm.MasterReply) -> None:
        try:
            query.reply(query.key_expr, reply.model_dump_json().encode())
        except zenoh.ZError:
            pass
        finally:
            query.drop()

    def _start(self, cmd: ms.StartInstance) -> None:
        rec = cmd.record
        ccfg = ControllerConfig.of(self.runners, max(1, len(rec.stages)))
        keys = Keys(rec.instance, 0, self.config.namespace)
        holder: list[InstanceController] = []
        c = InstanceController(
            self._session,
            keys,
            ccfg,
            lambda generation: self._layout(rec.instance, generation, holder[0]),
            rec.kv_budget_bytes,
            attn_keys=cmd.attn_keys,
            on_change=lambda: self._changed(rec.instance, holder[0]),
            reuse=self.reuse,
        )
        holder.append(c)
        c.term = self.term
        self.controllers[rec.instance] = c
        log.info(
            "master %s %s generation %d",
            "adopts" if cmd.adopt else "starts",
            rec.instance,
            rec.generation,
        )
        if cmd.adopt:
            agents = [self._keys.agent(s.node_id) for s in rec.stages]
            c.adopt(rec.generation, len(rec.stages), agents, rec.kv_bytes_per_token)
        else:
            c.state.generation = rec.generation  # the next generation is newer than any that ran
            if cmd.lost and rec.generation >= 0:  # the failure the old master did not live to handle
                why = f"stages {list(cmd.lost)} lost with the master"
                c.state.failures.append(
                    Failure(why, rec.generation, time.monotonic(), time.time(), [], list(cmd.lost))
                )
            c.start()
