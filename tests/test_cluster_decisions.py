"""The cluster's pure decisions: election, membership, mastery claims, fencing, node losses, survivor-keeping
placement. No processes: state in, decision out."""

from __future__ import annotations

import pytest

from shardline.cluster import election, facts
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


def fold(s: cs.ClusterState, *events: cs.Event) -> tuple[cs.ClusterState, list[cs.Effect]]:
    out: list[cs.Effect] = []
    for e in events:
        s, fx = cs.apply(s, e)
        out += fx
    return s, out


def kinds(effects: list[cs.Effect]) -> list[str]:
    return [e.kind for e in cs.happened(effects)]


def sent(effects: list[cs.Effect]) -> list[cm.Claim | cm.Vote]:
    return [fx.ballot for fx in effects if isinstance(fx, cs.Send)]


def won(effects: list[cs.Effect]) -> int | None:
    return next((fx.term for fx in effects if isinstance(fx, cs.Won)), None)


def campaign(s: cs.ClusterState, settled: bool = True) -> tuple[cs.ClusterState, list[cs.Effect]]:
    return cs.apply(s, cs.Campaign(now=0, settled=settled, patience=1))


@pytest.mark.timeout(10)
def test_membership_needs_both_token_and_reports_gone():
    s = cs.ClusterState(me="a", lease_s=2.0)
    s, fx = cs.apply(s, cs.Alive("b"))
    assert kinds(fx) == ["join"]
    s, _ = fold(s, cs.ReportIn(report("b"), at=10.0), cs.Gone("b"))  # the token blinks...
    s, fx = cs.apply(s, cs.Tick(11.0))
    assert fx == [] and "b" in s.alive  # ...while reports still come: alive
    s, _ = cs.apply(s, cs.ReportIn(report("b"), at=11.5))
    s, fx = cs.apply(s, cs.Tick(13.0))
    assert fx == [] and "b" in s.alive
    s, left = cs.apply(s, cs.Tick(13.6))  # no token, last report older than the lease: gone
    assert kinds(left) == ["leave"] and "b" not in s.alive and "b" not in s.reports
    # A report after that is a node that lives (its token's event may be lost on a link that flapped): it
    # rejoins for a lease, and leaves again when nothing more comes.
    s, fx = cs.apply(s, cs.ReportIn(report("b"), at=14.0))
    assert kinds(fx) == ["join"]
    s, fx = cs.apply(s, cs.Tick(16.1))
    assert kinds(fx) == ["leave"]
    s, fx = cs.apply(s, cs.ReportIn(report("b").model_copy(update={"leaving": True}), at=16.5))
    assert fx == [] and "b" not in s.alive  # a leaving node's last report brings nothing back
    s, fx = cs.apply(s, cs.Alive("b"))
    assert kinds(fx) == ["join"]  # it rejoins with its token
    s, _ = cs.apply(s, cs.ReportIn(report("b"), at=17.0))
    assert list(s.reports) == ["b"]  # one entry: the same id, no ghost
    assert [e.kind for e in s.events] == ["join", "leave", "join", "leave", "join"]  # kept for the views


@pytest.mark.timeout(10)
def test_a_report_replaces_only_its_own_entry():
    s, _ = fold(cs.ClusterState(me="a"), cs.Alive("b"), cs.ReportIn(report("a")), cs.ReportIn(report("b")))
    before = s
    s, fx = cs.apply(s, cs.ReportIn(report("b"), at=1.0))
    assert fx == [] and s.reports["a"] is before.reports["a"] and s.departed is before.departed
    assert s.alive is before.alive and s.events is before.events
    assert before.heard["b"] == 0.0 and s.heard["b"] == 1.0  # the older state is left as it was


@pytest.mark.timeout(10)
def test_a_member_whose_token_event_was_lost_counts_for_the_masters_quorum_by_its_reports():
    # The soak's partition: n0's link flapped and it never heard n3's token again; n3's reports kept coming
    # and were dropped, so n0, master again with n3's and n4's votes, stepped down at once for want of them.
    s = cs.ClusterState(me="a", lease_s=2.0)
    s, _ = fold(s, *(cs.Alive(n) for n in "abc"))
    s, _ = fold(s, cs.Gone("c"), cs.Tick(5.0))  # its token's event is lost; it still reports
    assert "c" not in s.alive
    s, _ = fold(s, cs.ReportIn(report("c"), at=5.5), cs.Tick(6.0))
    assert "c" in s.alive


