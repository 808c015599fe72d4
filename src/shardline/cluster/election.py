"""Who is master: a deterministic, sticky rule, confirmed by a quorum of an agreed membership per term.

Membership is agreed, not observed. A fresh cluster forms its first membership from the live nodes its first
master's voters saw after the settle time (bootstrap); from then on the membership changes only one node at
a time, proposed by the master in its views and committed once a quorum of both the old and the new
membership hold it (Raft's single-server change, with its up-to-date rule: a voter refuses a candidate whose
membership is older than its own). While a change is pending a candidate needs a quorum of both. Nodes that
shut down cleanly (their report says leaving) are removed by such a change; a node that died stays a member,
and counts against the quorum, until it returns or an operator removes it.

Every node applies the same rule to what it can reach: the sitting master while it lives, else the lowest
live member id. The node the rule names campaigns, only while it sees a quorum of the members alive; it asks
for a term one above every term it knows. A node votes at most once per term (persisted before the vote is
sent), never for a term more than one above what it knows (a hostile or buggy claim cannot jump terms to the
ceiling), and never against a master it still sees alive. A master that cannot reach a quorum of the
members for a lease steps down.

A quorum is a strict majority; exactly half is a quorum only when it holds the lowest member id. Two quorums
of one membership always share a voter, so of an even split exactly one side (the one with the lowest id) can
elect. In a two-node cluster the lower id may act alone; the higher id never can.
"""

from __future__ import annotations

from collections.abc import Iterable

# Terms stay far below what a generation id can hold: a generation is `term << 20` plus a counter
# (instance/generation.py), a signed 64-bit integer in every frame header: 42 + 20 bits leave one spare.
MAX_TERM = 1 << 42


def elect(alive: set[str], master: str | None, term: int) -> tuple[str | None, int]:
    """The master and its term: the sitting one while alive, else the lowest live node id with term + 1."""
    if master is not None and master in alive:
        return master, term
    if not alive:
        return None, term
    return min(alive), term + 1


def quorum(voters: set[str], members: set[str] | frozenset[str]) -> bool:
    """Whether `voters` decide for `members`: a strict majority, or exactly half holding the lowest id."""
    if not members:
        return False
    have = voters & members
    return 2 * len(have) > len(members) or (2 * len(have) == len(members) and min(members) in have)


def quorum_of_all(voters: set[str], electorates: Iterable[frozenset[str]]) -> bool:
    """A quorum of every membership that may be current (two while a change is pending)."""
    es = list(electorates)
    return bool(es) and all(quorum(voters, e) for e in es)


def plausible(term: int, known: int) -> bool:
    """Whether a term may be learned from a peer: within the bound, and at most one above what is known."""
    return 0 <= term <= MAX_TERM and term <= known + 1


def newer(term: int, master: str, than_term: int, than_master: str | None) -> bool:
    """Whether a view (term, master) supersedes the one a node holds. Votes make two masters of one term
    impossible; the id order only settles which of two views of one term a node keeps if that ever fails."""
    if term != than_term:
        return term > than_term
    return than_master is None or master < than_master
