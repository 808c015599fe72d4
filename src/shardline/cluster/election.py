"""Who is master: a deterministic, sticky rule over live members, with a term that rises at each change.

Every node applies the same rule to what it knows; only the node the rule names claims (by publishing a view
with the new term). Views are ordered by (term, master id): the highest term wins, and of two claims of one
term (two nodes that could not see each other) the lower node id wins. A node obeys the highest it has seen.
"""

from __future__ import annotations


def elect(alive: set[str], master: str | None, term: int) -> tuple[str | None, int]:
    """The master and its term: the sitting one while alive, else the lowest live node id with term + 1."""
    if master is not None and master in alive:
        return master, term
    if not alive:
        return None, term
    return min(alive), term + 1


def newer(term: int, master: str, than_term: int, than_master: str | None) -> bool:
    """Whether a claim (term, master) supersedes the one a node holds."""
    if term != than_term:
        return term > than_term
    return than_master is None or master < than_master
