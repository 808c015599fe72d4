"""Orderings between the leader's beat and its handling of Submit, and between a front's Submit and Cancel.

The beat test is deterministic: a tracer takes a beat at every line the leader runs while it handles a
Submit (every point the heartbeat thread could interleave), and checks what the front would conclude."""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from conftest import stub_leader_spec, wait_for

from shardline.dataplane import messages as m
from shardline.instance.deadline import DeadlinePolicy
from shardline.runner.faults import Faults
from shardline.runner.leader import Leader


class Events:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, event: Any, tensor: Any = None) -> None:
        self.sent.append(event)


def stub_leader() -> tuple[Leader, Events]:
    events = Events()
    spec: Any = stub_leader_spec(prefix_cache=True)
    stage: Any = SimpleNamespace(kv_bytes_per_token=8, shard=SimpleNamespace(prefix_reason=""))
    inbox: Any = SimpleNamespace(drop=lambda why: None)
    leader = Leader(
        spec,
        stage,
        lambda step, x: (step, None),
        inbox,
        None,
        cast(Any, events),
        policy=DeadlinePolicy(),
        faults=Faults(None),
        received={},
    )
    return leader, events


def lost_by_beats(leader: Leader, events: Events, submit: m.Submit) -> list[int]:
    """Beat at every line of the leader's handling; the lines whose beat reads the request as lost."""
    lost: list[int] = []
    code_files = {Leader.handle.__code__.co_filename}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in code_files:
            return None
        if event == "line" and frame.f_code.co_name != "beat":
            sys.settrace(None)
            ends_before = {e.request_id for e in events.sent if isinstance(e, m.Finished | m.RequestFailed)}
            leader.beat()
            beat = events.sent.pop()
            assert isinstance(beat, m.LeaderBeat)
            rid = submit.request.request_id
            seen = beat.seen.get(submit.front, -1) >= submit.seq
            if seen and rid not in beat.requests and rid not in ends_before:
                lost.append(frame.f_lineno)
            sys.settrace(tracer)
        return tracer

    sys.settrace(tracer)
    try:
        leader.handle(SimpleNamespace(message=submit))
    finally:
        sys.settrace(None)
    return lost


@contextmanager
def serving_front(prefix: str) -> Iterator[SimpleNamespace]:
    """A front serving generation 1 over real zenoh, with a leader's control inbox, the master's reports
    inbox and the leader's events outbox around it; all closed on exit."""
    from shardline.dataplane.transport import Inbox, Keys, Outbox, open_session
    from shardline.front.front import Front, ModelLimits

    session = open_session(["tcp/127.0.0.1:0"], [])
    keys = Keys(f"{prefix}-{id(session)}")
    control = Inbox(session, 1, name="leader")
    control.subscribe(keys.at(1).control, m.CONTROL, "control")
    reports = Inbox(session, name="master")
    reports.subscribe(keys.reports, m.STATUS, "reports")
    events = Outbox(session, keys.at(1).reply("f1"), 1)  # the front's own events, as a leader sends them
    front = Front(session, keys, ModelLimits(64, 1024), name="f1").start()
    try:
        front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
        assert front.serving.wait(10)
        events.wait_matched(10)
        yield SimpleNamespace(front=front, control=control, reports=reports, events=events)
    finally:
        front.close()
        events.close()
        reports.close()
        control.close()
        session.close()


@pytest.mark.timeout(10)
def test_no_beat_reads_a_submit_being_handled_as_lost() -> None:
    leader, events = stub_leader()
    spec = m.RequestSpec(request_id="r1", prompt=[1, 2, 3], max_tokens=4)
    assert lost_by_beats(leader, events, m.Submit(front="f", seq=1, request=spec)) == []
    leader.beat()
    beat = events.sent.pop()
    assert beat.seen == {"f": 1} and beat.requests == ["r1"] and beat.running == 1


@pytest.mark.timeout(10)
def test_no_beat_reads_a_waiting_request_being_admitted_as_lost() -> None:
    leader, events = stub_leader()
    leader.ledger.budget = 10**9
    first = m.RequestSpec(request_id="r1", prompt=[1] * 3, max_tokens=4)
    leader.handle(SimpleNamespace(message=m.Submit(front="f", seq=1, request=first)))
    # r2 waits for KV, then is admitted inside r1's release: a beat must never miss it.
    leader.ledger.budget = leader.ledger.held["r1"].reserved
    second = m.RequestSpec(request_id="r2", prompt=[1] * 3, max_tokens=4)
    leader.handle(SimpleNamespace(message=m.Submit(front="f", seq=2, request=second)))
    assert [s.request_id for s in leader.waiting] == ["r2"]
    leader.on_cancel("r1")
    release = m.Submit(front="f", seq=2, request=second)  # only for the lost-check's bookkeeping

    lost: list[int] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != Leader.release.__code__.co_filename:
            return None
        if event == "line" and frame.f_code.co_name != "beat":
            sys.settrace(None)
            leader.beat()
            beat = events.sent.pop()
            if "r2" not in beat.requests:
                lost.append(frame.f_lineno)
            sys.settrace(tracer)
        return tracer

    leader.stage.release = lambda rid: None
    sys.settrace(tracer)
    try:
        leader.release("r1")
    finally:
        sys.settrace(None)
    assert release.seq == 2 and lost == []
    assert "r2" in leader.requests


