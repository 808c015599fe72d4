"""The cluster's pure decisions: election, membership, mastery claims, fencing, node losses, survivor-keeping
placement. No processes: state in, decision out."""

from __future__ import annotations

import pytest

from shardline.cluster import election
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.election import elect, newer
from shardline.cluster.placement import NodeCapacity, PlacementRequest, place
from shardline.models.footprint import ModelFootprint

RES = cm.Resources(memory_total=8 << 30, memory_available=4 << 30, compute_score=50.0, device="cpu", cpus=2)


def report(node: str, term: int = 0, runners: list[cm.RunnerInfo] | None = None) -> cm.NodeReport:
    return cm.NodeReport(
        node_id=node,
        name=node,
        endpoint="tcp/127.0.0.1:1",
        started_at=0.0,
        resources=RES,
        term=term,
        runners=runners or [],
    )


@pytest.mark.timeout(10)
def test_election_is_sticky_lowest_id_and_raises_the_term():
    assert elect({"b", "c"}, "c", 4) == ("c", 4)  # the sitting master stays while alive
    assert elect({"b", "c"}, "a", 4) == ("b", 5)  # else the lowest live id, with a new term
    assert elect(set(), "a", 4) == (None, 4)
    assert newer(5, "z", 4, "a") and not newer(4, "a", 5, "z")
    assert newer(4, "a", 4, "b") and not newer(4, "b", 4, "a")  # one term, two claims: the lower id wins
    assert newer(1, "a", 0, None)


@pytest.mark.timeout(10)
def test_membership_needs_both_token_and_reports_gone():
    s = cs.ClusterState(me="a", lease_s=2.0)
    assert [e.kind for e in cs.apply(s, cs.Alive("b"), 0)] == ["join"]
    cs.apply(s, cs.ReportIn(report("b"), at=10.0), 0)
    cs.apply(s, cs.Gone("b"), 0)  # the token blinks...
    assert cs.apply(s, cs.Tick(11.0), 0) == [] and "b" in s.alive  # ...while reports still come: alive
    cs.apply(s, cs.ReportIn(report("b"), at=11.5), 0)
    assert cs.apply(s, cs.Tick(13.0), 0) == [] and "b" in s.alive
    left = cs.apply(s, cs.Tick(13.6), 0)  # no token, last report older than the lease: gone
    assert [e.kind for e in left] == ["leave"] and "b" not in s.alive and "b" not in s.reports
    # A report after that is a node that lives (its token's event may be lost on a link that flapped): it
    # rejoins for a lease, and leaves again when nothing more comes.
    assert [e.kind for e in cs.apply(s, cs.ReportIn(report("b"), at=14.0), 0)] == ["join"]
    assert [e.kind for e in cs.apply(s, cs.Tick(16.1), 0)] == ["leave"]
    assert cs.apply(s, cs.ReportIn(report("b").model_copy(update={"leaving": True}), at=16.5), 0) == []
    assert "b" not in s.alive  # a leaving node's last report brings nothing back
    assert [e.kind for e in cs.apply(s, cs.Alive("b"), 0)] == ["join"]  # it rejoins with its token
    cs.apply(s, cs.ReportIn(report("b"), at=17.0), 0)
    assert list(s.reports) == ["b"]  # one entry: the same id, no ghost


@pytest.mark.timeout(10)
def test_a_member_whose_token_event_was_lost_counts_for_the_masters_quorum_by_its_reports():
    # The soak's partition: n0's link flapped and it never heard n3's token again; n3's reports kept coming
    # and were dropped, so n0, master again with n3's and n4's votes, stepped down at once for want of them.
    s = cs.ClusterState(me="a", lease_s=2.0)
    for n in "abc":
        cs.apply(s, cs.Alive(n), 0)
    cs.apply(s, cs.Gone("c"), 0)  # its token's event is lost; it still reports
    cs.apply(s, cs.Tick(5.0), 0)
    assert "c" not in s.alive
    cs.apply(s, cs.ReportIn(report("c"), at=5.5), 0)
    cs.apply(s, cs.Tick(6.0), 0)
    assert "c" in s.alive


