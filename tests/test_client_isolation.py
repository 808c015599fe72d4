"""One client cannot hurt another: KV reserved as it is used (no request holds what max_tokens might reach),
a recovery refuses nothing already accepted, each front hears only its own requests' events, every wait ends
at a deadline, and a handle's finaliser never deadlocks on a lock its thread holds.

The leader tests drive the real Leader with a one-stage stand-in (its compute answers at once with a token
that depends only on the request and the position, as greedy decoding does), so they are deterministic."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import stub_leader_spec, wait_for

from shardline.compute.constraints import compile_grace_s, json_schema
from shardline.compute.sampling import SamplingParams
from shardline.dataplane import messages as m
from shardline.dataplane.transport import Inbox, Keys, Outbox, open_session
from shardline.errors import EngineError
from shardline.front import front as front_module
from shardline.front.front import Front, ModelLimits
from shardline.front.lifecycle import REMOVED_AFTER_S, Fronts, catch_up
from shardline.front.request import RequestDeadlineError
from shardline.instance.deadline import DeadlinePolicy
from shardline.runner.leader import Leader

BLOCK = 8  # positions per KV block (the prefill step)
TOKEN_BYTES = 8  # KV bytes per position over the whole model


class Events:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, event: Any, tensor: Any = None) -> None:
        self.sent.append(event)


def token_at(request_id: str, pos: int) -> int:
    """What the stand-in samples after position `pos`: the same on every run, as greedy output is."""
    return 3 + (pos * 7 + len(request_id)) % 50


def compute(step: m.Step, x: Any) -> tuple[m.StepResult, None]:
    if step.rows:
        rows = [
            m.RowResult(request_id=r.request_id, token=token_at(r.request_id, r.pos) if r.sample else None)
            for r in step.rows
        ]
        return m.StepResult(seq=step.seq, request_id=step.request_id, rows=rows), None
    token = token_at(step.request_id, step.pos + step.n - 1) if step.sample else None
    return m.StepResult(seq=step.seq, request_id=step.request_id, token=token), None


def stand_in_leader(
    budget_blocks: int, max_waiting: int = 16, session: Any = None, keys: Any = None
) -> Leader:
    spec: Any = stub_leader_spec(
        kv_budget_bytes=budget_blocks * BLOCK * TOKEN_BYTES,
        max_waiting=max_waiting,
        prefill_step=BLOCK,
        in_flight_window=1,  # results come back at once: the one slot goes to prefill first
        max_batch=4,
        generation=1,
    )
    stage: Any = SimpleNamespace(
        kv_bytes_per_token=TOKEN_BYTES, release=lambda rid: None, evict=lambda blocks: None, steps=0
    )
    inbox: Any = SimpleNamespace(drop=lambda why: None, get_nowait=lambda: None)
    events: Any = Events()
    faults: Any = SimpleNamespace(take_drop=lambda *a: False)
    return Leader(
        spec,
        stage,
        compute,
        inbox,
        None,
        events,
        policy=DeadlinePolicy(),
        faults=faults,
        received={},
        open_reply=None
        if session is None
        else lambda front: Outbox(session, keys.reply(front), spec.generation),
    )


def submit(leader: Leader, rid: str, prompt: int, max_tokens: int, seq: int, resubmit: bool = False) -> None:
    request = m.RequestSpec(request_id=rid, prompt=[9] * prompt, max_tokens=max_tokens)
    msg = m.Submit(front="f1", seq=seq, request=request, resubmit=resubmit)
    leader.handle(SimpleNamespace(message=msg))


@pytest.mark.timeout(30)
def test_requests_without_a_real_need_for_max_tokens_all_run_and_kv_stays_within_budget() -> None:
    # 8 blocks of KV; each request may reach 4 (5 + 20 positions), its prompt needs 1.
    leader = stand_in_leader(budget_blocks=8)
    for i in range(4):
        submit(leader, f"r{i}", prompt=5, max_tokens=20, seq=i + 1)
    events = leader.events.sent
    assert not [e for e in events if isinstance(e, m.RequestFailed)]
    assert len(leader.requests) == 4 and not leader.waiting  # all four run at once
    budget = leader.spec.kv_budget_bytes
    # Together they grow to 16 blocks: the newest go back to the queue, and recompute when admitted again.
    preempted: set[str] = set()
    original = leader.preempt

    def preempt(rid: str) -> None:
        preempted.add(rid)
        original(rid)

    leader.preempt = preempt  # type: ignore[method-assign]
    for _ in range(1000):
        leader.act()
        assert leader.ledger.used() <= budget
        if not leader.requests and not leader.waiting:
            break
    assert preempted, "the budget never ran out: the test proves nothing"
    for i in range(4):
        rid = f"r{i}"
        tokens = [e for e in events if isinstance(e, m.TokenEvent) and e.request_id == rid]
        assert [t.index for t in tokens] == list(range(20)), rid  # each once, in order, none lost
        assert [t.token for t in tokens] == [token_at(rid, 4 + k) for k in range(20)]
        ends = [e for e in events if isinstance(e, m.Finished) and e.request_id == rid]
        assert [(e.reason, e.tokens) for e in ends] == [("length", 20)]
    assert not leader.held and leader.ledger.used() == 0


@pytest.mark.timeout(30)
def test_a_request_alone_that_outgrows_the_budget_ends_there() -> None:
    leader = stand_in_leader(budget_blocks=2)
    submit(leader, "big", prompt=5, max_tokens=100, seq=1)
    for _ in range(100):
        leader.act()
        if not leader.requests:
            break
    events = leader.events.sent
    ends = [e for e in events if isinstance(e, m.Finished)]
    # Two blocks hold 16 positions: the prompt's 5 and 11 tokens, from which a 12th is sampled.
    assert [(e.reason, e.tokens) for e in ends] == [("length", 12)]


@pytest.mark.timeout(30)
def test_a_cancel_while_preempted_ends_the_request() -> None:
    leader = stand_in_leader(budget_blocks=2)
    submit(leader, "a", prompt=5, max_tokens=8, seq=1)
    submit(leader, "b", prompt=5, max_tokens=8, seq=2)
    leader.preempt("b")  # as when "a" needs b's block (its steps in flight not back yet)
    leader.handle(SimpleNamespace(message=m.Cancel(front="f1", seq=3, request_id="b")))
    leader.act()
    events = leader.events.sent
    ends = [(e.request_id, e.reason) for e in events if isinstance(e, m.Finished)]
    assert ends == [("b", "cancelled"), ("a", "length")]  # b ended once, and never ran again
    assert not leader.waiting and not leader.held


@pytest.mark.timeout(30)
def test_a_resubmission_is_never_refused_for_a_full_queue() -> None:
    leader = stand_in_leader(budget_blocks=1, max_waiting=1)
    submit(leader, "run", prompt=5, max_tokens=4, seq=1)
    submit(leader, "wait", prompt=5, max_tokens=4, seq=2)
    submit(leader, "new", prompt=5, max_tokens=4, seq=3)
    failed = [e.request_id for e in leader.events.sent if isinstance(e, m.RequestFailed)]
    assert failed == ["new"]  # a new request beyond the queue is refused
    submit(leader, "old", prompt=5, max_tokens=4, seq=4, resubmit=True)
    failed = [e.request_id for e in leader.events.sent if isinstance(e, m.RequestFailed)]
    assert failed == ["new"] and [s.request_id for s in leader.waiting] == ["wait", "old"]


# ---- fronts ------------------------------------------------------------------------------------------------


@contextmanager
def session_keys(prefix: str) -> Iterator[tuple[Any, Keys]]:
    session = open_session(["tcp/127.0.0.1:0"], [])
    try:
        yield session, Keys(f"{prefix}-{id(session)}")
    finally:
        session.close()


@pytest.mark.timeout(30)
def test_a_leader_sends_a_requests_events_to_its_own_front_only() -> None:
    with session_keys("route") as (session, keys):
        at = keys.at(1)
        heard: dict[str, Inbox] = {}
        for name in ("f1", "f2"):
            heard[name] = Inbox(session, name=name)
            heard[name].subscribe(at.reply(name), m.EVENTS, name)
        leader = stand_in_leader(budget_blocks=8, session=session, keys=at)
        try:
            submit(leader, "r1", prompt=5, max_tokens=3, seq=1)
            leader.act()
            leader.beat()
            f1: list[Any] = []
            wait_for(lambda: f1.extend(iter(heard["f1"].get_nowait, None)) or len(f1) >= 6, 10, "f1's events")
            kinds = [type(e.message).__name__ for e in f1]
            assert kinds == ["Admitted", "TokenEvent", "TokenEvent", "TokenEvent", "Finished", "LeaderBeat"]
            own = f1[-1].message  # f1's own beat, behind the ends it follows: what the leader holds of f1's
            assert own.seen == {"f1": 1} and own.requests == []
            # Only the beat goes to every front; no other front hears a thing.
            assert [type(e) for e in leader.events.sent] == [m.LeaderBeat]
            assert heard["f2"].get_nowait() is None and heard["f1"].get_nowait() is None
        finally:
            for out in leader.replies.values():
                out.close()
            for inbox in heard.values():
                inbox.close()


@contextmanager
def serving_front(session: Any, keys: Keys, name: str, **kw: Any) -> Iterator[Front]:
    front = Front(session, keys, ModelLimits(64, 1024), name=name, **kw).start()
    try:
        yield front
    finally:
        front.close()


@pytest.mark.timeout(30)
def test_fronts_open_once_close_what_views_stop_listing_after_a_grace_and_open_none_once_closed() -> None:
    with session_keys("fronts") as (session, keys):
        fronts = Fronts(session, keys.namespace)
        first = fronts.open(keys.instance, ModelLimits(64, 1024), start=False)
        assert fronts.open(keys.instance, ModelLimits(64, 1024)) is first
        handle = first.submit([1, 2, 3], max_tokens=4)
        assert fronts.close_unlisted(set(), now=100.0) == []  # missing from one view: not gone yet
        assert fronts.close_unlisted({keys.instance}, now=100.5) == []  # listed again: the grace restarts
        assert fronts.close_unlisted(set(), now=101.0) == []
        assert fronts.close_unlisted(set(), now=101.0 + REMOVED_AFTER_S + 0.1) == [keys.instance]
        assert fronts.get(keys.instance) is None and first.closed
        assert handle.done and handle.state.error == f"instance {keys.instance} was removed"
        fronts.close_all("owner closed")
        with pytest.raises(EngineError, match="owner closed"):
            fronts.open(keys.instance, ModelLimits(64, 1024))


def test_catch_up_tells_a_front_only_what_is_news_to_it() -> None:
    told: list[Any] = []
    front = SimpleNamespace(generation=2, failure=None, announce=told.append)
    kv = {"kv_bytes_per_token": 8, "kv_budget_bytes": 1 << 20}
    catch_up(front, m.Serving(generation=2, term=1, **kv))
    catch_up(front, m.Serving(generation=3, term=1, **kv))
    catch_up(front, m.InstanceFailed(why="gone", term=1))
    front.failure = "gone"
    catch_up(front, m.InstanceFailed(why="gone", term=1))
    assert [(type(u).__name__, getattr(u, "generation", None)) for u in told] == [
        ("Serving", 3),
        ("InstanceFailed", None),
    ]


@pytest.mark.timeout(30)
def test_a_front_takes_its_own_events_and_never_hears_anothers() -> None:
    with session_keys("own") as (session, keys):
        control = Inbox(session, 1, name="leader")
        control.subscribe(keys.at(1).control, m.CONTROL, "control")
        with serving_front(session, keys, "f1") as f1, serving_front(session, keys, "f2") as f2:
            for f in (f1, f2):
                f.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
                assert f.serving.wait(10)
            handle = f1.submit([1, 2, 3], max_tokens=2)
            sub = wait_for(control.get_nowait, 10, "the Submit").message
            assert isinstance(sub, m.Submit) and sub.front == "f1" and not sub.resubmit
            reply = Outbox(session, keys.at(1).reply("f1"), 1)
            reply.wait_matched(10)
            rid = handle.request_id
            reply.send(m.TokenEvent(request_id=rid, index=0, token=5, logprob=0.0))
            reply.send(m.TokenEvent(request_id=rid, index=1, token=6, logprob=0.0))
            reply.send(m.Finished(request_id=rid, reason="length", tokens=2))
            assert handle.tokens(timeout=10) == [5, 6]
            other = Outbox(session, keys.at(1).reply("f3"), 1)
            assert not other._pub.matching_status.matching  # no front but f3 would take f3's events
            reply.close()
            other.close()
        control.close()


@pytest.mark.timeout(30)
def test_what_a_front_held_before_a_generation_served_is_sent_as_accepted() -> None:
    with session_keys("held") as (session, keys):
        control = Inbox(session, 1, name="leader")
        control.subscribe(keys.at(1).control, m.CONTROL, "control")
        with serving_front(session, keys, "f1") as front:
            held = front.submit([1, 2, 3], max_tokens=2)  # no generation serves yet: it waits here
            front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
            assert front.serving.wait(10)
            fresh = front.submit([4, 5, 6], max_tokens=2)
            subs = [wait_for(control.get_nowait, 10, "a Submit").message for _ in range(2)]
            flags = {s.request.request_id: s.resubmit for s in subs}
            assert flags == {held.request_id: True, fresh.request_id: False}
        control.close()


@pytest.mark.timeout(30)
def test_a_request_no_instance_serves_ends_at_its_deadline() -> None:
    with session_keys("deadline") as (session, keys):  # noqa: SIM117 (the front needs its session)
        with serving_front(session, keys, "f1", wait_floor_s=0.5) as front:  # no generation ever serves
            handle = front.submit([1, 2, 3], max_tokens=4)
            with pytest.raises(RequestDeadlineError, match=r"waited .* for the instance serving it"):
                handle.tokens(timeout=20)
            assert front.requests == {}


def test_deadlines_scale_with_the_work() -> None:
    base = front_module.request_deadlines(0, 10, 10)
    assert base.first_token_s >= front_module.WAIT_FLOOR_S
    queued = front_module.request_deadlines(5, 10, 10)
    longer = front_module.request_deadlines(0, 10_000, 10_000)
    assert queued.first_token_s > base.first_token_s
    assert longer.first_token_s > base.first_token_s and longer.total_s > base.total_s
    assert longer.stall_s > base.stall_s


@pytest.mark.timeout(30)
def test_a_stalled_stream_ends_at_its_deadline() -> None:
    with session_keys("stall") as (session, keys):
        control = Inbox(session, 1, name="leader")  # a leader that listens, then stops answering
        control.subscribe(keys.at(1).control, m.CONTROL, "control")
        with serving_front(session, keys, "f1", wait_floor_s=2.0) as front:
            front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
            assert front.serving.wait(15)
            reply = Outbox(session, keys.at(1).reply("f1"), 1)
            reply.wait_matched(10)
            handle = front.submit([1, 2, 3], max_tokens=4)
            reply.send(m.TokenEvent(request_id=handle.request_id, index=0, token=5, logprob=0.0))
            with pytest.raises(RequestDeadlineError, match="no token came"):
                list(handle.stream(timeout=20))
            assert handle.state.generated == [5]
            reply.close()
            control.close()


@pytest.mark.timeout(30)
def test_a_beat_never_sees_a_submit_half_marked_as_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A beat reads sent_seq and sent_at under the front's lock: it must never see one set without the other
    (a seq with the previous generation's send time reads as a Submit lost long ago)."""
    with session_keys("half") as (session, keys):
        control = Inbox(session, 1, name="leader")
        control.subscribe(keys.at(1).control, m.CONTROL, "control")
        with serving_front(session, keys, "f1") as front:
            front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
            assert front.serving.wait(15)
            verdicts: list[str | None] = []
            real = time.monotonic
            beat = m.LeaderBeat(seen={"f1": 0}, requests=[], received={"f1": 0})

            def monotonic() -> float:
                import sys

                if sys._getframe(1).f_code.co_name == "_send_submits" and not verdicts:
                    verdicts.append(front._check_beat(beat))  # a beat at this very point
                return real()

            monkeypatch.setattr(front_module.time, "monotonic", monotonic)
            front.submit([1, 2, 3], max_tokens=4)
            monkeypatch.setattr(front_module.time, "monotonic", real)
            assert verdicts == [None]
            control.close()


