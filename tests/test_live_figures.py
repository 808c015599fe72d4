"""What the dashboard shows, decided by pure functions: live figures, pauses, phases, departed nodes."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cluster_decisions import report

from shardline.api.live import HISTORY, Histories, InstanceHistory, hit_rate, sample
from shardline.api.metrics import Metrics
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.master_state import _phase, _transitions
from shardline.dataplane.messages import LeaderBeat
from shardline.front.figures import LeaderFigures


def beat(tokens: int, running: int = 1, waiting: int = 0, ttft: list[float] | None = None) -> LeaderBeat:
    held = [f"r{i}" for i in range(running + waiting)]
    return LeaderBeat(seen={}, requests=held, running=running, tokens=tokens, ttft_s=ttft or [])


@pytest.mark.timeout(10)
def test_figures_count_tokens_across_generations_and_never_go_back():
    f = LeaderFigures()
    f.take(beat(10, running=2, waiting=3), generation=0)
    f.take(beat(25), generation=0)
    assert f.tokens == 25 and f.running == 1 and f.waiting == 0
    f.idle()  # recovering: nothing runs
    assert (f.running, f.waiting) == (0, 0)
    f.take(beat(4), generation=1)  # the new leader counts from zero
    assert f.tokens == 29
    f.take(beat(3), generation=1)  # a beat out of order cannot take tokens back
    assert f.tokens == 29


@pytest.mark.timeout(10)
def test_samples_give_rates_and_the_median_first_token_wait_of_their_period():
    f, h = LeaderFigures(), InstanceHistory()
    f.take(beat(100, ttft=[9.0]), 0, now=9.0)
    first = sample(h, f, now=10.0, wall=1000.0)
    assert first.tokens_per_s == 0.0 and first.ttft_s == 9.0  # no earlier sample: no rate yet
    f.take(beat(140, ttft=[0.3, 0.5, 0.4]), 0, now=11.0)
    second = sample(h, f, now=12.0, wall=1002.0)
    assert second.tokens_per_s == 20.0 and second.ttft_s == 0.4 and second.running == 1
    third = sample(h, f, now=14.0, wall=1004.0)
    assert third.tokens_per_s == 0.0 and third.ttft_s is None  # nothing new in its period
    hs = Histories()
    for i in range(HISTORY + 20):
        hs.sample_all({"x": f}, now=float(i))
    assert len(hs.points("x")) == HISTORY  # bounded
    hs.sample_all({}, now=1e6)
    assert hs.points("x") == []  # an instance gone takes its history with it


def prefix_beat(queries: int, hits: int, blocks: int = 0) -> LeaderBeat:
    return LeaderBeat(
        seen={},
        requests=[],
        prefix_queries=queries,
        prefix_hits=hits,
        prefix_blocks=blocks,
        prefix_block_tokens=64,
    )


@pytest.mark.timeout(10)
def test_prefix_cache_totals_span_leaders_and_its_counters_never_go_back():
    f = LeaderFigures()
    metrics = Metrics(dict, figures=lambda: {"i": f})

    def scraped() -> dict[str, tuple[str, float]]:
        return {
            fam.name: (fam.type, s.value)
            for fam in text_string_to_metric_families(metrics.render().decode())
            if fam.name.startswith("shardline_prefix_cache")
            for s in fam.samples
            if s.labels == {"instance": "i"}
        }

    f.take(prefix_beat(100, 40, blocks=3), generation=0)
    f.take(prefix_beat(300, 200, blocks=5), generation=0)
    assert scraped() == {
        "shardline_prefix_cache_queries": ("counter", 300),
        "shardline_prefix_cache_hits": ("counter", 200),
        "shardline_prefix_cache_blocks": ("gauge", 5),
    }
    f.idle()  # recovering: the old leader's blocks went with it
    assert f.prefix_blocks == 0 and f.prefix_block_tokens == 64
    f.take(prefix_beat(50, 10, blocks=1), generation=1)  # a new leader counts from zero
    f.take(prefix_beat(20, 0), generation=1)  # a beat out of order takes nothing back...
    f.take(prefix_beat(60, 15, blocks=2), generation=1)  # ...and the next counts from the highest seen
    assert (f.prefix_queries, f.prefix_hits) == (360, 215)
    assert scraped() == {
        "shardline_prefix_cache_queries": ("counter", 360),
        "shardline_prefix_cache_hits": ("counter", 215),
        "shardline_prefix_cache_blocks": ("gauge", 2),
    }


@pytest.mark.timeout(10)
def test_samples_give_the_prefix_hit_rate_of_their_period():
    f, h = LeaderFigures(), InstanceHistory()
    assert sample(h, f, now=1.0, wall=1.0).prefix_hit_rate is None  # nothing looked up: no rate, not 0
    f.take(prefix_beat(200, 50, blocks=4), 0)
    point = sample(h, f, now=3.0, wall=3.0)
    assert point.prefix_hit_rate == 0.25 and point.prefix_blocks == 4
    f.take(prefix_beat(300, 140, blocks=4), 0)
    assert sample(h, f, now=5.0, wall=5.0).prefix_hit_rate == 0.9  # 90 of the period's 100
    assert sample(h, f, now=7.0, wall=7.0).prefix_hit_rate is None
    assert hit_rate(0, 0) is None and hit_rate(3, 1) == 0.3333


def _rec(phase: str, recoveries: int = 0, why: str = "") -> cm.InstanceRecord:
    stages = [cm.StageRecord(node_id="a", start=0, end=4), cm.StageRecord(node_id="b", start=4, end=8)]
    return cm.InstanceRecord(
        instance="i", model="m", phase=phase, recoveries=recoveries, why=why, stages=stages
    )


@pytest.mark.timeout(10)
def test_a_recovery_says_how_long_the_pause_lasted():
    ready, failed = _rec("ready"), _rec("recovering", 1, "stage 1 vanished")
    events, paused = _transitions(ready, failed, None, now=100.0)
    assert [e.kind for e in events] == ["failure"] and paused == 100.0
    assert events[0].node == "b" and "stage 1 vanished" in events[0].message
    events, paused = _transitions(failed, _rec("loading", 1), paused, now=101.0)
    assert events == [] and paused == 100.0  # still paused
    events, paused = _transitions(_rec("loading", 1), _rec("ready", 1), paused, now=103.5)
    assert [e.kind for e in events] == ["recovered"] and events[0].pause_s == 3.5 and paused is None
    # A face that lost its group member names itself, then the member: the event names the member's node.
    lost = "stage 0 failed (peer_lost): stage 0 member 1 (runner 1) stalled: sent nothing"
    events, _ = _transitions(ready, _rec("recovering", 1, lost), None, now=100.0)
    assert events[0].node == "b", events[0]
    # A first start is not a pause.
    events, paused = _transitions(_rec("loading"), _rec("ready"), None, now=5.0)
    assert [e.kind for e in events] == ["ready"] and events[0].pause_s is None and paused is None


@pytest.mark.timeout(10)
def test_an_instance_is_recovering_until_it_serves_again():
    assert _phase("starting", ["weights", "ready"]) == "weights"
    assert _phase("starting", ["weights", "ready"], failures=1) == "recovering"
    assert _phase("serving", ["ready"], failures=3) == "ready"
    assert _phase("failed", [], failures=3) == "failed"


@pytest.mark.timeout(10)
def test_a_node_that_left_is_kept_as_departed_until_it_rejoins():
    s = cs.ClusterState(me="a", lease_s=2.0)
    for e in (cs.Alive("b"), cs.ReportIn(report("b"), at=10.0), cs.Gone("b"), cs.Tick(13.0, wall=500.0)):
        s, _ = cs.apply(s, e)
    assert "b" not in s.reports and s.departed["b"][1] == 500.0
    s, _ = cs.apply(s, cs.Alive("b"))
    assert "b" not in s.departed
    for i in range(cs.MAX_DEPARTED + 5):  # bounded: the oldest departures are forgotten
        n = f"n{i:02d}"
        for e in (cs.Alive(n), cs.ReportIn(report(n), at=20.0), cs.Gone(n), cs.Tick(30.0, wall=1000.0 + i)):
            s, _ = cs.apply(s, e)
    assert len(s.departed) == cs.MAX_DEPARTED and "n00" not in s.departed
