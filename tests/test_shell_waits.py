"""Waits in the shells around the pure decisions: none may hold a lock or a loop that others need.

A rejoin waits up to 2 s for its runner to be reachable: the node agent's lock stays free meanwhile (the
node's loop reads held() on every report). A deposed master's controllers end on threads of their own, in
parallel: the node's loop goes on at once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.cluster import master as master_mod
from shardline.cluster import master_state as ms
from shardline.cluster import state as cs
from shardline.cluster.master import Master
from shardline.dataplane.transport import DeadlineExceeded, Outbox, open_session
from shardline.instance.settings import InstanceSettings
from shardline.instance.spec import RunnerSpec
from shardline.node import agent as agent_mod
from shardline.node.agent import NodeAgent
from shardline.node.logs import RotatingLog

DEADLINE_S = 10.0  # for a condition that holds at once when the code is right


def _spec(generation: int) -> RunnerSpec:
    return RunnerSpec(
        instance="inst",
        generation=generation,
        slot=0,
        stages=1,
        model_dir="unused",
        layer_start=0,
        layer_end=4,
        layer_total=4,
        connect=[],
        namespace="test-shell-waits",
        runner_id="r-old",
    )


@pytest.fixture
def session() -> Iterator[object]:
    s = open_session([], [])
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def agent(session, tmp_path: Path) -> Iterator[NodeAgent]:
    """An agent holding one live process as generation 1's stage 0 (a stand-in for a runner, leading its
    own process group as runners do: the agent stops runners by group)."""
    a = NodeAgent(session, "test-shell-waits/agent/n1", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    pump = threading.Thread(target=lambda: None)
    a._runners[("inst", 1, 0)] = agent_mod._Runner(_spec(1), proc, RotatingLog(tmp_path / "r.log"), pump)
    try:
        yield a
    finally:
        a.close()
        proc.kill()
        proc.wait(timeout=DEADLINE_S)


def _held_keys(a: NodeAgent) -> list[tuple[str, int, int]] | None:
    """held() from another thread: its keys, or None if it did not return within the deadline."""
    out: list[list[tuple[str, int, int]]] = []
    t = threading.Thread(target=lambda: out.append([k for k, *_ in a.held()]), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    return out[0] if out else None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reachable", [True, False])
def test_a_rejoin_waits_for_its_runner_without_holding_the_agent_lock(agent, monkeypatch, reachable):
    waiting, release = threading.Event(), threading.Event()

    def wait_matched(self: Outbox, timeout: float, abort: object = None) -> None:
        waiting.set()
        release.wait(DEADLINE_S * 3)
        if not reachable:
            raise DeadlineExceeded("no receiver")

    monkeypatch.setattr(Outbox, "wait_matched", wait_matched)
    result: list[bool] = []
    rejoin = threading.Thread(target=lambda: result.append(agent._rejoin(_spec(2), (1, 0))), daemon=True)
    rejoin.start()
    assert waiting.wait(DEADLINE_S)
    # While it waits, the lock is free, and the runner is listed as the new generation's (fencing spares it).
    assert _held_keys(agent) == [("inst", 2, 0)]
    release.set()
    rejoin.join(DEADLINE_S)
    assert result == [reachable]
    # Handed over, or back as it was when the runner could not be told.
    assert _held_keys(agent) == [("inst", 2 if reachable else 1, 0)]


class _Controller:
    """Stands in for an InstanceController whose thread takes long to end."""

    def __init__(self, started: threading.Semaphore, release: threading.Event) -> None:
        self.started, self.release, self.ended = started, release, threading.Event()

    def detach(self) -> None:
        self.started.release()
        self.release.wait(DEADLINE_S * 3)
        self.ended.set()

    def stop(self, grace_s: float) -> None:
        self.detach()


def _master(session) -> Master:
    config = ms.MasterConfig(me="a", namespace="test-shell-waits", report_s=0.5)
    snap = ms.snapshot(cs.ClusterState(me="a"), time.monotonic(), time.time())
    return Master(
        session, config, InstanceSettings(), 1, snap, lambda e: None, lambda v: None, lambda e: None
    )


@pytest.mark.timeout(60)
def test_a_deposed_master_ends_its_controllers_off_the_loop_and_in_parallel(session):
    m = _master(session)
    started, release = threading.Semaphore(0), threading.Event()
    fakes = [_Controller(started, release) for _ in range(3)]
    m.controllers = {f"i{n}": f for n, f in enumerate(fakes)}  # type: ignore[misc]
    closer = threading.Thread(target=lambda: m.close(stop_runners=False, wait=False), daemon=True)
    closer.start()
    closer.join(DEADLINE_S)
    assert not closer.is_alive()  # returned while every controller is still ending
    # All three are ending at once: none has finished, so none waited for another.
    assert all(started.acquire(timeout=DEADLINE_S) for _ in fakes)
    assert not any(f.ended.is_set() for f in fakes) and m.controllers == {}
    release.set()
    assert all(f.ended.wait(DEADLINE_S) for f in fakes)


@pytest.mark.timeout(60)
def test_a_closing_master_waits_for_its_controllers_within_one_bound(session, monkeypatch):
    monkeypatch.setattr(master_mod, "CONTROLLERS_END_S", 0.2)
    m = _master(session)
    started, release = threading.Semaphore(0), threading.Event()
    fakes = [_Controller(started, release) for _ in range(3)]
    m.controllers = {f"i{n}": f for n, f in enumerate(fakes)}  # type: ignore[misc]
    closer = threading.Thread(target=m.close, daemon=True)
    closer.start()
    closer.join(DEADLINE_S)  # three that never end: one bound for all, not one each
    assert not closer.is_alive()
    release.set()
    assert all(f.ended.wait(DEADLINE_S) for f in fakes)