@pytest.mark.timeout(30)
def test_a_finaliser_never_cancels_through_a_lock_its_thread_holds() -> None:
    from shardline.api.active import ActiveRequest

    with session_keys("final") as (session, keys):  # noqa: SIM117 (the front needs its session)
        with serving_front(session, keys, "f1") as front:
            handle = front.submit([1, 2, 3], max_tokens=4)
            slot = threading.Lock()  # as the service's slot count: the finaliser frees a slot through it
            deferred: list[Any] = []
            counter = SimpleNamespace(inc=lambda: None)

            def release() -> None:
                with slot:
                    pass

            active = ActiveRequest(
                id="x",
                model="m",
                instance="i",
                handle=handle,
                stream=SimpleNamespace(),  # type: ignore[arg-type]
                text=SimpleNamespace(),  # type: ignore[arg-type]
                prompt_tokens=3,
                started=0.0,
                metrics=SimpleNamespace(requests=SimpleNamespace(labels=lambda *a: counter)),  # type: ignore[arg-type]
                release=release,
                endpoint="chat",
                defer=deferred.append,
            )

            def finalise_inside_locks() -> None:
                with front._lock, slot:  # a collection may run a finaliser anywhere, these held
                    active.__del__()

            t = threading.Thread(target=finalise_inside_locks, daemon=True)
            t.start()
            t.join(5)
            assert not t.is_alive(), "the finaliser deadlocked on a lock its own thread held"
            assert len(deferred) == 1
            deferred[0]()  # the service runs it later, holding nothing
            wait_for(lambda: handle.done, 5, "the cancel")
            assert handle.finish_reason == "cancelled" and front.requests == {}


