"""Elections and fencing under cuts, heals, deaths, restarts, joins and lost messages: at most one master per
term, and never two masters launching one generation (two rings on one key space).

The nodes run the real decision code (cluster/state.py: the fold `apply`, durable/restore;
cluster/election.py; stale_runners); only the network, the clock and the
runners are simulated. A node that dies keeps what `durable` returns (the node writes it before it sends a
vote or a claim) and comes back from it with `restore`. A master launches a generation of one instance each
time it wins, as `term << 20` (instance/generation.py), and lists it in its views; nodes stop runners the
views no longer list.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.cluster import election, facts
from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.instance.generation import next_generation

PATIENCE = 1.0
LEASE = 2.0
INSTANCE = "i"
RESOURCES = cm.Resources(memory_total=1, memory_available=1, compute_score=1.0, device="cpu", cpus=1)


@dataclass
class Sim:
    """Simulated nodes: a node of group g reaches every up node of group g."""

    states: dict[str, cs.ClusterState]
    group: dict[str, int]
    up: set[str]
    now: float = 0.0
    seq: int = 0
    pending: list[tuple[str, str, object]] = field(default_factory=list)  # (from, to, message)
    winners: dict[int, set[str]] = field(default_factory=dict)  # term -> nodes that became master in it
    launched: dict[int, set[str]] = field(default_factory=dict)  # generation -> masters that launched it
    runners: dict[str, list[cm.RunnerInfo]] = field(default_factory=dict)
    generation: dict[str, int] = field(default_factory=dict)  # per master: the generation it lists

    def reach(self, a: str, b: str) -> bool:
        return a in self.up and b in self.up and self.group[a] == self.group[b]

    def peers(self, a: str) -> set[str]:
        return {b for b in self.states if self.reach(a, b)}

    def send_all(self, src: str, msg: object) -> None:
        self.pending += [(src, dst, msg) for dst in sorted(self.peers(src)) if dst != src]

    def report(self, n: str) -> cm.NodeReport:
        s = self.states[n]
        return cm.NodeReport(
            node_id=n,
            name=n,
            endpoint="",
            started_at=0.0,
            resources=RESOURCES,
            term=s.term,
            config=cs.config_key(s.membership),
            ballot_term=cs.known_term(s),
            runners=self.runners.get(n, []),
        )

    def fold(self, n: str, event: cs.Event) -> list[cs.Effect]:
        self.states[n], effects = cs.apply(self.states[n], event)
        return effects

    def send(self, n: str, effects: list[cs.Effect]) -> None:
        """The ballots among the effects go out; a term won launches and publishes."""
        for fx in effects:
            if isinstance(fx, cs.Send):
                self.send_all(n, fx.ballot)
        self.won(n, next((fx.term for fx in effects if isinstance(fx, cs.Won)), None))

    def won(self, n: str, term: int | None) -> None:
        if term is None:
            return
        self.winners.setdefault(term, set()).add(n)
        listed = self.generation.get(n, -1)
        view = self.states[n].view
        if view is not None:
            listed = max([listed] + [r.generation for r in view.instances])
        gen = next_generation(listed, term)
        self.launched.setdefault(gen, set()).add(n)
        self.generation[n] = gen
        self.seq += 1
        info = cm.RunnerInfo(
            instance=INSTANCE, generation=gen, slot=0, start=0, end=1, issued=(term, self.seq)
        )
        self.runners[n] = [r for r in self.runners.get(n, []) if r.generation != gen] + [info]
        self.publish(n)

    def publish(self, n: str) -> None:
        s = self.states[n]
        self.seq += 1
        nodes = [
            cm.NodeSummary(node_id=m, name=m, endpoint="", alive=m in s.alive | {s.me})
            for m in sorted(self.states)
        ]
        record = cm.InstanceRecord(instance=INSTANCE, model="m", generation=self.generation[n], phase="ready")
        view = cm.ClusterView(
            term=s.term, master=n, seq=self.seq, nodes=nodes, instances=[record], membership=s.membership
        )
        self.see_view(n, view)
        self.send_all(n, view)

    def see_view(self, n: str, view: cm.ClusterView) -> None:
        self.fold(n, cs.ViewIn(view))
        if self.states[n].view is view:  # accepted: fence this node's runners by it, as the node does
            doomed = facts.stale_runners(view, self.runners.get(n, []))
            for instance, keep in doomed:
                self.runners[n] = [
                    r for r in self.runners[n] if r.instance != instance or r.generation == keep
                ]

    def step(self, n: str) -> None:
        if n not in self.up:
            return
        peers = self.peers(n)
        for m in sorted(self.states[n].tokens - peers):
            self.fold(n, cs.Gone(m))
        for m in sorted(peers):
            self.fold(n, cs.Alive(m))
            self.fold(n, cs.ReportIn(self.report(m), self.now))
        self.fold(n, cs.Tick(self.now))
        if not self.states[n].is_master:
            self.generation.pop(n, None)  # stepped down or deposed: it launches nothing more
        # A node that never held a membership waits for a view before it may form one: it joins a cluster.
        settled = self.states[n].membership is not None
        self.send(n, self.fold(n, cs.Campaign(now=self.now, settled=settled, patience=PATIENCE)))
        if self.states[n].is_master:
            self.fold(n, cs.Reconfigure())
            self.publish(n)

    def deliver(self, k: int) -> None:
        src, dst, msg = self.pending.pop(k % len(self.pending))
        if dst not in self.up:
            return  # lost with the node
        if isinstance(msg, cm.Claim):
            for fx in self.fold(dst, cs.ClaimIn(msg)):
                if isinstance(fx, cs.Send) and self.reach(src, dst):
                    self.pending.append((dst, src, fx.ballot))
        elif isinstance(msg, cm.Vote):
            self.send(dst, self.fold(dst, cs.VoteIn(msg)))
        else:
            assert isinstance(msg, cm.ClusterView)
            self.see_view(dst, msg)

    def die(self, n: str) -> None:
        self.up.discard(n)
        self.runners.pop(n, None)  # its runners die with it
        self.generation.pop(n, None)

    def restart(self, n: str) -> None:
        """A node comes back with only what it persisted."""
        if n in self.up:
            return
        saved = cs.durable(self.states[n])
        self.states[n] = cs.restore(cs.ClusterState(me=n, lease_s=LEASE), saved)
        self.up.add(n)

    def join(self, n: str, group: int) -> None:
        self.states[n] = cs.ClusterState(me=n, lease_s=LEASE)
        self.group[n] = group
        self.up.add(n)

    def settle(self, rounds: int) -> None:
        for _ in range(rounds):
            self.now += max(PATIENCE, LEASE) + 0.1
            for n in sorted(self.states):
                self.step(n)
            while self.pending:
                self.deliver(0)

    def check(self) -> None:
        assert all(len(w) == 1 for w in self.winners.values()), self.winners
        assert all(len(m) == 1 for m in self.launched.values()), self.launched


def formed(n: int) -> Sim:
    """A cluster that formed: n0 won term 1 with every node, and every node holds its membership."""
    names = [f"n{i}" for i in range(n)]
    everyone = frozenset(names)
    states = {m: cs.ClusterState(me=m, lease_s=LEASE, alive=everyone, tokens=everyone) for m in names}
    sim = Sim(states, dict.fromkeys(names, 0), set(names))
    effects = sim.fold("n0", cs.Campaign(now=0.0, settled=True, patience=PATIENCE))
    [claim] = [fx.ballot for fx in effects if isinstance(fx, cs.Send)]
    sim.send_all("n0", claim)
    while sim.pending:
        sim.deliver(0)
    assert all(s.master == "n0" and s.term == 1 and s.membership is not None for s in sim.states.values())
    return sim


action = st.one_of(
    st.tuples(st.just("split"), st.lists(st.integers(0, 2), min_size=8, max_size=8)),
    st.tuples(st.just("split"), st.lists(st.integers(0, 1), min_size=8, max_size=8)),
    st.tuples(st.just("step"), st.integers(0, 7)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),
    st.tuples(st.just("deliver"), st.integers(0, 1000)),
    st.tuples(st.just("lose"), st.integers(0, 1000)),
    st.tuples(st.just("time"), st.floats(0.1, 3.0)),
    st.tuples(st.just("round"), st.integers(0, 1000)),
    st.tuples(st.just("round"), st.integers(0, 1000)),
    st.tuples(st.just("round"), st.integers(0, 1000)),
    st.tuples(st.just("die"), st.integers(0, 7)),
    st.tuples(st.just("restart"), st.integers(0, 7)),
    st.tuples(st.just("join"), st.integers(0, 2)),
)


@pytest.mark.timeout(180)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(n=st.integers(3, 6), actions=st.lists(action, min_size=10, max_size=150))
def test_one_master_per_term_and_one_ring_per_generation(n: int, actions: list) -> None:
    sim = formed(n)
    for kind, arg in actions:
        names = sorted(sim.states)
        if kind == "split":
            sim.group = {m: arg[int(m[1:])] for m in names}
        elif kind == "step":
            sim.step(names[arg % len(names)])
        elif kind == "deliver" and sim.pending:
            sim.deliver(arg)
        elif kind == "lose" and sim.pending:
            sim.pending.pop(arg % len(sim.pending))
        elif kind == "time":
            sim.now += arg
        elif kind == "round":  # time passes, every node steps (from a rotating first), messages arrive
            sim.now += 1.1
            for k in range(len(names)):
                sim.step(names[(arg + k) % len(names)])
            for _ in range(len(sim.pending)):
                if sim.pending:
                    sim.deliver(arg)
        elif kind == "die":
            sim.die(names[arg % len(names)])
        elif kind == "restart":
            sim.restart(names[arg % len(names)])
        elif kind == "join" and len(names) < 7:
            sim.join(f"n{len(names)}", arg)
        sim.check()
    # Healed, every node back, every message arriving: one master that every node follows, and one
    # generation left running.
    sim.group = dict.fromkeys(sim.states, 0)
    for m in sorted(sim.states):
        sim.restart(m)
    sim.settle(10)
    sim.check()
    masters = {s.master for s in sim.states.values()}
    assert len(masters) == 1 and masters != {None}, [(s.me, s.term, s.master) for s in sim.states.values()]
    assert sum(s.is_master for s in sim.states.values()) == 1
    live = {r.generation for rs in sim.runners.values() for r in rs}
    assert len(live) == 1, sim.runners


def cut_five() -> Sim:
    """The review's case: five members, master n2, cut {n1, n2} | {n3, n4, n5}."""
    names = ["n1", "n2", "n3", "n4", "n5"]
    everyone = frozenset(names)
    saved = {"term": 0, "membership": {"members": names, "version": 1, "term": 1}}
    states = {  # n2 is the master of term 1 with the membership of all five
        m: cs.restore(cs.ClusterState(me=m, lease_s=LEASE, alive=everyone, tokens=everyone), saved)
        for m in names
    }
    states["n2"] = replace(states["n2"], term=1, master="n2")
    sim = Sim(states, dict.fromkeys(names, 0), set(names))
    sim.won("n2", 1)
    while sim.pending:
        sim.deliver(0)
    assert all(s.master == "n2" for s in sim.states.values())
    return sim


