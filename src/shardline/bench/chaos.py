"""`shardline bench chaos`: requests against a pipeline whose stages are killed, stalled and aborted.

Every output is compared with a fault-free run of the same requests (greedy), so "completed" means "completed
with exactly the right tokens", not merely "returned something".
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

from shardline.engine.engine import Engine, EngineConfig
from shardline.errors import RequestError

FAULTS = {"kill": signal.SIGKILL, "stall": signal.SIGSTOP, "abort": signal.SIGABRT}
MAX_TOKENS = 16


def _prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(500, vocab - 500) for _ in range(rng.randint(4, 120))] for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int] | str]:
    handles = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    out: list[list[int] | str] = []
    for h in handles:
        try:
            out.append(h.tokens(timeout=900))
        except (RequestError, TimeoutError) as exc:
            out.append(f"error: {exc}")
    return out


def run(
    model: str | None,
    json_path: Path | None,
    requests: int = 8,
    seed: int = 0,
    stages: int = 2,
    faults_max: int = 4,
) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    prompts = _prompts(rng, requests, vocab)
    base = dict(model_dir=model_dir, stages=stages, prefill_step=64)
    print(f"chaos: {requests} requests on {stages} stages, fault-free reference first", file=sys.stderr)
    with Engine(EngineConfig(**base)).start() as engine:
        reference = _run(engine, prompts)

    config = EngineConfig(
        **base,
        heartbeat_s=0.25,
        heartbeat_timeout=2.0,
        step_deadline_floor=2.0,
        max_restarts=1000,
        backoff_s=0.1,
    )
    faults: list[tuple[float, str, int]] = []
    pids: set[int] = set()
    with Engine(config).start() as engine:
        done = threading.Event()

        def chaos() -> None:
            # Faults land at random moments, each after the rebuilt instance has served a while: a fault rate
            # above the recovery rate would only measure a livelock.
            while len(faults) < faults_max and not done.wait(rng.uniform(2.0, 6.0)):
                if not engine.serving or (engine.recoveries and engine.recoveries[-1].recovered_at is None):
                    continue
                stage = rng.randrange(stages)
                kind = rng.choice(sorted(FAULTS))
                pid = engine.runner_pids()[stage]
                pids.update(engine.all_runner_pids())
                faults.append((time.monotonic(), kind, stage))
                try:
                    os.kill(pid, FAULTS[kind])
                except ProcessLookupError:
                    pass

        thread = threading.Thread(target=chaos, daemon=True)
        thread.start()
        outputs = _run(engine, prompts)
        done.set()
        thread.join()
        recoveries = list(engine.recoveries)
        pids.update(engine.all_runner_pids())
    orphans = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    detect = []
    for rec in recoveries:
        before = [t for t, _, _ in faults if t <= rec.detected_at]
        if before:
            detect.append(rec.detected_at - max(before))
    recover = [r.recovered_at - r.detected_at for r in recoveries if r.recovered_at is not None]
    lost = sum(1 for o in outputs if isinstance(o, str))
    result = {
        "model": model_dir.name,
        "stages": stages,
        "seed": seed,
        "requests_total": requests,
        "requests_completed": requests - lost,
        "requests_lost": lost,
        "outputs_mismatched": sum(
            1 for o, r in zip(outputs, reference, strict=True) if not isinstance(o, str) and o != r
        ),
        "faults_injected": len(faults),
        "faults": [{"kind": k, "stage": s} for _, k, s in faults],
        "recoveries": len(recoveries),
        "detect_s_max": max(detect, default=0.0),
        "recover_s_median": statistics.median(recover) if recover else 0.0,
        "recover_s_max": max(recover, default=0.0),
        "orphan_processes": len(orphans),
    }
    for key, value in result.items():
        if key != "faults":
            print(f"{key:22} {value:.2f}" if isinstance(value, float) else f"{key:22} {value}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result