@pytest.mark.timeout(10)
def test_request_module_does_not_import_the_front() -> None:
    import shardline.front.request as request

    tree = ast.parse(Path(request.__file__).read_text())
    names = [
        getattr(n, "module", None) or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import)
    ]
    assert not any("front.front" in name for name in names)


@pytest.mark.timeout(30)
def test_a_cancel_racing_a_submit_never_precedes_it_on_the_control_channel(monkeypatch: Any) -> None:
    from shardline.dataplane.transport import Inbox, Keys, open_session
    from shardline.front.front import Front, ModelLimits
    from shardline.front.request import RequestState

    session = open_session(["tcp/127.0.0.1:0"], [])
    keys = Keys(f"order-{id(session)}")
    control = Inbox(session, 1, name="leader")
    control.subscribe(keys.at(1).control, m.CONTROL, "control")
    front = Front(session, keys, ModelLimits(64, 1024), name="f1").start()
    try:
        front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
        assert front.serving.wait(10)
        real_spec = RequestState.spec

        def spec_then_cancel(state: RequestState, resume: str = "exact") -> m.RequestSpec:
            # The cancel lands between the claim and the send: the race of a recovery's resubmit.
            if state.request_id == "victim":
                front.cancel("victim")
            return real_spec(state, resume)

        monkeypatch.setattr(RequestState, "spec", spec_then_cancel)
        front.submit([1, 2, 3], max_tokens=4, request_id="victim")
        front.submit([1, 2, 3], max_tokens=4, request_id="marker")  # in order: after it, all has arrived
        got: list[Any] = []
        while not (got and isinstance(got[-1], m.Submit) and got[-1].request.request_id == "marker"):
            got.append(control.get(timeout=10).message)
        kinds = [(type(x).__name__, getattr(x, "request_id", None) or x.request.request_id) for x in got]
        victim = [k for k, rid in kinds if rid == "victim"]
        assert victim in ([], ["Cancel"], ["Submit", "Cancel"]), kinds
    finally:
        front.close()
        control.close()
        session.close()


@pytest.mark.timeout(30)
def test_a_fault_still_seen_is_reported_again_until_a_new_generation_serves(monkeypatch: Any) -> None:
    """A fault report is a publication: one sent while no master listens (a master change, a link just back)
    is lost, and the request it is about would wait forever. So the front repeats it while it sees it."""
    import time

    from shardline.dataplane.transport import DeadlineExceeded
    from shardline.front import front as front_module

    monkeypatch.setattr(front_module, "REPORT_AGAIN_S", 0.2)
    with serving_front("refault") as rig:
        front, control, reports, events = rig.front, rig.control, rig.reports, rig.events
        front.submit([1, 2, 3], max_tokens=4, request_id="r1")
        submit = control.get(timeout=10).message
        assert isinstance(submit, m.Submit)
        # The leader handled the Submit, and its end never reached this front: beats list no request.
        beat = m.LeaderBeat(seen={"f1": submit.seq}, requests=[])
        faults: list[float] = []
        deadline = time.monotonic() + 10
        while len(faults) < 3:
            assert time.monotonic() < deadline, f"{len(faults)} fault reports within 10 s"
            events.send(beat)
            try:
                got = reports.get(timeout=0.05).message
            except DeadlineExceeded:  # no report yet: beat again (the leader beats on a period)
                continue
            if isinstance(got, m.GenerationFault):
                assert got.generation == 1 and "no longer holds r1" in got.why
                faults.append(time.monotonic())
        # Repeated, but not on every beat: at most once per REPORT_AGAIN_S.
        assert all(b - a >= 0.15 for a, b in itertools.pairwise(faults)), faults


