"""The cluster as one node knows it: a pure fold, `apply(state, event) -> (state, effects)`.

Like cluster/master_state.py and controller/state.py, this holds no thread, lock, clock or socket. The node
loop (node/daemon.py) holds the state and carries out the effects. Events: liveliness (Alive, Gone), node
reports, master views, ballots (ClaimIn, VoteIn), time passing (Tick: leases), the step's election duties
(Campaign: a deferred vote, this node's own claim), the master's membership change (Reconfigure), an
operator's removal of a dead member (ForgetNode) and cluster events from elsewhere to keep (Record). Effects:
cluster events to log (Happened), ballots to send (Send), a term won (Won), a new membership (Reconfigured),
a refusal (Refused). What the node and the master read from the state is in cluster/facts.py.

The state is immutable: each event replaces only the fields it changes (a report replaces one entry of
`reports`), so the master reads a step's state as it is, without a copy. `durable` and `restore` are what a
node keeps across restarts; elections' rules are in cluster/election.py.

Over 500 lines: one fold over one state, whose membership and election halves change the same fields in
one step (a report ends a campaign, a view clears a candidacy, a lease deposes a master); split, they would
import each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from shardline.cluster import election
from shardline.cluster import messages as cm

MAX_EVENTS = 200
MAX_DEPARTED = 16  # nodes that left, kept in views as unreachable


# ---- events --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alive:
    node: str
    wall: float = 0.0  # when it was heard (wall clock): a join is logged at this time


@dataclass(frozen=True)
class Gone:
    node: str


@dataclass(frozen=True)
class ReportIn:
    report: cm.NodeReport
    at: float = 0.0  # monotonic arrival time
    wall: float = 0.0


@dataclass(frozen=True)
class ViewIn:
    view: cm.ClusterView
    wall: float = 0.0


@dataclass(frozen=True)
class ClaimIn:
    claim: cm.Claim


@dataclass(frozen=True)
class VoteIn:
    vote: cm.Vote
    wall: float = 0.0


@dataclass(frozen=True)
class Tick:
    """Time passes: membership is judged from token presence and report age; a master without a quorum
    steps down."""

    now: float  # monotonic
    wall: float = 0.0


@dataclass(frozen=True)
class Campaign:
    """Once a step, after the Tick: a vote deferred for a master that is gone now, and this node's claim
    when the rule names it. settled: it has been up long enough to have heard a sitting master."""

    now: float  # monotonic
    settled: bool
    patience: float  # how long a campaign waits for its votes
    wall: float = 0.0


@dataclass(frozen=True)
class Reconfigure:
    """The master's membership change, one node at a time (only while this node's master role runs)."""


@dataclass(frozen=True)
class ForgetNode:
    """An operator removes a member that died (the master's Reconfigure commits it)."""

    node: str


@dataclass(frozen=True)
class Record:
    """Cluster events that happened elsewhere (the master's log): kept for the views."""

    events: tuple[cm.ClusterEvent, ...]


Event = (
    Alive | Gone | ReportIn | ViewIn | ClaimIn | VoteIn | Tick | Campaign | Reconfigure | ForgetNode | Record
)


# ---- effects -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Happened:
    """A cluster event the fold recorded (a join, a leave, a new master, a node's notice): for the log."""

    event: cm.ClusterEvent


@dataclass(frozen=True)
class Send:
    ballot: cm.Claim | cm.Vote


@dataclass(frozen=True)
class Won:
    """This node holds a quorum of votes: it is master of `term` (its "master" event is recorded)."""

    term: int


@dataclass(frozen=True)
class Reconfigured:
    membership: cm.Membership


@dataclass(frozen=True)
class Refused:
    why: str


Effect = Happened | Send | Won | Reconfigured | Refused


def happened(effects: list[Effect]) -> list[cm.ClusterEvent]:
    return [e.event for e in effects if isinstance(e, Happened)]


# ---- the state -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidacy:
    term: int
    electorates: tuple[frozenset[str], ...]  # it needs a quorum of each
    since: float  # monotonic
    votes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ClusterState:
    me: str
    lease_s: float = 2.0
    # Membership: a node is alive while its liveliness token is present or its last report is younger than
    # the lease. Either alone can blink (a token re-routed when a peer in between leaves); both gone is a
    # node that left.
    alive: frozenset[str] = frozenset()
    tokens: frozenset[str] = frozenset()
    heard: Mapping[str, float] = field(default_factory=dict)  # node -> arrival of its last report (monotonic)
    reports: Mapping[str, cm.NodeReport] = field(default_factory=dict)  # live nodes only: no ghosts
    # Nodes that left, with their last report and when (wall clock): shown as unreachable, never placed on.
    departed: Mapping[str, tuple[cm.NodeReport, float]] = field(default_factory=dict)
    term: int = 0
    master: str | None = None
    view: cm.ClusterView | None = None  # the newest accepted
    events: tuple[cm.ClusterEvent, ...] = ()  # the newest MAX_EVENTS
    # Elections (cluster/election.py): the newest term this node voted in, and for whom; its own campaign.
    # Durable (`durable`/`restore`): a node that restarts must not vote twice in a term.
    voted_term: int = 0
    voted_for: str | None = None
    seen_term: int = 0  # the highest term heard of (claims, reports): the next campaign asks above it
    membership: cm.Membership | None = None  # agreed; None until the first master forms it
    membership_at: tuple[int, int] = (0, 0)  # (term, seq) of the view it came from: older views never undo it
    refused_terms: int = 0  # claims, views, reports and votes dropped for a term out of bounds
    forgotten: frozenset[str] = frozenset()  # the master's: dead members an operator removes
    candidacy: Candidacy | None = None
    deferred: cm.Claim | None = None  # refused while the sitting master seemed alive: reconsidered each step
    # node -> the time of its newest notice folded in: a notice repeats in its reports, it is logged once
    notice_marks: Mapping[str, float] = field(default_factory=dict)

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


# ---- the fold ------------------------------------------------------------------------------------------


def apply(state: ClusterState, event: Event) -> tuple[ClusterState, list[Effect]]:
    """Fold one event in; the effects for the node to carry out. Cluster events are recorded in `events`."""
    if isinstance(event, Alive):
        state, out = _alive(state, event)
    elif isinstance(event, Gone):
        state, out = replace(state, tokens=state.tokens - {event.node}), []  # it leaves once reports stop too
    elif isinstance(event, ReportIn):
        state, out = _report(state, event)
    elif isinstance(event, ViewIn):
        state, out = _view(state, event)
    elif isinstance(event, ClaimIn):
        state, vote = _grant(state, event.claim)
        out = [] if vote is None else [Send(vote)]
    elif isinstance(event, VoteIn):
        state, out = _count(state, event.vote, event.wall)
    elif isinstance(event, Tick):
        state, out = _tick(state, event)
    elif isinstance(event, Campaign):
        state, out = _campaign(state, event)
    elif isinstance(event, Reconfigure):
        state, out = _reconfigure(state)
    elif isinstance(event, ForgetNode):
        state, why = _forget(state, event.node)
        out = [Refused(why)] if why else []
    else:
        return _record(state, list(event.events)), []
    return _record(state, happened(out)), out


def _record(state: ClusterState, events: list[cm.ClusterEvent]) -> ClusterState:
    if not events:
        return state
    return replace(state, events=(*state.events, *events)[-MAX_EVENTS:])


def _joined(state: ClusterState, node: str, wall: float) -> tuple[ClusterState, list[Effect]]:
    departed = {k: v for k, v in state.departed.items() if k != node}
    state = replace(state, alive=state.alive | {node}, departed=departed)
    return state, [Happened(cm.ClusterEvent(at=wall, kind="join", node=node))]


def _alive(state: ClusterState, e: Alive) -> tuple[ClusterState, list[Effect]]:
    if e.node not in state.tokens:
        state = replace(state, tokens=state.tokens | {e.node})
    if e.node in state.alive:
        return state, []
    return _joined(state, e.node, e.wall)


def _report(state: ClusterState, e: ReportIn) -> tuple[ClusterState, list[Effect]]:
    r = e.report
    out: list[Effect] = []
    known = r.node_id in state.alive or r.node_id in state.tokens or r.node_id == state.me
    # A report alone makes a node alive (until its lease), not only one whose token this node holds: a
    # token event lost on a link that flapped would otherwise hide a live member for good, and a master
    # would step down for want of a quorum it has. A leaving node's last report brings nothing back.
    if known or not r.leaving:
        heard = max(state.heard.get(r.node_id, 0.0), e.at)
        state = replace(
            state,
            reports={**state.reports, r.node_id: r},  # one entry replaced: the reports are shared
            heard={**state.heard, r.node_id: heard},
        )
        if r.node_id not in state.alive:
            state, out = _joined(state, r.node_id, e.wall)
        state, notices = _new_notices(state, r)
        out += [Happened(n) for n in notices]
    if not (0 <= r.term <= election.MAX_TERM and 0 <= r.ballot_term <= election.MAX_TERM):
        return replace(state, refused_terms=state.refused_terms + 1), out
    if r.term > state.term and state.master is not None and state.master not in state.alive:
        # A master we never heard of came and went: learn its term, not knowing who it was (a
        # (term, master) pair it never held would outrank that master's own views).
        state = replace(state, term=r.term, master=None)
    # A campaign this node missed (or one that failed): the next one asks above it.
    seen = max(state.seen_term, r.term, r.ballot_term)
    return (state if seen == state.seen_term else replace(state, seen_term=seen)), out


def _new_notices(state: ClusterState, report: cm.NodeReport) -> tuple[ClusterState, list[cm.ClusterEvent]]:
    """The report's notices not folded in yet (a node's notices come in time order), marked seen."""
    mark = state.notice_marks.get(report.node_id, float("-inf"))
    fresh = sorted((n for n in report.notices if n.at > mark), key=lambda n: n.at)
    if fresh:
        state = replace(state, notice_marks={**state.notice_marks, report.node_id: fresh[-1].at})
    return state, fresh


def _tick(state: ClusterState, e: Tick) -> tuple[ClusterState, list[Effect]]:
    out: list[Effect] = []
    for node in sorted(state.alive):
        fresh = e.now - state.heard.get(node, -1e9) < state.lease_s
        if node != state.me and node not in state.tokens and not fresh:
            # Gone: it comes back by joining again, never as a ghost.
            last = state.reports.get(node)
            departed = dict(state.departed)
            if last is not None:
                departed[node] = (last, e.wall)
                while len(departed) > MAX_DEPARTED:
                    del departed[min(departed, key=lambda n: departed[n][1])]
            state = replace(
                state,
                alive=state.alive - {node},
                reports={k: v for k, v in state.reports.items() if k != node},
                heard={k: v for k, v in state.heard.items() if k != node},
                departed=departed,
            )
            out.append(Happened(cm.ClusterEvent(at=e.wall, kind="leave", node=node)))
    state, down = _lease(state, e.wall)
    return state, out + down


def _view(state: ClusterState, e: ViewIn) -> tuple[ClusterState, list[Effect]]:
    v = e.view
    if not 0 <= v.term <= election.MAX_TERM:
        return replace(state, refused_terms=state.refused_terms + 1), []
    if not (
        election.newer(v.term, v.master, state.term, state.master)
        or (v.term == state.term and v.master == state.master)
    ):
        return state, []
    out: list[Effect] = []
    if v.master != state.master:
        out.append(Happened(cm.ClusterEvent(at=e.wall, kind="master", node=v.master)))
    state = replace(state, term=v.term, master=v.master, view=v)
    if state.candidacy is not None and state.candidacy.term <= v.term:
        state = replace(state, candidacy=None)  # someone won this term or a later one
    if v.membership is not None and (v.term, v.seq) >= state.membership_at:
        # The sitting master's membership replaces this node's, a pending change it never saw
        # committed included (as a Raft leader's log overrides a follower's).
        state = replace(state, membership=v.membership, membership_at=(v.term, v.seq))
    return state, out


# ---- elections -----------------------------------------------------------------------------------------


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


def _lease(state: ClusterState, wall: float) -> tuple[ClusterState, list[Effect]]:
    """A master that no longer sees a quorum of the members steps down: it stops placing, removing and
    recovering (the node closes its master role) while the majority side elects its own. Seeing is the
    lease already: a member leaves `alive` once neither its token nor a report came for `lease_s`."""
    if not state.is_master or election.quorum_of_all(state.alive | {state.me}, electorates(state)):
        return state, []
    why = f"stepped down in term {state.term}: no quorum of the members for {state.lease_s:g} s"
    return replace(state, master=None), [
        Happened(cm.ClusterEvent(at=wall, kind="master", node="", message=why))
    ]


def _reconfigure(state: ClusterState) -> tuple[ClusterState, list[Effect]]:
    """The master's membership change, one node at a time.

    A pending change commits once a quorum of both memberships hold it (their reports' `config`); one
    inherited from an older term is proposed again in this one first (Raft commits only its own term's
    entries). Else: a member that left cleanly is removed, or a live node that is no member is added."""
    m = state.membership
    if not state.is_master or m is None:
        return state, []
    new: cm.Membership | None = None
    if not m.committed:
        if m.term != state.term:
            new = m.model_copy(update={"term": state.term})
        else:
            held = {state.me} | {n for n, r in state.reports.items() if tuple(r.config) == m.key()}
            if election.quorum(held, set(m.base)) and election.quorum(held, set(m.members)):
                new = m.model_copy(update={"committed": True, "base": []})
        return (state, []) if new is None else (replace(state, membership=new), [Reconfigured(new)])
    now = set(m.members)
    forgotten = state.forgotten & (now - state.alive)  # removed already, or back
    if forgotten != state.forgotten:
        state = replace(state, forgotten=forgotten)
    leaving = {n for n, (r, _) in state.departed.items() if r.leaving}
    leaving |= {n for n, r in state.reports.items() if r.leaving}
    gone = sorted((now & (leaving | state.forgotten)) - {state.me})
    joined = sorted(
        n for n, r in state.reports.items() if n in state.alive and not r.leaving and n not in now
    )
    if gone:
        members_now = now - {gone[0]}
    elif joined:
        members_now = now | {joined[0]}
    else:
        return state, []
    new = cm.Membership(
        members=sorted(members_now), version=m.version + 1, term=state.term, committed=False, base=sorted(now)
    )
    return replace(state, membership=new), [Reconfigured(new)]


def _forget(state: ClusterState, node: str) -> tuple[ClusterState, str]:
    """An operator removes a member that died (the master's reconfiguration commits it); why not, or ""."""
    m = state.membership
    if not state.is_master or m is None:
        return state, "this node is not the master"
    if node not in m.members:
        return state, f"{node} is not a member"
    if node in state.alive or node == state.me:
        return state, f"{node} is alive: stop it (a clean shutdown leaves the membership by itself)"
    if len(m.members) == 1:
        return state, "the last member"
    return replace(state, forgotten=state.forgotten | {node}), ""


def durable(state: ClusterState) -> dict[str, object]:
    """What a node keeps across restarts (written atomically before a vote or claim is sent)."""
    return {
        "term": state.term,
        "voted_term": state.voted_term,
        "voted_for": state.voted_for,
        "seen_term": state.seen_term,
        "membership": None if state.membership is None else state.membership.model_dump(mode="json"),
    }


def restore(state: ClusterState, saved: dict[str, object]) -> ClusterState:
    """The state with what `durable` kept reloaded; a value out of bounds is refused whole (ValueError)."""
    terms = [saved.get(k, 0) for k in ("term", "voted_term", "seen_term")]
    if not all(isinstance(t, int) and 0 <= t <= election.MAX_TERM for t in terms):
        raise ValueError(f"terms out of bounds: {terms}")
    voted_for = saved.get("voted_for")
    if voted_for is not None and not isinstance(voted_for, str):
        raise ValueError("voted_for is not a node id")
    m = saved.get("membership")
    term, voted_term, seen_term = terms
    return replace(
        state,
        term=term,  # type: ignore[arg-type]
        voted_term=voted_term,  # type: ignore[arg-type]
        seen_term=seen_term,  # type: ignore[arg-type]
        voted_for=voted_for,
        membership=None if m is None else cm.Membership.model_validate(m),
        membership_at=(0, 0),
    )


def _campaign(state: ClusterState, e: Campaign) -> tuple[ClusterState, list[Effect]]:
    out: list[Effect] = []
    state, vote = _reconsider(state)
    if vote is not None:
        out.append(Send(vote))
    state, claim = _claim(state, e.settled, e.now, e.patience)
    if claim is not None:
        out.append(Send(claim))
        state, won = _count(state, None, e.wall)  # a quorum alone: one node, or half with the lowest id
        out += won
    return state, out


def _claim(
    state: ClusterState, settled: bool, now: float, patience: float
) -> tuple[ClusterState, cm.Claim | None]:
    """A claim to send when the rule names this node (it votes for itself); None otherwise.

    settled: this node has been up long enough to have heard a sitting master (it must not depose one it
    simply has not met yet). A campaign without a quorum after `patience` seconds is given up; the next one
    asks for the same term again unless a higher one was heard of meanwhile (terms rise by one at a change,
    never by a node's own retries). A node that cannot see a quorum of the members does not campaign: it is
    most likely the one cut off.
    """
    if state.candidacy is not None:
        if now - state.candidacy.since < patience:
            return state, None
        state = replace(state, candidacy=None)
    if not settled or state.is_master:
        return state, None
    alive, voters = state.alive | {state.me}, electorates(state)
    if not election.quorum_of_all(alive, voters):
        return state, None
    everyone = frozenset().union(*voters)
    master, _ = election.elect(alive & everyone, state.master, state.term)
    if master != state.me:
        return state, None
    term = max(state.term, state.seen_term) + 1
    if state.voted_term > term or (state.voted_term == term and state.voted_for != state.me):
        term = state.voted_term + 1
    if term > election.MAX_TERM:  # the ceiling: an operator must intervene (not reached one step at a time)
        return state, None
    state = replace(
        state,
        voted_term=term,
        voted_for=state.me,
        candidacy=Candidacy(term, voters, now, frozenset({state.me})),
    )
    return state, cm.Claim(
        term=term, candidate=state.me, members=sorted(everyone), membership=state.membership
    )


def _grant(state: ClusterState, claim: cm.Claim) -> tuple[ClusterState, cm.Vote | None]:
    """This node's vote for a claim, at most one per term; None to refuse."""
    if claim.candidate == state.me:
        return state, None
    if not election.plausible(claim.term, known_term(state)):
        return replace(state, refused_terms=state.refused_terms + 1), None
    if claim.term > state.seen_term:
        state = replace(state, seen_term=claim.term)
    if claim.term <= state.term:
        return state, None
    if claim.term < state.voted_term:
        return state, None  # voted in a later term already
    if claim.term == state.voted_term and state.voted_for != claim.candidate:
        return state, None  # one vote per term
    if config_key(claim.membership) < config_key(state.membership):
        return state, None  # its membership is older than this node's: it may not know of a committed change
    if (
        claim.membership is not None
        and claim.candidate not in claim.membership.members + claim.membership.base
    ):
        return state, None  # not a member of its own membership
    sitting = state.master
    if sitting is not None and sitting != claim.candidate and sitting in state.alive | {state.me}:
        # A master this node still sees is not deposed behind its back; if it is gone once this node's own
        # lease says so, the vote follows (`_reconsider`) without waiting for the candidate to ask again.
        if state.deferred is None or claim.term >= state.deferred.term:
            state = replace(state, deferred=claim)
        return state, None
    candidacy = state.candidacy
    if candidacy is not None and candidacy.term <= claim.term:
        candidacy = None
    state = replace(
        state, deferred=None, voted_term=claim.term, voted_for=claim.candidate, candidacy=candidacy
    )
    return state, cm.Vote(term=claim.term, candidate=claim.candidate, voter=state.me)


def _reconsider(state: ClusterState) -> tuple[ClusterState, cm.Vote | None]:
    """The vote for a claim refused only because the sitting master seemed alive, once it no longer does."""
    claim = state.deferred
    if claim is None:
        return state, None
    return _grant(replace(state, deferred=None), claim)  # still refused for that reason: deferred again


def _count(state: ClusterState, vote: cm.Vote | None, wall: float) -> tuple[ClusterState, list[Effect]]:
    """Fold a vote into this node's campaign; Won once it holds a quorum (it is master then). The first
    master of a fresh cluster forms its membership: the live nodes it asked."""
    c = state.candidacy
    if c is None:
        return state, []
    if c.term <= state.term:  # a later master was heard of meanwhile (a report): this term is over
        return replace(state, candidacy=None), []
    if vote is not None and vote.term == c.term and vote.candidate == state.me and vote.voter not in c.votes:
        c = replace(c, votes=c.votes | {vote.voter})
        state = replace(state, candidacy=c)
    if not election.quorum_of_all(c.votes, c.electorates):
        return state, []
    membership = state.membership
    if membership is None:
        membership = cm.Membership(members=sorted(c.electorates[0]), version=1, term=c.term)
    won = cm.ClusterEvent(at=wall, kind="master", node=state.me)
    state = replace(state, candidacy=None, term=c.term, master=state.me, membership=membership)
    return _record(state, [won]), [Won(c.term)]
