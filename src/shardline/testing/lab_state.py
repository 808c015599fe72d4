"""The state file each lab leaves under /run/shardline-netlab (else /tmp): its owner (pid and process start
time) and subnet, which tell a crashed run's leftovers from a lab a live process still uses, and which
subnets live labs hold."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from shardline.testing.namespaces import NetnsError, start_time_of


def state_dir() -> Path:
    for base in (Path("/run"), Path("/tmp")):
        d = base / "shardline-netlab"
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            return d
        except OSError:
            continue
    raise NetnsError("no writable directory for netlab state files")


def read_state(prefix: str) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir() / f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None


def owner_alive(state: dict[str, Any] | None) -> bool:
    if not state:
        return False
    pid = state.get("pid")
    return isinstance(pid, int) and start_time_of(pid) == state.get("start_time")


def live_subnets() -> set[str]:
    subnets = set()
    with contextlib.suppress(OSError):
        for f in state_dir().glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(f.read_text())
                if owner_alive(state):
                    subnets.add(state.get("subnet"))
    return subnets
