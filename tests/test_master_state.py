"""The master as a pure fold (cluster/master_state.py): queries, controllers' updates and ticks in, commands
out. No processes, no threads, no clock: state in, state and commands out. And the controller's first launch
failing (controller/controller.py) leaves `placed` with its reason."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from shardline.cluster import layouts
from shardline.cluster import master_state as ms
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.placement import PlacementRequest
from shardline.models.footprint import ModelFootprint

FP = ModelFootprint(
    name="m",
    layers=8,
    layer_bytes=[10**6] * 8,
    embed_bytes=10**6,
    head_bytes=10**5,
    tied=False,
    kv_bytes_per_token_per_layer=256,
    context_length=1024,
    hidden_size=64,
    vocab_size=512,
    weight_format="q4_1→affine4/g32",
)
REQ = PlacementRequest(sequences=1, reserve_tokens=64, hop_cost_fraction=0.0, max_stages=2)
DIGEST = "d" * 64  # the model digest every holder reports (its import record's)
RES = cm.Resources(memory_total=8 << 30, memory_available=1 << 30, compute_score=50.0, device="cpu", cpus=2)


def report(
    node: str, runners: list[cm.RunnerInfo] | None = None, term: int = 0, **kw: object
) -> cm.NodeReport:
    return cm.NodeReport(
        node_id=node,
        name=node,
        endpoint="tcp/127.0.0.1:7447",
        started_at=0.0,
        resources=RES,
        models={"m": cm.LocalModel(full=True, footprint=FP, digest=DIGEST)},
        runners=runners or [],
        term=term,
        **kw,  # type: ignore[arg-type]
    )


def cluster(nodes: list[str] = ["a", "b"], **reports: cm.NodeReport) -> cs.ClusterState:  # noqa: B006
    s = cs.ClusterState(me=nodes[0])
    for n in nodes:
        s, _ = cs.apply(s, cs.Alive(n))
        s, _ = cs.apply(s, cs.ReportIn(reports.get(n) or report(n), at=0.0))
    return s


def master(now: float = 0.0, state: cs.ClusterState | None = None) -> ms.MasterState:
    config = ms.MasterConfig(me="a", report_s=0.5, threads=1)
    return ms.initial(config, 1, ms.snapshot(state or cluster(), now, 1000.0 + now))


def place(nonce: str = "", qid: int = 0, salt: str = "s0", **kw: object) -> ms.QueryIn:
    return ms.QueryIn(qid, cm.Place(model="m", request=REQ, nonce=nonce, **kw), salt=salt, at=1.0)  # type: ignore[arg-type]


def replies(commands: list[ms.Effect]) -> list[ms.Reply]:
    return [c for c in commands if isinstance(c, ms.Reply)]


@pytest.mark.timeout(10)
def test_place_starts_one_instance_replies_once_and_the_next_tick_publishes_it():
    s = master()
    s, out = ms.apply(s, place(nonce="n1", qid=7))
    [start] = [c for c in out if isinstance(c, ms.StartInstance)]
    [reply] = replies(out)
    assert reply.qid == 7 and reply.reply.ok and reply.reply.instance == start.record
    assert start.record.instance == "m-s0" and not start.adopt and start.attn_keys == 6 * 64
    assert start.record.weight_format == "q4_1→affine4/g32"  # shown in /state and on the dashboard
    assert [c.event.kind for c in out if isinstance(c, ms.Log)] == ["placed"]
    assert s.running == {"m-s0"} and s.dirty
    s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(), 0.01, 1000.0)))
    [pub] = [c for c in out if isinstance(c, ms.PublishView)]
    assert (
        [r.instance for r in pub.view.instances] == ["m-s0"] and pub.view.seq == 1 and pub.view.master == "a"
    )
    # A retry of the same query is the first answer again, and nothing more.
    s2, out = ms.apply(s, place(nonce="n1", qid=8, salt="other"))
    assert s2 is s and out == [ms.Reply(8, reply.reply)]


@pytest.mark.timeout(10)
def test_place_if_absent_answers_with_the_instance_that_exists():
    s = master()
    s, out1 = ms.apply(s, place(if_absent=True, salt="x1", qid=1))
    s, out2 = ms.apply(s, place(if_absent=True, salt="x2", qid=2))
    assert len(s.records) == 1 and [c for c in out2 if isinstance(c, ms.StartInstance)] == []
    assert replies(out1)[0].reply.instance == replies(out2)[0].reply.instance
    # Without it a second one is placed; a failed instance is not what if_absent answers with.
    s, _ = ms.apply(s, place(salt="x3", qid=3))
    assert len(s.records) == 2
    for i in list(s.records):
        s, _ = ms.apply(s, update(i, "failed", failure="boom"))
    s, out = ms.apply(s, place(if_absent=True, salt="x4", qid=4))
    assert replies(out)[0].reply.instance.instance == "m-x4" and len(s.records) == 3


@pytest.mark.timeout(10)
def test_refusals_and_previews_start_nothing():
    s = master()
    s2, out = ms.apply(s, ms.QueryIn(1, cm.Place(model="nope"), salt="q"))
    assert not replies(out)[0].reply.ok and "no live node" in replies(out)[0].reply.error and s2.records == {}
    big = REQ.model_copy(update={"sequences": 10**6, "reserve_tokens": 10**6})
    s2, out = ms.apply(s, ms.QueryIn(2, cm.Place(model="m", request=big), salt="q"))
    assert not replies(out)[0].reply.ok and s2.records == {}
    s2, out = ms.apply(s, place(dry_run=True))
    assert replies(out)[0].reply.placement is not None and s2.records == {} and len(out) == 1
    s2, out = ms.apply(s, ms.QueryIn(3, cm.Remove(instance="ghost")))
    assert not replies(out)[0].reply.ok and s2 is s


@pytest.mark.timeout(10)
def test_answered_nonces_are_bounded_oldest_forgotten_first():
    s = master()
    for k in range(ms.MAX_ANSWERED + 5):
        s, _ = ms.apply(s, ms.QueryIn(k, cm.Remove(instance="ghost", nonce=f"n{k}")))
    assert len(s.answered) == ms.MAX_ANSWERED
    assert "n0" not in s.answered and f"n{ms.MAX_ANSWERED + 4}" in s.answered


def update(
    instance: str, phase: str, failures: int = 0, failure: str = "", last: str = ""
) -> ms.InstanceUpdate:
    stage = ms.StageInfo(phase="ready" if phase == "serving" else "loading", pid=42)
    return ms.InstanceUpdate(instance, 0, phase, (stage, stage), failures, failure, last, 128, at=5.0)


@pytest.mark.timeout(10)
def test_controller_updates_become_records_and_events_and_remove_stops_it():
    s = master()
    s, out = ms.apply(s, place())
    i = replies(out)[0].reply.instance.instance
    s, out = ms.apply(
        s,
        ms.Laid(
            i, 0, (cm.StageRecord(node_id="a", start=0, end=4), cm.StageRecord(node_id="b", start=4, end=8))
        ),
    )
    assert s.records[i].generation == 0 and s.records[i].phase == "placed" and out == []
    s, out = ms.apply(s, update(i, "starting"))
    assert s.records[i].phase == "loading" and s.records[i].stages[1].pid == 42 and out == []
    s, out = ms.apply(s, update(i, "serving"))
    assert s.records[i].phase == "ready" and s.records[i].kv_bytes_per_token == 128
    assert [c.event.kind for c in out] == ["ready"]
    s, out = ms.apply(s, update(i, "backoff", failures=1, last="stage 1 exited"))
    assert s.records[i].phase == "recovering" and s.records[i].why == "stage 1 exited"
    assert [(c.event.kind, c.event.node) for c in out] == [("failure", "b")] and i in s.paused
    s, out = ms.apply(s, ms.QueryIn(9, cm.Remove(instance=i)))
    assert out[0] == ms.StopInstance(i) and replies(out)[0].reply.ok
    assert s.records == {} and s.running == frozenset() and s.paused == {}
    s2, out = ms.apply(s, update(i, "serving"))  # a late update of a removed instance changes nothing
    assert s2 is s and out == []


@pytest.mark.timeout(10)
def test_a_new_master_adopts_what_serves_and_rebuilds_the_rest_after_two_report_periods():
    rec = cm.InstanceRecord(
        instance="m-1",
        model="m",
        generation=3,
        phase="ready",
        stages=[cm.StageRecord(node_id="a", start=0, end=4), cm.StageRecord(node_id="b", start=4, end=8)],
    )
    half = rec.model_copy(update={"instance": "m-2"})
    info = lambda i, k, s, e: cm.RunnerInfo(instance=i, generation=3, slot=k, start=s, end=e, pid=1)  # noqa: E731
    reports = {
        "a": report("a", [info("m-1", 0, 0, 4), info("m-2", 0, 0, 4)], term=1),
        "b": report("b", [info("m-1", 1, 4, 8)], term=1, instances=[rec, half]),
    }
    s = master(0.0, cluster(**reports))
    assert set(s.records) == {"m-1", "m-2"} and s.running == frozenset()
    s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(**reports), 0.5, 1000.5)))
    assert not [c for c in out if isinstance(c, ms.StartInstance)]  # not yet: every node reports first
    s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(**reports), 1.0, 1001.0)))
    starts = {c.record.instance: c for c in out if isinstance(c, ms.StartInstance)}
    assert starts["m-1"].adopt and starts["m-1"].lost == ()
    assert not starts["m-2"].adopt and starts["m-2"].lost == (1,)
    [pub] = [c for c in out if isinstance(c, ms.PublishView)]
    assert {r.instance for r in pub.view.instances} == {"m-1", "m-2"}  # never a view that forgets one
    s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(**reports), 1.5, 1001.5)))
    assert not [c for c in out if isinstance(c, ms.StartInstance)]  # once
    # Node b leaves: both instances' stage 1 are faulted.
    s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(["a"], **reports), 1.6, 1001.6), changed=True))
    faults = sorted((c.instance, c.stages) for c in out if isinstance(c, ms.FaultGeneration))
    assert faults == [("m-1", (1,)), ("m-2", (1,))]


@pytest.mark.timeout(10)
def test_layout_places_over_the_snapshot_and_names_the_agents():
    s = master()
    s, out = ms.apply(s, place())
    i = replies(out)[0].reply.instance.instance
    stages, launches, _ = layouts.layout(s, i, 0, keep={}, avoid=set())
    assert [k for k, _ in launches] == [f"shardline/node/{st.node_id}/agent" for st in stages]
    assert [x.spec.layer_start for _, x in launches] == [st.start for st in stages]
    assert all(x.term == 1 and x.spec.generation == 0 for _, x in launches)
    with pytest.raises(layouts.LayoutError):
        layouts.layout(s, "ghost", 0, keep={}, avoid=set())


queries = hs.one_of(
    hs.builds(lambda n, f: ("place", n, f), hs.sampled_from(["", "n1", "n2", "n3"]), hs.booleans()),
    hs.builds(lambda n, k: ("remove", n, k), hs.sampled_from(["", "n4", "n5"]), hs.integers(0, 5)),
    hs.builds(lambda t: ("tick", t), hs.floats(0, 0.4)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hs.lists(queries, max_size=25))
def test_any_sequence_of_queries_and_ticks_keeps_the_invariants(steps):
    s, now, qid = master(), 0.0, 0
    asked: dict[str, cm.MasterReply] = {}
    replied: list[int] = []
    for step in steps:
        if step[0] == "tick":
            now += step[1]
            s, out = ms.apply(s, ms.Seen(ms.snapshot(cluster(), now, 1000 + now)))
            assert not replies(out)
            continue
        qid += 1
        if step[0] == "place":
            q = ms.QueryIn(
                qid, cm.Place(model="m", request=REQ, nonce=step[1], if_absent=step[2]), salt=f"{qid}"
            )
        else:
            names = sorted(s.records)
            target = names[step[2] % len(names)] if names else "ghost"
            q = ms.QueryIn(qid, cm.Remove(instance=target, nonce=step[1]))
        before = dict(s.records)
        s, out = ms.apply(s, q)
        [r] = replies(out)  # exactly one reply per query
        replied.append(r.qid)
        nonce = q.query.nonce
        retry = nonce in asked
        if retry:  # a retry: the first answer, nothing changes
            assert r.reply == asked[nonce] and s.records == before
        elif nonce:
            asked[nonce] = r.reply
        if step[0] == "place" and step[2] and not retry and before:
            assert s.records == before and r.reply.instance in before.values()  # if_absent: no second one
        # One record per instance id, each with a controller; the view lists exactly the records.
        assert set(s.records) == set(s.running)
        assert all(k == v.instance for k, v in s.records.items())
        starts = [c.record.instance for c in out if isinstance(c, ms.StartInstance)]
        stops = [c.instance for c in out if isinstance(c, ms.StopInstance)]
        assert set(starts) == set(s.records) - set(before) and set(stops) == set(before) - set(s.records)
    assert replied == list(range(1, qid + 1))
    assert ms.view(s).instances == list(s.records.values())


@pytest.mark.timeout(30)
def test_a_first_launch_that_raises_leaves_placed_for_failed_with_its_reason():
    from shardline.controller.controller import InstanceController
    from shardline.controller.state import ControllerConfig
    from shardline.dataplane.transport import Keys, open_session

    def layout(generation: int) -> list:
        raise RuntimeError("injected at layout")

    changes: list[str] = []
    session = open_session([], [])
    try:
        c = InstanceController(
            session,
            Keys("t-inst", 0, "test-first-launch"),
            ControllerConfig(stages=1),
            layout,
            1 << 20,
            64,
            on_change=lambda: changes.append(c.state.phase),
        )
        c.start()
        assert c.wait_settled(10) == "failed"
        assert "injected at layout" in (c.state.failure or "")
        deadline = time.monotonic() + 5
        while not changes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert changes == ["failed"]  # the master hears of it: its record leaves `placed`
        c.stop(grace_s=0.1)
    finally:
        session.close()


@pytest.mark.timeout(30)
def test_the_shell_answers_queries_from_the_loop_step_not_the_zenoh_callback():
    """A query is posted to the node's queue by the callback and answered when the loop steps: the zenoh
    Query is kept until then. A bad query is refused at once; a deposed master's pending queries drop."""
    import queue
    import threading

    from shardline.cluster.master import Master, Posted
    from shardline.dataplane.transport import open_session
    from shardline.instance.settings import InstanceSettings

    session = open_session([], [])
    posted: queue.Queue[Posted] = queue.Queue()
    views: list[cm.ClusterView] = []
    logged: list[cm.ClusterEvent] = []
    config = ms.MasterConfig(me="a", namespace="test-master-shell", report_s=0.5)
    snap = lambda: ms.snapshot(cluster(), time.monotonic(), time.time())  # noqa: E731
    m = Master(session, config, InstanceSettings(), 1, snap(), posted.put, views.append, logged.extend)
    key = "test-master-shell/master/query"
    try:
        got: list[cm.MasterReply] = []

        def ask(q: cm.Place | cm.Remove) -> None:
            for r in session.get(key, payload=q.model_dump_json(), timeout=10):
                got.append(cm.MasterReply.model_validate_json(r.ok.payload.to_bytes()))

        asker = threading.Thread(
            target=ask, args=(cm.Place(model="m", request=REQ, dry_run=True, nonce="d1"),)
        )
        asker.start()
        e = posted.get(timeout=5)
        assert e.master is m and isinstance(e.event, ms.QueryIn) and got == []  # not answered in the callback
        m.step([e.event], snap, changed=False)
        asker.join(10)
        assert len(got) == 1 and got[0].ok and got[0].placement is not None and views  # and a view went out
        for r in session.get(key, payload=b"{not json", timeout=5):  # refused at once, never posted
            assert "ValidationError" in cm.MasterReply.model_validate_json(r.ok.payload.to_bytes()).error
        assert posted.empty()
        asker = threading.Thread(target=ask, args=(cm.Remove(instance="ghost"),))
        asker.start()
        posted.get(timeout=5)
        m.close()  # deposed before the step: the query is dropped, the client asks again elsewhere
        asker.join(15)
        assert not asker.is_alive() and len(got) == 1
    finally:
        m.close()
        session.close()


@pytest.mark.timeout(10)
def test_runners_share_their_nodes_cores():
    """Unless the node sets --threads, a node's runners divide its cores: one stage alone on a machine
    takes them all for its products; a second runner there (of any instance) halves them."""
    auto = ms.initial(ms.MasterConfig(me="a", report_s=0.5), 1, ms.snapshot(cluster(), 0.0, 1000.0))
    two = [cm.StageRecord(node_id="a", start=0, end=3), cm.StageRecord(node_id="b", start=3, end=6)]
    assert layouts.runner_threads(auto, "m-s0", two) == {"a": 2, "b": 2}
    stacked = [cm.StageRecord(node_id="a", start=0, end=3), cm.StageRecord(node_id="a", start=3, end=6)]
    assert layouts.runner_threads(auto, "m-s0", stacked) == {"a": 1}
    s, _ = ms.apply(auto, place(salt="s1"))  # another instance, with a runner on each node
    assert layouts.runner_threads(s, "m-s0", two) == {"a": 1, "b": 1}
    assert layouts.runner_threads(master(), "m-s0", two) == {"a": 1, "b": 1}  # --threads 1