@pytest.mark.timeout(30)
def test_only_a_fronts_own_beat_can_say_the_leader_lost_its_request() -> None:
    """The beat to every front travels on another key than a request's end, and may overtake it: read as
    'the leader no longer holds it', it would fail a whole generation over an end that is on its way."""
    with session_keys("ownbeat") as (session, keys):
        control = Inbox(session, 1, name="leader")
        control.subscribe(keys.at(1).control, m.CONTROL, "control")
        with serving_front(session, keys, "f1") as front:
            front.announce(m.Serving(generation=1, kv_bytes_per_token=0, kv_budget_bytes=0))
            assert front.serving.wait(10)
            handle = front.submit([1, 2, 3], max_tokens=2)
            sub = wait_for(control.get_nowait, 10, "the Submit").message
            beat = m.LeaderBeat(seen={"f1": sub.seq}, requests=[])  # sent after the end, arrived before it
            with front._lock:
                assert front._check_beat(beat) is None
                lost = front._check_beat(beat, own=True)
            assert lost is not None and f"no longer holds {handle.request_id}" in lost
        control.close()


class _Metric:
    def labels(self, *args: Any) -> _Metric:
        return self

    def inc(self, *args: Any) -> None:
        pass

    def observe(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flavor", ["openai", "anthropic", "ollama"])
def test_a_stream_past_its_deadline_ends_with_a_timeout_error_in_its_apis_shape(flavor: str) -> None:
    import asyncio

    from shardline.api.active import ActiveRequest
    from shardline.api.errors import ApiError, body
    from shardline.api.text_stream import TextStream
    from shardline.front.request import RequestHandle, RequestState

    state = RequestState(
        request_id="r1", prompt=[1, 2], max_tokens=8, sampling=m.SamplingParams(), stop_tokens=[]
    )
    handle = RequestHandle(state, lambda rid: None)
    handle._token(m.TokenEvent(request_id="r1", index=0, token=5, logprob=0.0), None)
    state.expired = True
    handle._finish(error="no token came for 181s after token 1, past its deadline")
    metrics = SimpleNamespace(requests=_Metric(), ttft=_Metric(), itl=_Metric(), tokens_out=_Metric())
    active = ActiveRequest(
        id="x",
        model="m",
        instance="i",
        handle=handle,
        stream=TextStream(lambda ids: "a" * len(ids)),
        text=SimpleNamespace(),  # type: ignore[arg-type]
        prompt_tokens=2,
        started=0.0,
        metrics=metrics,  # type: ignore[arg-type]
        release=lambda: None,
        endpoint="chat",
    )

    async def read() -> tuple[list[str], ApiError]:
        texts = []
        try:
            async for chunk in active.chunks():
                texts.append(chunk.text)
        except ApiError as exc:
            return texts, exc
        raise AssertionError("the stream ended without an error")

    texts, err = asyncio.run(read())
    assert texts == ["a"]  # what came before the deadline was sent
    assert err.status == 503 and err.kind == "timeout_error" and "timed out" in err.message
    assert "no token came" in err.message  # which wait passed
    shaped = body(err, flavor)  # as streaming.stream_response sends it after the first byte
    text = str(shaped)
    assert "no token came" in text


@pytest.mark.timeout(30)
def test_a_constrained_requests_first_sampling_step_is_allowed_its_grammar_compile() -> None:
    # The sampling stage compiles a request's grammar within its first sampling step: the leader's backstop
    # for a lost result must allow that, or a large schema fails a healthy generation on a loaded machine.
    leader = stand_in_leader(budget_blocks=8)
    flights: list[Any] = []
    send = leader._send
    leader._send = lambda msg, flight, tokens: (flights.append(flight), send(msg, flight, tokens))[1]  # type: ignore[method-assign]
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    constraint = json_schema(schema, end=[0])
    spec = m.RequestSpec(
        request_id="c", prompt=[9] * 12, max_tokens=3, sampling=SamplingParams(constraint=constraint)
    )
    leader.handle(SimpleNamespace(message=m.Submit(front="f1", seq=1, request=spec)))
    submit(leader, "plain", prompt=12, max_tokens=3, seq=2)
    for _ in range(50):
        leader.act()
        if not leader.requests:
            break
    graced = [(f.request_id, f.n, f.grace) for f in flights if f.grace]
    # One step: the request's last prompt chunk, which samples; neither its first chunk nor its decode steps.
    assert graced == [("c", 4, compile_grace_s(len(constraint.source)))]
    assert compile_grace_s(len(constraint.source)) > 0
