"""Which holders a node tries for a stage's weights, in which order: a pure decision."""

from __future__ import annotations

from collections.abc import Mapping

REFUSED_HOLD_S = 600.0  # a source refused for bad bytes goes last for this long (its disk may be fixed later)


def fetch_order(
    sources: list[str], me: str, refused: Mapping[str, float], now: float, hold_s: float = REFUSED_HOLD_S
) -> list[str]:
    """The master's sources (holders of the expected digest, in its order) without this node; those this node
    refused within `hold_s` go last, the longest ago first. Never dropped: every byte is checked anyway, and a
    holder fixed since is better than no copy."""
    others = list(dict.fromkeys(s for s in sources if s != me))
    recent = {s: at for s, at in refused.items() if now - at < hold_s}
    fresh = [s for s in others if s not in recent]
    return fresh + sorted((s for s in others if s in recent), key=lambda s: (recent[s], s))