@pytest.mark.timeout(10)
def test_only_the_node_the_rule_names_campaigns_and_wins_with_a_quorum():
    a, _ = fold(cs.ClusterState(me="a"), cs.Alive("a"), cs.Alive("b"))
    b, _ = fold(cs.ClusterState(me="b"), cs.Alive("a"), cs.Alive("b"))
    assert campaign(a, settled=False)[1] == []
    a, fx = campaign(a)
    [claim] = sent(fx)
    assert isinstance(claim, cm.Claim) and claim.term == 1 and claim.members == ["a", "b"]
    assert campaign(b)[1] == []
    # Exactly half of {a, b} holding the lowest id is a quorum: a wins on its own vote.
    assert won(fx) == 1 and a.is_master and [e.kind for e in a.events][-1] == "master"
    b, fx = cs.apply(b, cs.ClaimIn(claim))
    assert sent(fx) != []
    b, fx = cs.apply(b, cs.ClaimIn(claim.model_copy(update={"candidate": "c"})))
    assert fx == []  # once a term
    abc = cm.Membership(members=["a", "b", "c"], term=1)  # c joined: the master's committed change
    view = cm.ClusterView(term=1, master="a", nodes=[member("a"), member("b"), member("c")], membership=abc)
    a, _ = cs.apply(a, cs.ViewIn(view))
    b, _ = cs.apply(b, cs.ViewIn(view))
    assert campaign(b)[1] == []
    # A stale view of a lower term changes nothing.
    b, _ = cs.apply(b, cs.ViewIn(cm.ClusterView(term=0, master="z")))
    assert b.master == "a" and b.term == 1
    # The master leaves: alone, b holds no quorum of {a, b, c}; with c it campaigns for the next term.
    b, _ = fold(b, cs.Gone("a"), cs.Tick(1e9))
    assert campaign(b)[1] == []
    b, _ = cs.apply(b, cs.Alive("c"))
    b, fx = campaign(b)
    [again] = sent(fx)
    assert again.term == 2 and won(fx) is None
    b, fx = cs.apply(b, cs.VoteIn(cm.Vote(term=2, candidate="b", voter="c")))
    assert won(fx) == 2 and b.is_master


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
    c, _ = fold(cs.ClusterState(me="c"), *(cs.Alive(n) for n in ("a", "b", "c")))
    c, _ = cs.apply(c, cs.ViewIn(cm.ClusterView(term=3, master="a")))
    claim = cm.Claim(term=4, candidate="b", members=["a", "b", "c"])
    c, fx = fold(c, cs.ClaimIn(claim), cs.Campaign(now=0, settled=False, patience=1))
    assert fx == []  # a is still seen
    c, _ = fold(c, cs.Gone("a"), cs.Tick(1e9))
    c, fx = cs.apply(c, cs.Campaign(now=0, settled=False, patience=1))
    assert sent(fx) == [cm.Vote(term=4, candidate="b", voter="c")]  # once a is gone: no new ask
    c, fx = cs.apply(c, cs.Campaign(now=0, settled=False, patience=1))
    assert fx == []
    c, fx = cs.apply(c, cs.ClaimIn(cm.Claim(term=3, candidate="b", members=[])))
    assert fx == []  # not above the view's term


@pytest.mark.timeout(10)
def test_fencing_judges_only_runners_older_than_the_view():
    rec = cm.InstanceRecord(instance="i", model="m", generation=3, phase="ready")
    view = cm.ClusterView(term=2, master="a", seq=10, instances=[rec])

    def runner(instance: str, generation: int, issued: tuple[int, int]) -> cm.RunnerInfo:
        return cm.RunnerInfo(instance=instance, generation=generation, slot=0, start=0, end=1, issued=issued)

    assert facts.stale_runners(view, [runner("i", 3, (2, 5))]) == []
    assert facts.stale_runners(view, [runner("i", 2, (2, 5))]) == [("i", 3)]  # an older generation stops
    assert facts.stale_runners(view, [runner("j", 0, (2, 5))]) == [("j", -1)]  # an instance no longer listed
    assert facts.stale_runners(view, [runner("j", 0, (2, 10))]) == []  # started after this view was made
    assert facts.stale_runners(view, [runner("i", 4, (2, 3))]) == []  # a newer generation than the view's
    placed = rec.model_copy(update={"generation": -1, "phase": "placed"})
    unlaid = view.model_copy(update={"instances": [placed]})
    # Launched before the view saw the layout:
    assert facts.stale_runners(unlaid, [runner("i", 0, (2, 3))]) == []
    starting = view.model_copy(update={"instances": [rec.model_copy(update={"phase": "loading"})]})
    assert facts.stale_runners(starting, [runner("i", 2, (2, 5))]) == []  # may be handed to generation 3
    failed = view.model_copy(update={"instances": [rec.model_copy(update={"phase": "failed"})]})
    assert facts.stale_runners(failed, [runner("i", 3, (2, 5))]) == [("i", -1)]


@pytest.mark.timeout(10)
def test_node_losses_name_the_instances_and_nodes():
    s, _ = fold(cs.ClusterState(me="a"), cs.Alive("a"), cs.Alive("b"))
    stages = [cm.StageRecord(node_id="a", start=0, end=3), cm.StageRecord(node_id="c", start=3, end=6)]
    rec = cm.InstanceRecord(instance="i", model="m", generation=1, phase="ready", stages=stages)
    assert facts.node_losses(s, [rec]) == [("i", 1, "node c left the cluster", {"c"})]
    assert facts.node_losses(s, [rec.model_copy(update={"phase": "failed"})]) == []


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