@pytest.mark.timeout(30)
def test_a_cut_off_master_steps_down_and_its_side_never_elects() -> None:
    sim = cut_five()
    sim.group = {"n1": 0, "n2": 0, "n3": 1, "n4": 1, "n5": 1}
    sim.settle(3)
    sim.check()
    assert sim.states["n3"].is_master and sim.states["n3"].term == 2
    assert not sim.states["n2"].is_master  # stepped down: it saw 2 of 5 for a lease
    sim.die("n2")
    sim.settle(3)
    sim.check()
    assert not sim.states["n1"].is_master  # alone: 1 of 5, however its views shrank
    assert sim.winners.get(2) == {"n3"} and max(sim.winners) == 2
    sim.group = dict.fromkeys(sim.states, 0)  # healed; n2 comes back from what it persisted
    sim.restart("n2")
    sim.settle(3)
    sim.check()
    assert {s.master for s in sim.states.values()} == {"n3"}
    assert {r.generation for rs in sim.runners.values() for r in rs} == {2 << 20}


@pytest.mark.timeout(10)
def test_terms_are_bounded_and_rise_one_step_at_a_time() -> None:
    s = cs.ClusterState(me="b")
    for n in ("a", "b", "c"):
        s, _ = cs.apply(s, cs.Alive(n))
    far = cm.Claim(term=1 << 43, candidate="a", members=["a", "b", "c"])
    s, fx = cs.apply(s, cs.ClaimIn(far))
    assert fx == [] and s.seen_term == 0 and s.refused_terms == 1
    s, fx = cs.apply(s, cs.ClaimIn(far.model_copy(update={"term": 5})))
    assert fx == []  # a jump past what b knows
    s, fx = cs.apply(s, cs.ClaimIn(far.model_copy(update={"term": 1})))
    assert len(fx) == 1 and isinstance(fx[0], cs.Send)
    s, _ = cs.apply(s, cs.ViewIn(cm.ClusterView(term=election.MAX_TERM + 1, master="a")))
    assert s.term == 0 and s.view is None and s.refused_terms == 3
    with pytest.raises(ValueError):
        cs.restore(cs.ClusterState(me="x"), {"term": 1 << 50})


