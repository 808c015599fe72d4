"""An instance generation's id: the term of the master that launched it, and a count within that term.

An instance controller numbers its generations with it; the term in it keeps two masters' generations (and
so their data-plane keys) apart; people read it as "term.count".
"""

from __future__ import annotations

GENERATION_BITS = 20  # a generation id is (master term << 20) | count: the term is part of its keys


def next_generation(current: int, term: int) -> int:
    """The id of the generation after `current`, launched by a master of `term`.

    Two masters of different terms can never launch the same id (so never the same data-plane keys), and ids
    only grow: a newer term's first generation is above every id of an older term."""
    return max(current + 1, term << GENERATION_BITS)


def generation_term(generation: int) -> int:
    return generation >> GENERATION_BITS if generation > 0 else 0


def generation_label(generation: int) -> str:
    """How people read an id: "term.count" ("3.0" is term 3's first generation); a lone engine's as is."""
    term = generation_term(generation)
    return f"{term}.{generation - (term << GENERATION_BITS)}" if term else str(generation)
