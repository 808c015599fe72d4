"""What this process refused from peers (outdated or unauthorised commands, malformed frames), counted by
kind for /metrics and logged once per kind and reason, so a flood cannot fill the log."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("shardline.trust")

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def refuse(what: str, reason: str, detail: str = "") -> None:
    """Count one refusal of `what` (e.g. "start_runner") for `reason` (a short, fixed label)."""
    with _lock:
        _counts[(what, reason)] += 1
        first = _counts[(what, reason)] == 1
    if first:
        log.warning(
            "refused %s (%s)%s; further ones are only counted", what, reason, f": {detail}" if detail else ""
        )


def counts() -> dict[tuple[str, str], int]:
    with _lock:
        return dict(_counts)
