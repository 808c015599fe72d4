"""What `shardline bench engine` measures a stage's memory against: a runner's fixed cost (the runtime
allowance), each stage's weights and KV cache at peak, and the activations beyond them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardline.bench.machine import peak_rss
from shardline.compute import blas
from shardline.engine.engine import Engine

_BARE_RUNNER = (
    "import sys, mlx.core as mx, mlx_lm, zenoh, shardline.runner.stage, shardline.runner.leader; "
    "mx.eval(mx.ones(8) + 1); "
    # With a tokenizer.json: also the constraint engine's tokenizer, which the sampling stage builds at its
    # warm-up and keeps.
    "from shardline.compute.constraints import Matchers; "
    "len(sys.argv) > 1 and Matchers(__import__('pathlib').Path(sys.argv[1])).tokenizer(0); "
    "print([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0])"
)


def runtime_allowance_bytes(tokenizer_json: Path | None = None) -> int:
    """A runner's fixed cost: the peak RSS (VmHWM) of a bare process that imported what a runner imports
    and ran one MLX op, in the runners' environment, and, given the model's tokenizer.json, built the
    constraint engine's tokenizer as the sampling stage does. What a stage's weights and KV cache come on
    top of."""
    done = subprocess.run(
        [sys.executable, "-c", _BARE_RUNNER, *([str(tokenizer_json)] if tokenizer_json else [])],
        env=blas.runner_env(1),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip()) * 1024


def stage_memory(engine: Engine) -> list[dict[str, int]]:
    """Each stage's runner: its peak RSS, its weights and its KV cache at peak (from its heartbeat)."""
    beats = sorted(engine.fresh_heartbeats(30), key=lambda h: h.slot)
    pids = engine.runner_pids()
    return [
        {
            "peak_rss_bytes": peak_rss(pid),
            "weight_bytes": h.weight_bytes,
            "kv_peak_bytes": h.kv_peak_bytes,
            "constraint_tokenizer": int(h.constraint_tokenizer),
        }
        for h, pid in zip(beats, pids, strict=True)
    ]


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("model*.safetensors"))


def activation_bytes(engine: Engine) -> list[int]:
    return [max(0, h.peak_bytes - h.weight_bytes - h.kv_peak_bytes) for h in engine.fresh_heartbeats(30)]


def memory_ratios(
    memory: list[dict[str, int]], allowance: int, with_tokenizer: int
) -> list[dict[str, float]]:
    """Each stage's peak RSS over what it needs: its weights, its KV cache at peak, the runtime allowance
    (the one with the constraint tokenizer for the stage that loaded it)."""
    out = []
    for m in memory:
        fixed = with_tokenizer if m["constraint_tokenizer"] else allowance
        need = m["weight_bytes"] + m["kv_peak_bytes"] + fixed
        out.append({**m, "runtime_allowance_bytes": fixed, "ratio": round(m["peak_rss_bytes"] / need, 3)})
    return out