@pytest.mark.timeout(30)
def test_a_submit_lost_on_the_way_is_reported_once_its_transport_deadline_passes(monkeypatch: Any) -> None:
    """A link that drops what it holds (a flap) can lose a Submit with no later message to reveal the gap:
    the leader's beats say what reached its process, so the front reports it after SUBMIT_LOST_S, not
    never; while the deadline has not passed, or once the Submit is received, nothing is reported."""
    import time

    from shardline.dataplane.transport import DeadlineExceeded
    from shardline.front import front as front_module

    monkeypatch.setattr(front_module, "SUBMIT_LOST_S", 1.0)
    # A leader listens on control; the beats below say the Submit never reached it.
    with serving_front("lostsubmit") as rig:
        front, reports, events = rig.front, rig.reports, rig.events
        sent = time.monotonic()
        front.submit([1, 2, 3], max_tokens=4, request_id="r1")
        lost = m.LeaderBeat(seen={}, requests=[], received={})
        old_leader = m.LeaderBeat(seen={}, requests=[])  # no `received`: cannot tell lost from slow
        got = None
        deadline = sent + 10
        while got is None:
            assert time.monotonic() < deadline, "no fault report within 10 s"
            events.send(old_leader)
            events.send(lost)
            try:
                msg = reports.get(timeout=0.05).message
            except DeadlineExceeded:
                continue
            if isinstance(msg, m.GenerationFault):
                got = (msg, time.monotonic())
        fault, at = got
        assert fault.generation == 1 and "Submit of r1 has not reached the leader" in fault.why, fault.why
        assert at - sent >= 1.0  # not before its deadline


@pytest.mark.timeout(30)
def test_a_newer_masters_serving_outranks_a_deposed_masters_newer_generation() -> None:
    """A master cut off from the stages fails the generation they serve and launches a newer id that never
    serves; the next master adopts the served one. The front must follow the newer term, not the higher id
    (a soak lost the requests a front held at a link flap: it waited for a generation that never came)."""
    from shardline.dataplane.transport import Inbox, Keys, open_session
    from shardline.front.front import Front, ModelLimits

    served = 1 << 20  # term 1's first generation: adopted by term 2
    session = open_session(["tcp/127.0.0.1:0"], [])
    keys = Keys(f"terms-{id(session)}")
    control = Inbox(session, served, name="leader")
    control.subscribe(keys.at(served).control, m.CONTROL, "control")
    # Waiting for a leader that never comes must not outlast the test: a newer word ends the wait.
    front = Front(session, keys, ModelLimits(64, 1024), name="f1", match_timeout=600).start()
    try:
        front.announce(m.Serving(generation=served, term=1, kv_bytes_per_token=0, kv_budget_bytes=0))
        assert front.serving.wait(10)
        # The deposed master, cut off: its stages vanish, and the generation it tries next fails too.
        front.announce(m.Recovering(generation=served, why="stage 1 vanished", term=1))
        front.announce(m.Recovering(generation=served + 1, why="node n2 left", term=1))
        wait_for(lambda: not front.serving.is_set(), 10, "the front pausing")
        handle = front.submit([1, 2, 3], max_tokens=4, request_id="held")  # waits in the front
        # The new master's view: the adopted generation serves.
        front.announce(m.Serving(generation=served, term=2, kv_bytes_per_token=0, kv_budget_bytes=0))
        got = control.get(timeout=10).message
        assert isinstance(got, m.Submit) and got.request.request_id == "held"
        assert front.generation == served and not handle.done
        # The deposed master's late give-up fails nothing; the next generation (in order after it) gets the
        # request again.
        later = (2 << 20) + 1
        control2 = Inbox(session, later, name="leader2")
        control2.subscribe(keys.at(later).control, m.CONTROL, "control")
        front.announce(m.InstanceFailed(why="gave up while cut off", term=1))
        front.announce(m.Serving(generation=later, term=2, kv_bytes_per_token=0, kv_budget_bytes=0))
        got = control2.get(timeout=10).message
        assert isinstance(got, m.Submit) and got.request.request_id == "held", got
        assert not handle.done and front.failure is None and front.generation == later
        control2.close()
        # A view that still lists a generation whose leader is gone, then the next master's word: the front
        # stops waiting for the first as soon as the second is queued.
        gone, last = later + 1, later + 2
        control3 = Inbox(session, last, name="leader3")
        control3.subscribe(keys.at(last).control, m.CONTROL, "control")
        front.announce(m.Serving(generation=gone, term=2, kv_bytes_per_token=0, kv_budget_bytes=0))
        front.announce(m.Serving(generation=last, term=2, kv_bytes_per_token=0, kv_budget_bytes=0))
        got = control3.get(timeout=20).message
        assert isinstance(got, m.Submit) and got.request.request_id == "held", got
        assert front.generation == last and not handle.done
        control3.close()
    finally:
        front.close()
        control.close()
        session.close()
