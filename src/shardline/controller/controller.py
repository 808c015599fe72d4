"""The instance controller: generations, bring-up, health judgment, restarts.

A thin shell around controller/state.py: it folds status messages into the state, asks `judge` and
`after_failure` what to do, and says it in messages: StartRunner / StopGeneration to node agents,
Serving / Recovering / InstanceFailed to the fronts. Where the stages go is the layout's business (a fixed
split on one machine, the master's placement in a cluster). It holds no request and is not on the data path.
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

from . import state as st

log = logging.getLogger("shardline.controller")
TICK_S = 0.1  # how often health is judged when nothing arrives
MATCH_S = 10.0  # how long a first command waits for its node agent to listen


class LayoutError(Exception):
    """No layout for a new generation (the model does not fit what is left): the instance fails with this."""


Launch = tuple[str, m.StartRunner]  # a node agent's key, and what it is to start
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
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = 0
        self.state = st.ControllerState(stages=config.stages)
        st.set_attention_scale(self.state, attn_keys)
        self.launches: list[Launch] = []  # the current generation's
        self.term = 0  # the master's term, stamped on commands (node agents obey the highest they saw)
        self._on_change = on_change
        self._session = session
        self._cond = threading.Condition()
        self._stopping = False
        self._adopted: tuple[int, int] | None = None
        self._inbox = Inbox(session, name="controller")
        self._inbox.subscribe(self.keys.status_any, m.STATUS, "status")
        self._inbox.subscribe(self.keys.reports, m.STATUS, "reports")
        self._agents: dict[str, Outbox] = {}  # every node agent this instance ever used
        self._updates = Outbox(session, self.keys.updates)
        self._outgoing: list[tuple[Outbox, Any]] = []  # decided under the lock, sent after it
        self._thread = threading.Thread(target=self._run, daemon=True, name="instance-controller")

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, wait_for: float | None = None) -> None:
        """wait_for: how long to wait for a front to listen (a local engine has one from the start)."""
        if wait_for is not None:
            self._updates.wait_matched(wait_for)
        self._thread.start()

    def adopt(self, generation: int, stages: int, agent_keys: list[str], kv_bytes_per_token: int) -> None:
        """Take over a generation that serves already (a new master), instead of launching one."""
        self._adopted = (generation, stages)
        self.kv_bytes_per_token = kv_bytes_per_token
        for key in agent_keys:
            self._agent(key)
        self._thread.start()

    def wait_settled(self, timeout: float) -> st.Phase:
        """Wait until the instance serves, has failed or is stopped (bring-up retries included)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state.phase in ("serving", "failed", "stopped"), timeout)
            return self.state.phase

    def fault(self, generation: int, why: str, stages: list[int] | None = None) -> None:
        """Someone else saw this generation break (its node left the cluster): recover it."""
        with self._cond:
            if generation == self.state.generation and self.state.fault is None:
                self.state.fault = why
                self.state.fault_stages = list(stages or [])

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
            self.state.phase = "stopped"
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for agent in list(self._agents.values()):
            try:
                stop = m.StopGeneration(instance=self.keys.instance, keep=-1, grace_s=grace_s, term=self.term)
                agent.send(stop)
            except Exception:
                pass
            agent.close()
        self._updates.close()
        self._inbox.close()

    # ---- loop --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        with self._cond:
            try:
                if self._adopted is not None:
                    st.adopt(self.state, *self._adopted, time.monotonic())
                    self._say(self._serving())
                else:
                    self._launch(time.monotonic())
            except Exception as exc:  # as in _act: an instance must never stay `placed` without a word
                log.exception("controller start failed")
                self._give_up(f"controller failed: {type(exc).__name__}: {exc}")
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
                    st.apply(self.state, env.message, env.generation, env.received_at)
                self._cond.notify_all()
                try:
                    self._act(time.monotonic())
                except Exception as exc:  # the controller must never die silently: requests would wait
                    log.exception("controller step failed")
                    self._give_up(f"controller failed: {type(exc).__name__}: {exc}")
                done = self.state.phase == "failed"
                changed = before != (self.state.phase, self.state.generation) or bool(envs)
            self._flush()
            if changed:
                self._on_change()
            if done:
                return

    def _act(self, now: float) -> None:
        s = self.state
        if s.phase == "backoff":
            if now >= s.retry_at:
                self._launch(now)
            return
        why = st.judge(s, self.config, now)
        if why is not None:
            self._on_failure(why, now)
        elif st.all_ready(s):
            s.phase = "serving"
            if s.failures and s.failures[-1].recovered_at is None:
                s.failures[-1].recovered_at = now
            self.kv_bytes_per_token = sum(v.ready.kv_bytes_per_token for v in s.views if v.ready is not None)
            log.info("instance %s generation %d serving", self.keys.instance, s.generation)
            self._say(self._serving())

    def _serving(self) -> m.Serving:
        return m.Serving(
            generation=self.state.generation,
            term=self.term,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_budget_bytes=self.kv_budget_bytes,
            kv_block=self.config.prefill_step,
        )

    def _launch(self, now: float) -> None:
        gen = st.next_generation(self.state.generation, self.term)
        try:
            launches = self.layout(gen)
        except LayoutError as exc:
            self._give_up(str(exc))
            return
        names = [start.spec.name for _, start in launches]
        st.new_generation(self.state, now, len(launches), self.term, names)
        self.launches = launches
        for key, start in launches:
            self._outgoing.append((self._agent(key), start))
        if self.reuse:  # after the hand-overs (same outbox, in order): what was not reused stops now
            for agent in self._agents.values():
                stop = m.StopGeneration(instance=self.keys.instance, keep=gen, term=self.term)
                self._outgoing.append((agent, stop))

    def _agent(self, key: str) -> Outbox:
        if key not in self._agents:
            self._agents[key] = Outbox(self._session, key, sealed=True)  # agents check who commands
        return self._agents[key]

    def _on_failure(self, why: str, now: float) -> None:
        s = self.state
        log.error("instance %s generation %d: %s", self.keys.instance, s.generation, why)
        pids = [v.pid for v in s.views if v.pid is not None]
        blamed = st.suspects(s, self.config, now)
        s.failures.append(st.Failure(why, s.generation, now, time.time(), pids, suspects=blamed))
        if self.reuse and blamed is not None:
            for agent in self._agents.values():
                stop = m.StopGeneration(instance=self.keys.instance, keep=-1, term=self.term, stages=blamed)
                self._outgoing.append((agent, stop))
        else:
            self._stop_all()
        decision = st.after_failure(s, self.config, why, now)
        if isinstance(decision, st.GiveUp):
            self._give_up(decision.why)
            return
        s.phase = "backoff"
        s.retry_at = now + decision.backoff_s
        self._say(m.Recovering(generation=s.generation, why=why, term=self.term))

    def _give_up(self, why: str) -> None:
        log.error("instance %s failed: %s", self.keys.instance, why)
        self.state.phase = "failed"
        self.state.failure = why
        self._stop_all()
        self._say(m.InstanceFailed(why=why, term=self.term))
        self._cond.notify_all()

    def _stop_all(self) -> None:
        for agent in self._agents.values():
            stop = m.StopGeneration(instance=self.keys.instance, keep=-1, term=self.term)
            self._outgoing.append((agent, stop))

    def _say(self, message: Any) -> None:
        self._outgoing.append((self._updates, message))

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