@pytest.mark.timeout(10)
def test_a_vote_survives_a_restart() -> None:
    sim = formed(3)
    sim.group = {"n0": 0, "n1": 1, "n2": 1}
    claim = cm.Claim(
        term=2, candidate="n2", members=["n0", "n1", "n2"], membership=sim.states["n2"].membership
    )
    sim.states["n1"] = replace(sim.states["n1"], master=None)  # its lease says n0 is gone
    assert sim.fold("n1", cs.ClaimIn(claim)) != []
    sim.die("n1")
    sim.restart("n1")  # the same term, another candidate: refused from what it persisted
    other = claim.model_copy(update={"candidate": "n0"})
    assert sim.fold("n1", cs.ClaimIn(other)) == []
    assert sim.fold("n1", cs.ClaimIn(claim)) != []  # the same vote again is the same vote


@pytest.mark.timeout(10)
def test_a_voter_refuses_a_candidate_with_an_older_membership() -> None:
    """Raft's up-to-date rule: a node that missed a committed change is not elected by those who hold it."""
    old = cm.Membership(members=["a", "b", "c"], version=1, term=1)
    new = cm.Membership(members=["a", "b", "c", "d"], version=2, term=1)
    v = cs.restore(cs.ClusterState(me="b"), {"term": 1, "membership": new.model_dump(mode="json")})
    for n in ("a", "b", "c", "d"):
        v, _ = cs.apply(v, cs.Alive(n))
    behind = cm.Claim(term=2, candidate="c", members=old.members, membership=old)
    v, fx = cs.apply(v, cs.ClaimIn(behind))
    assert fx == []
    v, fx = cs.apply(v, cs.ClaimIn(behind.model_copy(update={"membership": new})))
    assert fx != []


@pytest.mark.timeout(10)
def test_an_operator_forgets_a_dead_member_by_a_committed_change() -> None:
    sim = formed(3)
    sim.die("n2")
    sim.settle(1)
    assert sim.fold("n0", cs.ForgetNode("n1")) != []  # alive: it is not forgotten (Refused)
    assert sim.fold("n1", cs.ForgetNode("n2")) != []  # not the master
    assert sim.fold("n0", cs.ForgetNode("n2")) == []
    sim.settle(3)
    master = sim.states["n0"]
    assert all(
        s.membership is not None and s.membership.members == ["n0", "n1"] for s in (master, sim.states["n1"])
    )
    assert master.membership is not None and master.membership.committed and master.is_master
