"""Who is master: a deterministic, sticky rule over live members, confirmed by a quorum of votes per term.

Every node applies the same rule to what it knows: the sitting master while it lives, else the lowest live
node id. The node the rule names campaigns: it asks for votes for a term above every term it has seen or
voted in. A node votes at most once per term, and never against a master it still sees alive. A candidate
becomes master only with votes from a quorum of the members of the newest view it holds, so two nodes cannot
both win one term: two quorums of one membership always share a voter.

A quorum is a strict majority; exactly half is a quorum only when it holds the lowest member id, so of an
even split exactly one side (the one with the lowest id) can elect, deterministically. The price is that in
a two-node cluster only the lower id can become master alone: a stopped peer and a cut link look the same.

Membership is the newest view's live members (or, before any view, the live nodes a node has heard from for
its settle time). Views come from masters, so membership changes with the term; nodes that start apart and
never shared a view are two clusters until they meet, which no vote can prevent.
"""

from __future__ import annotations


def elect(alive: set[str], master: str | None, term: int) -> tuple[str | None, int]:
    """The master and its term: the sitting one while alive, else the lowest live node id with term + 1."""
    if master is not None and master in alive:
        return master, term
    if not alive:
        return None, term
    return min(alive), term + 1


def quorum(voters: set[str], members: set[str]) -> bool:
    """Whether `voters` decide for `members`: a strict majority, or exactly half holding the lowest id."""
    if not members:
        return False
    have = voters & members
    return 2 * len(have) > len(members) or (2 * len(have) == len(members) and min(members) in have)


def newer(term: int, master: str, than_term: int, than_master: str | None) -> bool:
    """Whether a view (term, master) supersedes the one a node holds. Votes make two masters of one term
    impossible; the id order only settles which of two views of one term a node keeps if that ever fails."""
    if term != than_term:
        return term > than_term
    return than_master is None or master < than_master