@pytest.mark.timeout(10)
def test_only_the_node_the_rule_names_campaigns_and_wins_with_a_quorum():
    a, b = cs.ClusterState(me="a"), cs.ClusterState(me="b")
    for s in (a, b):
        cs.apply(s, cs.Alive("a"), 0)
        cs.apply(s, cs.Alive("b"), 0)
    assert cs.campaign(a, settled=False, now=0, patience=1) is None
    claim = cs.campaign(a, settled=True, now=0, patience=1)
    assert claim is not None and claim.term == 1 and claim.members == ["a", "b"]
    assert cs.campaign(b, settled=True, now=0, patience=1) is None
    # Exactly half of {a, b} holding the lowest id is a quorum: a wins on its own vote.
    assert cs.count(a) == 1 and a.is_master
    vote = cs.grant(b, claim)
    assert vote is not None
    assert cs.grant(b, claim.model_copy(update={"candidate": "c"})) is None  # once a term
    abc = cm.Membership(members=["a", "b", "c"], term=1)  # c joined: the master's committed change
    view = cm.ClusterView(term=1, master="a", nodes=[member("a"), member("b"), member("c")], membership=abc)
    for s in (a, b):
        cs.apply(s, cs.ViewIn(view), 0)
    assert cs.campaign(b, settled=True, now=0, patience=1) is None
    # A stale view of a lower term changes nothing.
    cs.apply(b, cs.ViewIn(cm.ClusterView(term=0, master="z")), 0)
    assert b.master == "a" and b.term == 1
    # The master leaves: alone, b holds no quorum of {a, b, c}; with c it campaigns for the next term.
    cs.apply(b, cs.Gone("a"), 0)
    cs.apply(b, cs.Tick(1e9), 0)
    assert cs.campaign(b, settled=True, now=0, patience=1) is None
    cs.apply(b, cs.Alive("c"), 0)
    again = cs.campaign(b, settled=True, now=0, patience=1)
    assert again is not None and again.term == 2 and cs.count(b) is None
    assert cs.count(b, cm.Vote(term=2, candidate="b", voter="c")) == 2 and b.is_master


def member(node: str, alive: bool = True) -> cm.NodeSummary:
    return cm.NodeSummary(node_id=node, name=node, endpoint="", alive=alive)


@pytest.mark.timeout(10)
def test_exactly_half_elects_only_with_the_lowest_id():
    members = {"a", "b", "c", "d"}
    assert election.quorum({"a", "b"}, members) and not election.quorum({"c", "d"}, members)
    assert election.quorum({"b", "c", "d"}, members) and not election.quorum({"b"}, {"a", "b"})
    assert not election.quorum({"x", "y", "z"}, members)  # votes of non-members count for nothing


@pytest.mark.timeout(10)
def test_a_node_does_not_vote_against_a_master_it_sees():
    c = cs.ClusterState(me="c")
    for n in ("a", "b", "c"):
        cs.apply(c, cs.Alive(n), 0)
    cs.apply(c, cs.ViewIn(cm.ClusterView(term=3, master="a")), 0)
    claim = cm.Claim(term=4, candidate="b", members=["a", "b", "c"])
    assert cs.grant(c, claim) is None and cs.reconsider(c) is None  # a is still seen
    cs.apply(c, cs.Gone("a"), 0)
    cs.apply(c, cs.Tick(1e9), 0)
    assert cs.reconsider(c) == cm.Vote(term=4, candidate="b", voter="c")  # once a is gone: no new ask
    assert cs.reconsider(c) is None
    assert cs.grant(c, cm.Claim(term=3, candidate="b", members=[])) is None  # not above the view's term


