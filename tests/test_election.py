"""Elections over partitions and message orders: never two masters in one term, and one master once healed.

The nodes here are the real fold (cluster/state.py: `apply` with ClaimIn, VoteIn, Campaign and ViewIn);
only the network is simulated: hypothesis picks partitions, which node steps, which message arrives
next (in any order; a message across a cut is lost) and how time passes. A master republishes its view with
the members it sees, so membership shrinks and grows as it does in a real cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.cluster import messages as cm
from shardline.cluster import state as cs

PATIENCE = 1.0


@dataclass
class Net:
    states: list[cs.ClusterState]
    group: list[int]  # partition: nodes of one group reach each other
    now: float = 0.0
    pending: list[tuple[int, int, object]] = field(default_factory=list)  # (from, to, message)
    winners: dict[int, set[str]] = field(default_factory=dict)  # term -> nodes that became master in it
    seq: int = 0

    @property
    def n(self) -> int:
        return len(self.states)

    def reach(self, a: int, b: int) -> bool:
        return self.group[a] == self.group[b]

    def send_all(self, src: int, msg: object) -> None:
        # Only across no cut, but delivered whenever: a message may arrive after later ones, or after the
        # network changed again.
        self.pending += [(src, dst, msg) for dst in range(self.n) if dst != src and self.reach(src, dst)]

    def fold(self, i: int, event: cs.Event) -> list[cs.Effect]:
        """Fold an event into node i's state; its ballots go out (across no cut), a term won publishes."""
        self.states[i], effects = cs.apply(self.states[i], event)
        return effects

    def won(self, i: int, effects: list[cs.Effect]) -> None:
        for fx in effects:
            if isinstance(fx, cs.Won):
                self.winners.setdefault(fx.term, set()).add(self.states[i].me)
                self.publish(i)

    def publish(self, i: int) -> None:
        s = self.states[i]
        self.seq += 1
        nodes = [
            cm.NodeSummary(node_id=n, name=n, endpoint="", alive=n in s.alive | {s.me})
            for n in sorted({x.me for x in self.states})
        ]
        view = cm.ClusterView(term=s.term, master=s.me, seq=self.seq, nodes=nodes, membership=s.membership)
        self.fold(i, cs.ViewIn(view))
        self.send_all(i, view)

    def step(self, i: int) -> None:
        seen = frozenset(x.me for j, x in enumerate(self.states) if self.reach(i, j))  # its lease caught up
        self.states[i] = replace(self.states[i], alive=seen, tokens=seen)
        effects = self.fold(i, cs.Campaign(now=self.now, settled=True, patience=PATIENCE))
        for fx in effects:
            if isinstance(fx, cs.Send):
                self.send_all(i, fx.ballot)
        self.won(i, effects)
        if self.states[i].is_master:
            self.publish(i)

    def deliver(self, k: int) -> None:
        src, dst, msg = self.pending.pop(k % len(self.pending))
        if isinstance(msg, cm.Claim):
            for fx in self.fold(dst, cs.ClaimIn(msg)):
                if isinstance(fx, cs.Send) and self.reach(src, dst):
                    self.pending.append((dst, src, fx.ballot))
        elif isinstance(msg, cm.Vote):
            self.won(dst, self.fold(dst, cs.VoteIn(msg)))
        else:
            assert isinstance(msg, cm.ClusterView)
            self.fold(dst, cs.ViewIn(msg))


def formed(n: int) -> Net:
    """A cluster that formed: every node holds the first master's view of all members."""
    everyone = frozenset(f"n{i}" for i in range(n))
    states = [cs.ClusterState(me=f"n{i}", alive=everyone, tokens=everyone) for i in range(n)]
    net = Net(states, [0] * n)
    net.step(0)
    while net.pending:
        net.deliver(0)
    assert all(s.master == "n0" and s.term == 1 for s in net.states)
    return net


action = st.one_of(
    st.tuples(st.just("split"), st.lists(st.integers(0, 2), min_size=5, max_size=5)),
    st.tuples(st.just("step"), st.integers(0, 4)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),
    st.tuples(st.just("time"), st.floats(0.1, 3.0)),
)


@pytest.mark.timeout(120)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 5), actions=st.lists(action, min_size=20, max_size=200))
def test_never_two_masters_in_a_term_and_one_master_once_healed(n: int, actions: list) -> None:
    net = formed(n)
    for kind, arg in actions:
        if kind == "split":
            net.group = list(arg[:n])
        elif kind == "step":
            net.step(arg % n)
        elif kind == "deliver" and net.pending:
            net.deliver(arg)
        elif kind == "time":
            net.now += arg
        assert all(len(w) == 1 for w in net.winners.values()), net.winners
    # Healed, with every message arriving in order: the nodes agree on one master, which knows it is.
    net.group = [0] * n
    for _ in range(8):
        net.now += PATIENCE + 0.1
        for i in range(n):
            net.step(i)
        while net.pending:
            net.deliver(0)
    assert all(len(w) == 1 for w in net.winners.values()), net.winners
    masters = {s.master for s in net.states}
    assert len(masters) == 1 and masters != {None}, [(s.me, s.term, s.master) for s in net.states]
    (master,) = masters
    assert sum(s.is_master for s in net.states) == 1 and master is not None


@pytest.mark.timeout(30)
def test_an_even_split_elects_only_the_side_with_the_lowest_id() -> None:
    net = formed(4)
    net.group = [0, 1, 1, 2]  # n0 cut off alone: n1 and n2 see half of the members without the lowest
    for _ in range(4):
        net.now += PATIENCE + 0.1
        for i in range(4):
            net.step(i)
        while net.pending:
            net.deliver(0)
    assert max(net.winners) == 1  # nobody won a new term
    net.group = [0, 0, 1, 1]  # 2|2 with n0 on one side: only that side may (but need not) elect
    for _ in range(4):
        net.now += PATIENCE + 0.1
        for i in range(4):
            net.step(i)
        while net.pending:
            net.deliver(0)
    assert {m for t, w in net.winners.items() for m in w} <= {"n0", "n1"}
    assert net.states[0].is_master and not any(s.is_master for s in net.states[2:])


def settle(net: Net, rounds: int = 3) -> None:
    for _ in range(rounds):
        net.now += PATIENCE + 0.1
        for i in range(net.n):
            net.step(i)
        while net.pending:
            net.deliver(0)


@pytest.mark.timeout(30)
def test_a_voter_that_moves_between_sides_votes_once_per_term() -> None:
    net = formed(5)
    net.group = [9, 0, 0, 0, 1]  # the master n0 is gone; n1 campaigns with n2 and n3
    for i in (2, 3, 4):
        net.step(i)  # their leases see it gone too
    net.step(1)
    claims = [p for p in net.pending if isinstance(p[2], cm.Claim)]
    for _, dst, msg in claims:
        if dst in (2, 3):  # they vote; the votes never arrive
            assert isinstance(msg, cm.Claim)
            assert any(isinstance(fx, cs.Send) for fx in net.fold(dst, cs.ClaimIn(msg)))
    net.pending.clear()
    net.group = [9, 0, 1, 1, 1]  # n2 and n3 move to n4's side before their votes arrive
    settle(net)
    assert all(len(w) == 1 for w in net.winners.values()), net.winners
    assert 2 not in net.winners or net.winners[2] == {"n1"}  # term 2 was n1's to win or lose, never n2's
