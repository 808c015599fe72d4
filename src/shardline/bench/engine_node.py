"""`shardline bench engine`'s node figures: the read bandwidth of the cores a stage runs on, measured in the
same run, and what share of it a decode token uses.

The bandwidth is node/resources.py `stream_bandwidth` (a plain streaming read of 512 MB, far past the caches,
by as many threads as cores: what the memory gives, the ceiling of a decode token's weight reads), in a fresh
process pinned as the stage is (one core with one thread; the node's cores with as many threads), in the
runners' environment."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from shardline.compute import blas
from shardline.engine.engine import Engine

BANDWIDTH_TIMEOUT_S = 300
_READ = (
    "import sys; from shardline.node import resources; print(resources.stream_bandwidth(int(sys.argv[1])))"
)


def node_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def read_bandwidth_gbps(cores: int) -> float:
    """GB/s read on the first `cores` cores with `cores` threads, as a stage pinned there reads."""
    pinned = node_cores()[:cores]

    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, pinned)

    done = subprocess.run(
        [sys.executable, "-c", _READ, str(cores)],
        env=blas.runner_env(cores),
        capture_output=True,
        text=True,
        timeout=BANDWIDTH_TIMEOUT_S,
        check=True,
        preexec_fn=pin,
    )
    return float(done.stdout.strip().splitlines()[-1])


def stage_bytes(engine: Engine) -> tuple[int, int]:
    """The stages' weight bytes held (their heartbeats) and KV bytes per position (their Ready)."""
    weights = sum(h.weight_bytes for h in engine.fresh_heartbeats(30))
    views = engine.controller.state.views
    kv = sum(v.ready.kv_bytes_per_token for v in views if v.ready is not None)
    return weights, kv


def bytes_per_token(raw: dict[str, Any], prefix: str, context: float) -> float:
    """What one decode token reads: every weight of the stage(s) once, and the KV of `context` positions."""
    return raw[f"{prefix}_weight_bytes"] + raw[f"{prefix}_kv_bytes_per_token"] * context


def bandwidth_share(tps: float, nbytes: float, gbps: float) -> float:
    """Bytes read per token x tokens/s over the measured read bandwidth."""
    return nbytes * tps / (gbps * 1e9)