@pytest.mark.timeout(10)
def test_fencing_judges_only_runners_older_than_the_view():
    rec = cm.InstanceRecord(instance="i", model="m", generation=3, phase="ready")
    view = cm.ClusterView(term=2, master="a", seq=10, instances=[rec])

    def runner(instance: str, generation: int, issued: tuple[int, int]) -> cm.RunnerInfo:
        return cm.RunnerInfo(instance=instance, generation=generation, stage=0, start=0, end=1, issued=issued)

    assert cs.stale_runners(view, [runner("i", 3, (2, 5))]) == []
    assert cs.stale_runners(view, [runner("i", 2, (2, 5))]) == [("i", 3)]  # an older generation stops
    assert cs.stale_runners(view, [runner("j", 0, (2, 5))]) == [("j", -1)]  # an instance no longer listed
    assert cs.stale_runners(view, [runner("j", 0, (2, 10))]) == []  # started after this view was made
    assert cs.stale_runners(view, [runner("i", 4, (2, 3))]) == []  # a newer generation than the view's
    placed = rec.model_copy(update={"generation": -1, "phase": "placed"})
    unlaid = view.model_copy(update={"instances": [placed]})
    assert cs.stale_runners(unlaid, [runner("i", 0, (2, 3))]) == []  # launched before the view saw the layout
    starting = view.model_copy(update={"instances": [rec.model_copy(update={"phase": "loading"})]})
    assert cs.stale_runners(starting, [runner("i", 2, (2, 5))]) == []  # may be handed to generation 3
    failed = view.model_copy(update={"instances": [rec.model_copy(update={"phase": "failed"})]})
    assert cs.stale_runners(failed, [runner("i", 3, (2, 5))]) == [("i", -1)]


@pytest.mark.timeout(10)
def test_node_losses_name_the_instances_and_nodes():
    s = cs.ClusterState(me="a")
    for n in ("a", "b"):
        cs.apply(s, cs.Alive(n), 0)
    stages = [cm.StageRecord(node_id="a", start=0, end=3), cm.StageRecord(node_id="c", start=3, end=6)]
    rec = cm.InstanceRecord(instance="i", model="m", generation=1, phase="ready", stages=stages)
    assert cs.node_losses(s, [rec]) == [("i", 1, "node c left the cluster", {"c"})]
    assert cs.node_losses(s, [rec.model_copy(update={"phase": "failed"})]) == []


@pytest.mark.timeout(10)
def test_placement_keeps_a_survivors_range_when_nearly_as_fast():
    fp = ModelFootprint(
        name="m",
        layers=30,
        layer_bytes=[10**7] * 30,
        embed_bytes=10**7,
        head_bytes=10**6,
        tied=False,
        kv_bytes_per_token_per_layer=1024,
        context_length=4096,
        hidden_size=64,
        vocab_size=512,
    )
    request = PlacementRequest(sequences=1, reserve_tokens=256, hop_cost_fraction=0.0, max_stages=2)
    nodes = [NodeCapacity("n1", 4 << 30, 50.0), NodeCapacity("n3", 4 << 30, 46.0)]  # noisy scores
    free = place(fp, nodes, request)
    assert free.stages[0].end != 15  # the noise moves the cut...
    kept = place(fp, nodes, request, keep={"n1": (0, 15)})
    assert [(a.node_id, a.start, a.end) for a in kept.stages] == [("n1", 0, 15), ("n3", 15, 30)]  # ...unless
    assert kept.est_step_time <= free.est_step_time * 1.25
    # A survivor at the end: the replacement goes into the hole before it, not after it.
    tail = place(
        fp,
        [NodeCapacity("n9", 4 << 30, 50.0), NodeCapacity("n2", 4 << 30, 50.0)],
        request,
        keep={"n2": (15, 30)},
    )
    assert [(a.node_id, a.start, a.end) for a in tail.stages] == [("n9", 0, 15), ("n2", 15, 30)]
