"""What a node keeps across restarts: its term, vote and agreed membership (cluster/state.py `durable`),
in its state directory, written atomically before any vote, claim or view says it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from shardline.cluster import state as cs

log = logging.getLogger("shardline.node")
ELECTION_FILE = "election.json"  # term, vote and agreed membership: a node that restarts keeps its word


def load_election(path: Path, state: cs.ClusterState) -> tuple[cs.ClusterState, dict[str, object]]:
    """The state with the node's term, vote and membership restored from its state directory, and what it
    holds now.

    A file that cannot be read is an error, never silently forgotten: a node that forgets its vote may
    vote twice in one term."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return state, cs.durable(state)  # a fresh node
    try:
        state = cs.restore(state, json.loads(text))
    except (ValueError, TypeError) as exc:
        raise RuntimeError(f"{path}: election state unreadable ({exc}); move it aside to forget it") from exc
    log.info("node %s resumes term %d (voted in %d)", state.me, state.term, state.voted_term)
    return state, cs.durable(state)


def save_election(path: Path, durable: dict[str, object]) -> None:
    """Atomically: a crash leaves the old file or the new one, never a torn one."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(durable, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
