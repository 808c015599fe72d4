"""The cluster as one node knows it: a fold over liveliness, node reports and master views.

`apply` folds one event in; the decisions are pure functions of the state: `campaign`, `grant` and `count`
(elections, cluster/election.py), `reconfigure` and `forget` (the agreed membership), `durable` and `restore`
(what a node keeps across restarts), `node_losses` (instances whose stages sit on nodes that left),
`stale_runners` (runners a node must kill because the newest view no longer lists their generation),
`capacities` (what placement may use), `expected_digest` and `sources` (what a model's copies must be, and
who holds such a copy).
Shells (node.py, master.py) turn them into effects.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardline.cluster import election
from shardline.cluster import messages as cm
from shardline.cluster.parallelism import ETHERNET_1G, LOOPBACK, LinkFigures
from shardline.cluster.placement import NodeCapacity
from shardline.models.footprint import ModelFootprint

MAX_EVENTS = 200
MAX_DEPARTED = 16  # nodes that left, kept in views as unreachable


@dataclass(frozen=True)
class Alive:
    node: str


@dataclass(frozen=True)
class Gone:
    node: str


@dataclass(frozen=True)
class ReportIn:
    report: cm.NodeReport
    at: float = 0.0  # monotonic arrival time


@dataclass(frozen=True)
class Tick:
    now: float  # monotonic: membership is judged from token presence and report age


@dataclass(frozen=True)
class ViewIn:
    view: cm.ClusterView


Event = Alive | Gone | ReportIn | ViewIn | Tick


@dataclass(frozen=True)
class ClaimIn:
    claim: cm.Claim


@dataclass(frozen=True)
class VoteIn:
    vote: cm.Vote


Ballot = ClaimIn | VoteIn


@dataclass
class Candidacy:
    term: int
    electorates: tuple[frozenset[str], ...]  # it needs a quorum of each
    since: float  # monotonic
    votes: set[str] = field(default_factory=set)


@dataclass
class ClusterState:
    me: str
    lease_s: float = 2.0
    # Membership: a node is alive while its liveliness token is present or its last report is younger than
    # the lease. Either alone can blink (a token re-routed when a peer in between leaves); both gone is a
    # node that left.
    alive: set[str] = field(default_factory=set)
    tokens: set[str] = field(default_factory=set)
    heard: dict[str, float] = field(default_factory=dict)  # node -> arrival of its last report (monotonic)
    reports: dict[str, cm.NodeReport] = field(default_factory=dict)  # live nodes only: no ghosts
    # Nodes that left, with their last report and when (wall clock): shown as unreachable, never placed on.
    departed: dict[str, tuple[cm.NodeReport, float]] = field(default_factory=dict)
    term: int = 0
    master: str | None = None
    view: cm.ClusterView | None = None  # the newest accepted
    events: deque[cm.ClusterEvent] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    # Elections (cluster/election.py): the newest term this node voted in, and for whom; its own campaign.
    # Durable (`durable`/`restore`): a node that restarts must not vote twice in a term.
    voted_term: int = 0
    voted_for: str | None = None
    seen_term: int = 0  # the highest term heard of (claims, reports): the next campaign asks above it
    membership: cm.Membership | None = None  # agreed; None until the first master forms it
    membership_at: tuple[int, int] = (0, 0)  # (term, seq) of the view it came from: older views never undo it
    refused_terms: int = 0  # claims, views, reports and votes dropped for a term out of bounds
    forgotten: set[str] = field(default_factory=set)  # the master's: dead members an operator removes
    candidacy: Candidacy | None = None
    deferred: cm.Claim | None = None  # refused while the sitting master seemed alive: reconsidered each step
    # node -> the time of its newest notice folded in: a notice repeats in its reports, it is logged once
    notice_marks: dict[str, float] = field(default_factory=dict)

    @property
    def is_master(self) -> bool:
        return self.master == self.me

    def instances(self) -> list[cm.InstanceRecord]:
        """The newest records anyone has: the view, or reports of a higher term (a master that died)."""
        best_term, best = (self.view.term, self.view.instances) if self.view else (-1, [])
        for r in self.reports.values():
            if r.term > best_term and r.instances:
                best_term, best = r.term, r.instances
        return list(best)


def apply(state: ClusterState, event: Event, now_wall: float) -> list[cm.ClusterEvent]:
    """Fold one event into the state; returns the cluster events it caused (joins, leaves)."""
    happened: list[cm.ClusterEvent] = []
    if isinstance(event, Alive):
        state.tokens.add(event.node)
        if event.node not in state.alive:
            state.alive.add(event.node)
            state.departed.pop(event.node, None)
            happened.append(cm.ClusterEvent(at=now_wall, kind="join", node=event.node))
    elif isinstance(event, Gone):
        state.tokens.discard(event.node)  # it leaves once its reports stop too (Tick)
    elif isinstance(event, ReportIn):
        r = event.report
        known = r.node_id in state.alive or r.node_id in state.tokens or r.node_id == state.me
        # A report alone makes a node alive (until its lease), not only one whose token this node holds: a
        # token event lost on a link that flapped would otherwise hide a live member for good, and a master
        # would step down for want of a quorum it has. A leaving node's last report brings nothing back.
        if known or not r.leaving:
            state.reports[r.node_id] = r
            state.heard[r.node_id] = max(state.heard.get(r.node_id, 0.0), event.at)
            if r.node_id not in state.alive:
                state.alive.add(r.node_id)
                state.departed.pop(r.node_id, None)
                happened.append(cm.ClusterEvent(at=now_wall, kind="join", node=r.node_id))
            happened += new_notices(state, r)
        if not (0 <= r.term <= election.MAX_TERM and 0 <= r.ballot_term <= election.MAX_TERM):
            state.refused_terms += 1
        else:
            if r.term > state.term and state.master is not None and state.master not in state.alive:
                # A master we never heard of came and went: learn its term, not knowing who it was (a
                # (term, master) pair it never held would outrank that master's own views).
                state.term, state.master = r.term, None
            # A campaign this node missed (or one that failed): the next one asks above it.
            state.seen_term = max(state.seen_term, r.term, r.ballot_term)
    elif isinstance(event, Tick):
        for node in sorted(state.alive):
            fresh = event.now - state.heard.get(node, -1e9) < state.lease_s
            if node != state.me and node not in state.tokens and not fresh:
                state.alive.discard(node)
                last = state.reports.pop(node, None)  # gone: it comes back by joining again, never as a ghost
                if last is not None:
                    state.departed[node] = (last, now_wall)
                    while len(state.departed) > MAX_DEPARTED:
                        del state.departed[min(state.departed, key=lambda n: state.departed[n][1])]
                state.heard.pop(node, None)
                happened.append(cm.ClusterEvent(at=now_wall, kind="leave", node=node))
        happened += _lease(state, now_wall)
    elif isinstance(event, ViewIn):
        v = event.view
        if not 0 <= v.term <= election.MAX_TERM:
            state.refused_terms += 1
        elif election.newer(v.term, v.master, state.term, state.master) or (
            v.term == state.term and v.master == state.master
        ):
            if v.master != state.master:
                happened.append(cm.ClusterEvent(at=now_wall, kind="master", node=v.master))
            state.term, state.master, state.view = v.term, v.master, v
            if state.candidacy is not None and state.candidacy.term <= v.term:
                state.candidacy = None  # someone won this term or a later one
            if v.membership is not None and (v.term, v.seq) >= state.membership_at:
                # The sitting master's membership replaces this node's, a pending change it never saw
                # committed included (as a Raft leader's log overrides a follower's).
                state.membership, state.membership_at = v.membership, (v.term, v.seq)
    state.events.extend(happened)
    return happened


def new_notices(state: ClusterState, report: cm.NodeReport) -> list[cm.ClusterEvent]:
    """The report's notices not folded in yet (a node's notices come in time order), marking them seen."""
    mark = state.notice_marks.get(report.node_id, float("-inf"))
    fresh = sorted((n for n in report.notices if n.at > mark), key=lambda n: n.at)
    if fresh:
        state.notice_marks[report.node_id] = fresh[-1].at
    return fresh


def known_term(state: ClusterState) -> int:
    """The highest term this node knows of: a peer may name at most one above it."""
    return max(state.term, state.voted_term, state.seen_term)


def electorates(state: ClusterState) -> tuple[frozenset[str], ...]:
    """The memberships whose quorums decide: the agreed one, and while a change is pending the one it
    changes too. Before any is agreed (a fresh cluster): the live nodes, as the first master forms it."""
    m = state.membership
    if m is None:
        return (frozenset(state.alive | {state.me}),)
    # A member that said it was leaving (its last report) and is gone shut down, it was not cut off: it
    # abstains until the master's committed removal (`reconfigure`) makes that agreed, or it returns.
    left = frozenset(n for n, (r, _) in state.departed.items() if r.leaving and n not in state.alive)
    if m.committed:
        return (frozenset(m.members) - left or frozenset(m.members),)
    return (
        frozenset(m.base) - left or frozenset(m.base),
        frozenset(m.members) - left or frozenset(m.members),
    )


def members(state: ClusterState) -> frozenset[str]:
    """Every node whose vote may count."""
    return frozenset().union(*electorates(state))


def config_key(m: cm.Membership | None) -> tuple[int, int]:
    return (0, 0) if m is None else m.key()


def _lease(state: ClusterState, now_wall: float) -> list[cm.ClusterEvent]:
    """A master that no longer sees a quorum of the members steps down: it stops placing, removing and
    recovering (the node closes its master role) while the majority side elects its own. Seeing is the
    lease already: a member leaves `alive` once neither its token nor a report came for `lease_s`."""
    if not state.is_master or election.quorum_of_all(state.alive | {state.me}, electorates(state)):
        return []
    state.master = None
    why = f"stepped down in term {state.term}: no quorum of the members for {state.lease_s:g} s"
    return [cm.ClusterEvent(at=now_wall, kind="master", node="", message=why)]


def reconfigure(state: ClusterState) -> bool:
    """The master's membership change, one node at a time; True when the membership changed.

    A pending change commits once a quorum of both memberships hold it (their reports' `config`); one
    inherited from an older term is proposed again in this one first (Raft commits only its own term's
    entries). Else: a member that left cleanly is removed, or a live node that is no member is added."""
    m = state.membership
    if not state.is_master or m is None:
        return False
    if not m.committed:
        if m.term != state.term:
            state.membership = m.model_copy(update={"term": state.term})
            return True
        held = {state.me} | {n for n, r in state.reports.items() if tuple(r.config) == m.key()}
        if election.quorum(held, set(m.base)) and election.quorum(held, set(m.members)):
            state.membership = m.model_copy(update={"committed": True, "base": []})
            return True
        return False
    now = set(m.members)
    state.forgotten &= now - state.alive  # removed already, or back
    leaving = {n for n, (r, _) in state.departed.items() if r.leaving}
    leaving |= {n for n, r in state.reports.items() if r.leaving}
    gone = sorted((now & (leaving | state.forgotten)) - {state.me})
    joined = sorted(
        n for n, r in state.reports.items() if n in state.alive and not r.leaving and n not in now
    )
    if gone:
        new = now - {gone[0]}
    elif joined:
        new = now | {joined[0]}
    else:
        return False
    state.membership = cm.Membership(
        members=sorted(new), version=m.version + 1, term=state.term, committed=False, base=sorted(now)
    )
    return True


def forget(state: ClusterState, node: str) -> str:
    """An operator removes a member that died (the master's `reconfigure` commits it); why not, or ""."""
    m = state.membership
    if not state.is_master or m is None:
        return "this node is not the master"
    if node not in m.members:
        return f"{node} is not a member"
    if node in state.alive or node == state.me:
        return f"{node} is alive: stop it (a clean shutdown leaves the membership by itself)"
    if len(m.members) == 1:
        return "the last member"
    state.forgotten.add(node)
    return ""


def durable(state: ClusterState) -> dict[str, object]:
    """What a node keeps across restarts (written atomically before a vote or claim is sent)."""
    return {
        "term": state.term,
        "voted_term": state.voted_term,
        "voted_for": state.voted_for,
        "seen_term": state.seen_term,
        "membership": None if state.membership is None else state.membership.model_dump(mode="json"),
    }


def restore(state: ClusterState, saved: dict[str, object]) -> None:
    """Reload what `durable` kept; a value out of bounds is refused whole (ValueError)."""
    terms = [saved.get(k, 0) for k in ("term", "voted_term", "seen_term")]
    if not all(isinstance(t, int) and 0 <= t <= election.MAX_TERM for t in terms):
        raise ValueError(f"terms out of bounds: {terms}")
    voted_for = saved.get("voted_for")
    if voted_for is not None and not isinstance(voted_for, str):
        raise ValueError("voted_for is not a node id")
    m = saved.get("membership")
    state.term, state.voted_term, state.seen_term = terms  # type: ignore[assignment]
    state.voted_for = voted_for
    state.membership = None if m is None else cm.Membership.model_validate(m)
    state.membership_at = (0, 0)


def campaign(state: ClusterState, settled: bool, now: float, patience: float) -> cm.Claim | None:
    """A claim to send when the rule names this node (it votes for itself); None otherwise.

    settled: this node has been up long enough to have heard a sitting master (it must not depose one it
    simply has not met yet). A campaign without a quorum after `patience` seconds is given up; the next one
    asks for the same term again unless a higher one was heard of meanwhile (terms rise by one at a change,
    never by a node's own retries). A node that cannot see a quorum of the members does not campaign: it is
    most likely the one cut off.
    """
    if state.candidacy is not None:
        if now - state.candidacy.since < patience:
            return None
        state.candidacy = None
    if not settled or state.is_master:
        return None
    alive, voters = state.alive | {state.me}, electorates(state)
    if not election.quorum_of_all(alive, voters):
        return None
    everyone = frozenset().union(*voters)
    master, _ = election.elect(alive & everyone, state.master, state.term)
    if master != state.me:
        return None
    term = max(state.term, state.seen_term) + 1
    if state.voted_term > term or (state.voted_term == term and state.voted_for != state.me):
        term = state.voted_term + 1
    if term > election.MAX_TERM:
        return None  # the ceiling: an operator must intervene (it cannot be reached by one step at a time)
    state.voted_term, state.voted_for = term, state.me
    state.candidacy = Candidacy(term, voters, now, {state.me})
    return cm.Claim(term=term, candidate=state.me, members=sorted(everyone), membership=state.membership)


def grant(state: ClusterState, claim: cm.Claim) -> cm.Vote | None:
    """This node's vote for a claim, at most one per term; None to refuse."""
    if claim.candidate == state.me:
        return None
    if not election.plausible(claim.term, known_term(state)):
        state.refused_terms += 1
        return None
    state.seen_term = max(state.seen_term, claim.term)
    if claim.term <= state.term:
        return None
    if claim.term < state.voted_term:
        return None  # voted in a later term already
    if claim.term == state.voted_term and state.voted_for != claim.candidate:
        return None  # one vote per term
    if config_key(claim.membership) < config_key(state.membership):
        return None  # its membership is older than this node's: it may not know of a committed change
    if (
        claim.membership is not None
        and claim.candidate not in claim.membership.members + claim.membership.base
    ):
        return None  # not a member of its own membership
    sitting = state.master
    if sitting is not None and sitting != claim.candidate and sitting in state.alive | {state.me}:
        # A master this node still sees is not deposed behind its back; if it is gone once this node's own
        # lease says so, the vote follows (`reconsider`) without waiting for the candidate to ask again.
        if state.deferred is None or claim.term >= state.deferred.term:
            state.deferred = claim
        return None
    state.deferred = None
    state.voted_term, state.voted_for = claim.term, claim.candidate
    if state.candidacy is not None and state.candidacy.term <= claim.term:
        state.candidacy = None
    return cm.Vote(term=claim.term, candidate=claim.candidate, voter=state.me)


def reconsider(state: ClusterState) -> cm.Vote | None:
    """The vote for a claim refused only because the sitting master seemed alive, once it no longer does."""
    claim, state.deferred = state.deferred, None
    return None if claim is None else grant(state, claim)  # still refused for that reason: deferred again


def count(state: ClusterState, vote: cm.Vote | None = None) -> int | None:
    """Fold a vote into this node's campaign; the term it won, once it holds a quorum (it is master then).
    The first master of a fresh cluster forms its membership: the live nodes it asked."""
    c = state.candidacy
    if c is None:
        return None
    if c.term <= state.term:  # a later master was heard of meanwhile (a report): this term is over
        state.candidacy = None
        return None
    if vote is not None and vote.term == c.term and vote.candidate == state.me:
        c.votes.add(vote.voter)
    if not election.quorum_of_all(c.votes, c.electorates):
        return None
    state.candidacy = None
    state.term, state.master = c.term, state.me
    if state.membership is None:
        state.membership = cm.Membership(members=sorted(c.electorates[0]), version=1, term=c.term)
    return c.term


def node_losses(
    state: ClusterState, instances: list[cm.InstanceRecord]
) -> list[tuple[str, int, str, set[str]]]:
    """(instance, generation, why, lost nodes) for every live instance with a stage on a node that left."""
    alive = state.alive | {state.me}
    out = []
    for rec in instances:
        if rec.phase == "failed" or rec.generation < 0:
            continue
        lost = sorted({s.node_id for s in rec.stages if s.node_id not in alive})
        if lost:
            out.append((rec.instance, rec.generation, f"node {', '.join(lost)} left the cluster", set(lost)))
    return out


def stale_runners(view: cm.ClusterView, held: list[cm.RunnerInfo]) -> list[tuple[str, int]]:
    """(instance, generation to keep or -1) for runners the view no longer lists: they must stop.

    A view judges only runners started before it was made: views and commands travel on different keys, so
    a view may arrive after a newer command (its instance or generation not in it yet)."""
    current = {r.instance: r.generation for r in view.instances if r.phase != "failed"}
    settled = {r.instance for r in view.instances if r.phase == "ready"}
    made = (view.term, view.seq)
    doomed, spared = set(), set()
    for r in held:
        listed = r.instance in current
        keep = current.get(r.instance, -1)
        if r.issued >= made or (listed and r.generation > keep):
            # Newer than the view: it cannot judge this instance yet. A listed instance's generation may be
            # older than its runners' (-1 too): a controller's layout reaches views after its launches.
            spared.add(r.instance)
        elif keep >= 0 and r.instance not in settled:
            spared.add(r.instance)  # a new generation is starting: this runner may be handed over to it
        elif r.generation != keep:
            doomed.add((r.instance, keep))
    return sorted(d for d in doomed if d[0] not in spared)


def capacities(state: ClusterState, instance: str | None = None) -> list[NodeCapacity]:
    """What each live node offers placement; memory held by `instance`'s own runners counts as free (a
    re-placement replaces them)."""
    out = []
    for node_id, r in sorted(state.reports.items()):
        # A node whose token is gone is not placed on, even while its lease runs: it is most likely dead.
        if node_id != state.me and (node_id not in state.alive or node_id not in state.tokens):
            continue
        available = r.resources.memory_available
        if instance is not None:
            available += sum(
                _held_bytes(state, instance, info) for info in r.runners if info.instance == instance
            )
        read = r.resources.read_gbps * 1e9
        out.append(NodeCapacity(node_id, max(0, available), max(r.resources.compute_score, 1e-3), read))
    return out


def _held_bytes(state: ClusterState, instance: str, info: cm.RunnerInfo) -> int:
    fp = footprint(state, next((r.model for r in state.instances() if r.instance == instance), ""))
    return sum(fp.layer_bytes[info.start : info.end]) if fp else 0


def footprint(state: ClusterState, model: str) -> ModelFootprint | None:
    for _, r in sorted(state.reports.items()):
        local = r.models.get(model)
        if local is not None and local.footprint is not None:
            return local.footprint
    return None


def _whole_copies(state: ClusterState, model: str) -> dict[str, str]:
    """node -> the model digest of its whole copy of `model`, for live nodes that recorded one."""
    return {
        n: m.digest
        for n, r in sorted(state.reports.items())
        if n in state.alive | {state.me} and (m := r.models.get(model)) and m.full and m.digest
    }


def expected_digest(state: ClusterState, model: str) -> str | None:
    """The digest every copy of `model` must have: the one of this node's (the master's) own whole copy;
    without one, the one every live holder's record agrees on; None while no holder recorded one, or when
    they disagree (nothing is placed on trust: an operator removes the version not wanted).

    A self-reported import time never decides: any key holder could claim the earliest. Reports are
    authenticated where they are received (a key's HMAC, or a node certificate whose name is the report's
    node id: trust/seal.py), so a holder speaks for its own copy only; a peer that lies about its copy
    can at worst block a placement that needs a peer's word, never choose the weights every node loads. An
    instance keeps the digest it was placed with (its record) whatever holders join later."""
    copies = _whole_copies(state, model)
    if state.me in copies:
        return copies[state.me]
    versions = set(copies.values())
    return versions.pop() if len(versions) == 1 else None


def digest_refusal(state: ClusterState, model: str) -> str:
    """Why expected_digest is None, in a sentence for the client."""
    copies = _whole_copies(state, model)
    if not copies:
        return f"model {model!r} has no recorded digests on any live node yet (being hashed): try again soon"
    held = ", ".join(f"{n}: {d[:12]}" for n, d in copies.items())
    return (
        f"the live holders of model {model!r} hold different versions ({held}) and this master holds none: "
        "not placed on any one node's word (remove the version not wanted from its holders)"
    )


def sources(state: ClusterState, model: str, digest: str | None = None) -> list[str]:
    """Live nodes holding the whole model (with `digest`, when given): where a node without it fetches its
    stage. A holder of another version is never a source."""
    return [
        n
        for n, r in sorted(state.reports.items())
        if n in state.alive | {state.me}
        and (m := r.models.get(model))
        and m.full
        and (digest is None or m.digest == digest)
    ]


def link_between(state: ClusterState, node_ids: list[str]) -> tuple[LinkFigures, str]:
    """The link placement assumes between these nodes: the slowest pair as the nodes measured it (each
    reports its round trips to its peers), else what their endpoints suggest, said as an assumption."""
    rtts, rates = [], []
    for a in node_ids:
        r = state.reports.get(a)
        for b in node_ids:
            fact = r.links.get(b) if r is not None and a != b else None
            if fact is not None:
                rtts.append(fact.rtt_us * 1e-6)
                rates.append(fact.bytes_per_s)
    if rtts and len(rtts) >= len(node_ids) - 1:
        return LinkFigures(max(rtts), min(rates)), "measured"
    endpoints = [state.reports[n].endpoint for n in node_ids if n in state.reports]
    hosts = {e.split("/", 1)[-1].rpartition(":")[0] for e in endpoints}
    if hosts and all(h.startswith("127.") or h in ("localhost", "[::1]") for h in hosts):
        return LOOPBACK, "assumed: loopback"
    return ETHERNET_1G, "assumed: gigabit Ethernet (not measured yet)"
