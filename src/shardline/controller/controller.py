"""The instance controller: generations, bring-up, health judgment, restarts.

A thin shell around the fold in controller/state.py: it holds the state, folds in every status message and
the clock's ticks, and carries out the effects: StartRunner / StopGeneration to node agents, Serving /
Recovering / InstanceFailed to the fronts, a layout computed and folded back. Where the stages go is the
layout's business (a fixed split on one machine, the master's placement in a cluster). It holds no request
and is not on the data path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zenoh

from shardline.dataplane import messages as m
from shardline.dataplane.transport import DeadlineExceeded, Inbox, Keys, Outbox

from . import events as ev
from . import state as st
from .events import Launch

__all__ = ["InstanceController", "Launch", "Layout", "LayoutError"]

log = logging.getLogger("shardline.controller")
TICK_S = 0.1  # how often health is judged when nothing arrives
MATCH_S = 10.0  # how long a first command waits for its node agent to listen


class LayoutError(Exception):
    """No layout for a new generation (the model does not fit what is left): the instance fails with this."""


# generation -> one launch per stage, in stage order; raises LayoutError when there is no room.
Layout = Callable[[int], list[Launch]]


class InstanceController:
    def __init__(
        self,
        session: zenoh.Session,
        keys: Keys,
        config: st.ControllerConfig,
        layout: Layout,
        kv_budget_bytes: int,
        attn_keys: int,
        on_change: Callable[[], None] = lambda: None,
        reuse: bool = False,
    ) -> None:
        """on_change: called (outside the lock) after the state changed phase or generation.
        reuse: after a failure, stop only the blamed stages; the layout may hand the others' processes to
        the next generation (StartRunner.reuse), and whatever it did not reuse is stopped at launch."""
        self.reuse = reuse
        self.config = config
        self.keys = keys
        self.layout = layout
        # Replaced by each fold (never changed in place), read under _cond by callers.
        self.state = st.initial(config, attn_keys, keys.instance, kv_budget_bytes, reuse)
        self._on_change = on_change
        self._session = session
        self._cond = threading.Condition()
        self._stopping = False
        self._adopted = False  # a generation taken over (adopt), not one to launch
        self._inbox = Inbox(session, name="controller")
        self._inbox.subscribe(self.keys.status_any, m.STATUS, "status")
        self._inbox.subscribe(self.keys.reports, m.STATUS, "reports")
        self._agents: dict[str, Outbox] = {}  # every node agent this instance ever used
        self._updates = Outbox(session, self.keys.updates)
        self._outgoing: list[tuple[Outbox, Any]] = []  # decided under the lock, sent after it
        self._thread = threading.Thread(target=self._run, daemon=True, name="instance-controller")

    @property
    def term(self) -> int:
        """The master's term, stamped on commands (node agents obey the highest they saw)."""
        return self.state.term

    @term.setter
    def term(self, term: int) -> None:
        with self._cond:
            self.state.term = term  # set before start, when nothing else reads the state

    @property
    def kv_bytes_per_token(self) -> int:
        return self.state.kv_bytes_per_token

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, wait_for: float | None = None) -> None:
        """wait_for: how long to wait for a front to listen (a local engine has one from the start)."""
        if wait_for is not None:
            self._updates.wait_matched(wait_for)
        self._thread.start()

    def adopt(self, generation: int, stages: int, agent_keys: list[str], kv_bytes_per_token: int) -> None:
        """Take over a generation that serves already (a new master), instead of launching one."""
        self._adopted = True
        for key in agent_keys:  # publishers declared now: they match their agents before any command
            self._agent(key)
        with self._cond:
            adopt = ev.Adopt(generation, stages, list(agent_keys), kv_bytes_per_token, time.monotonic())
            self._fold_guarded(adopt, "controller start failed")
        self._thread.start()

    def wait_settled(self, timeout: float) -> st.Phase:
        """Wait until the instance serves, has failed or is stopped (bring-up retries included)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state.phase in ("serving", "failed", "stopped"), timeout)
            return self.state.phase

    def fault(self, generation: int, why: str, stages: list[int] | None = None) -> None:
        """Someone else saw this generation break (its node left the cluster): recover it."""
        with self._cond:
            self._fold(ev.Broken(generation, why, list(stages or [])))

    def detach(self) -> None:
        """Stop judging and leave every runner as it is: a new master takes the instance over."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for outbox in [*self._agents.values(), self._updates]:
            outbox.close()
        self._inbox.close()

    def stop(self, grace_s: float) -> None:
        """Stop judging, then have the agents stop every runner (the leader's agent asks it to stop its ring
        first: agents obey only the highest master term, so a deposed master stops nothing)."""
        with self._cond:
            self._stopping = True
            self.state, effects = st.apply(self.state, ev.Retire(grace_s))
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for e in effects:
            if isinstance(e, ev.ToAgent):
                try:
                    self._agent(e.agent).send(e.message)
                except Exception:
                    pass
        for agent in list(self._agents.values()):
            agent.close()
        self._updates.close()
        self._inbox.close()

    # ---- loop --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        with self._cond:
            # Stopped before it began: nothing to launch (stop's commands cover the agents known then).
            if not self._adopted and not self._stopping:
                self._fold_guarded(ev.Begin(time.monotonic()), "controller start failed")
            done = self.state.phase == "failed"
        self._flush()
        self._on_change()  # the first generation (or the reason there is none) is news too
        if done:
            return
        while True:
            try:
                first = self._inbox.get(timeout=TICK_S)
            except DeadlineExceeded:
                first = None
            with self._cond:
                if self._stopping:
                    return
                # Everything that arrived is folded in before judging: a slow loop never mistakes its own
                # lateness for a silent stage (arrival times are stamped on receipt).
                envs = [first] if first is not None else []
                while (more := self._inbox.get_nowait()) is not None:
                    envs.append(more)
                before = (self.state.phase, self.state.generation)
                for env in envs:
                    self._fold(ev.Heard(env.message, env.generation, env.received_at))
                self._fold_guarded(ev.Clock(time.monotonic(), time.time()), "controller step failed")
                done = self.state.phase == "failed"
                changed = before != (self.state.phase, self.state.generation) or bool(envs)
            self._flush()
            if changed:
                self._on_change()
            if done:
                return

    def _fold_guarded(self, event: ev.Event, what: str) -> None:
        try:
            self._fold(event)
        except Exception as exc:  # the controller must never die silently: requests would wait
            log.exception(what)
            self._fold(ev.Abandon(f"controller failed: {type(exc).__name__}: {exc}"))

    def _fold(self, event: ev.Event) -> None:
        """Under the lock: fold one event in and carry out its effects; a layout asked for is computed here
        and folded back at once, so no one sees the state between the two."""
        pending: list[ev.Event] = [event]
        while pending:
            self.state, effects = st.apply(self.state, pending.pop(0))
            for e in effects:
                if isinstance(e, ev.ToAgent):
                    self._outgoing.append((self._agent(e.agent), e.message))
                elif isinstance(e, ev.ToFronts):
                    self._outgoing.append((self._updates, e.message))
                elif isinstance(e, ev.Note):
                    log.log(e.level, "%s", e.text)
                elif isinstance(e, ev.Lay):
                    try:
                        launches = self.layout(e.generation)
                    except LayoutError as exc:
                        pending.append(ev.Abandon(str(exc)))
                    else:
                        pending.append(ev.LaidOut(e.generation, launches, e.now))
        self._cond.notify_all()

    def _agent(self, key: str) -> Outbox:
        if key not in self._agents:
            self._agents[key] = Outbox(self._session, key, sealed=True)  # agents check who commands
        return self._agents[key]

    def _flush(self) -> None:
        """Send what was decided, outside the lock: judging never waits on the network."""
        with self._cond:
            out, self._outgoing = self._outgoing, []
        for outbox, message in out:
            try:
                if isinstance(message, m.StartRunner):
                    outbox.wait_matched(MATCH_S)  # a node agent that just joined may not listen yet
                outbox.send(message)
            except Exception:
                log.exception("could not send %s on %s", type(message).__name__, outbox.key)

    # ---- views for callers -------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        return self._inbox.dropped + self.state.dropped

    def fresh_heartbeats(self, timeout: float) -> list[m.Heartbeat] | None:
        """One heartbeat from every stage received after this call (runner counters are then current)."""
        since = time.monotonic()
        with self._cond:
            ok = self._cond.wait_for(
                lambda: all(v.heartbeat is not None and v.heartbeat_at > since for v in self.state.views),
                timeout,
            )
            return [v.heartbeat for v in self.state.views] if ok else None  # type: ignore[misc]
