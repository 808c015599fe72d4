"""`shardline bench engine`: the engine against single-process mlx-lm, side by side, on this machine.

Every number is a ratio against a baseline run in the same invocation; raw numbers stand beside them.
Stages are pinned one per core and the baseline to one core, so the comparison is per core of work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from shardline.bench.machine import describe
from shardline.compute import blas
from shardline.engine.engine import Engine, EngineConfig

PREFILL_STEP = 128
PREFILL_CHUNKS = 24
DECODE_TOKENS = 64


def _prompt(n: int, vocab: int, offset: int = 0) -> list[int]:
    # Deterministic, vocabulary-spread ids: speed does not depend on which tokens they are.
    return [(offset + 7919 * i) % (vocab - 1000) + 500 for i in range(n)]


def _baseline(model_dir: Path, prompt: list[int], max_tokens: int) -> dict:
    cmd = [
        sys.executable,
        "-c",
        "import os,sys; os.sched_setaffinity(0,{0}); from shardline.bench.baseline import main; main()",
        str(model_dir),
        json.dumps(prompt),
        str(PREFILL_STEP),
        str(max_tokens),
    ]
    # `-c` shifts argv: baseline reads sys.argv[1:5], which are the four values after "-c CODE".
    out = subprocess.run(
        cmd, env=blas.runner_env(1), capture_output=True, text=True, timeout=900, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"baseline failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _engine(model_dir: Path, stages: int, window: int = 0) -> Engine:
    config = EngineConfig(
        model_dir=model_dir, stages=stages, prefill_step=PREFILL_STEP, window=window, pin_cpus=True
    )
    return Engine(config).start()


def _timed_request(engine: Engine, prompt: list[int], max_tokens: int) -> list[float]:
    start = time.perf_counter()
    stamps = []
    for _ in engine.submit(prompt, max_tokens=max_tokens):
        stamps.append(time.perf_counter() - start)
    return stamps


def _decode_tps(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _activation_bytes(engine: Engine) -> list[int]:
    return [max(0, h.peak_bytes - h.weight_bytes - h.kv_peak_bytes) for h in engine.fresh_heartbeats(30)]


def run(model: str | None, json_path: Path | None, quick: bool = False) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    chunks = 4 if quick else PREFILL_CHUNKS
    decode_tokens = 16 if quick else DECODE_TOKENS
    long_prompt = _prompt(chunks * PREFILL_STEP, vocab)
    short_prompt = _prompt(32, vocab, offset=3)
    raw: dict[str, float] = {}

    print(f"bench engine: {model_dir.name} on {describe()['cpu']} ({describe()['blas']})", file=sys.stderr)
    base_decode = _baseline(model_dir, short_prompt, decode_tokens)
    base_prefill = _baseline(model_dir, long_prompt, 1)
    raw["single_decode_tps"] = _decode_tps(base_decode["stamps"])
    raw["single_prefill_tps"] = len(long_prompt) / base_prefill["stamps"][0]

    with _engine(model_dir, 2) as engine:
        raw["s2_decode_tps"] = _decode_tps(_timed_request(engine, short_prompt, decode_tokens))
        raw["s2_overlap_prefill_tps"] = len(long_prompt) / _timed_request(engine, long_prompt, 1)[0]
        one = _timed_request(engine, short_prompt, decode_tokens)
        raw["s2_1stream_tps"] = _decode_tps(one)
        handles = [engine.submit(_prompt(32, vocab, offset=k), max_tokens=decode_tokens) for k in (5, 9)]
        firsts = []
        for h in handles:
            it = iter(h)
            next(it)
            firsts.append(time.perf_counter())
            list(it)
        end = time.perf_counter()
        # Aggregate decode rate: tokens after each stream's first, over the span both were decoding.
        raw["s2_2stream_tps"] = 2 * (decode_tokens - 1) / (end - min(firsts))

    with _engine(model_dir, 2, window=1) as engine:
        raw["s2_serial_prefill_tps"] = len(long_prompt) / _timed_request(engine, long_prompt, 1)[0]

    mem_short_len = 2 * PREFILL_STEP
    mem = {}
    for name, n in (("short", mem_short_len), ("long", 16 * mem_short_len)):
        with _engine(model_dir, 2) as engine:
            _timed_request(engine, _prompt(n, vocab, offset=11), 1)
            mem[name] = _activation_bytes(engine)
    raw["activation_bytes_short_per_stage"] = mem["short"]  # type: ignore[assignment]
    raw["activation_bytes_long_per_stage"] = mem["long"]  # type: ignore[assignment]

    result = {
        "machine": describe(),
        "model": model_dir.name,
        "prefill_step": PREFILL_STEP,
        "prefill_prompt_tokens": len(long_prompt),
        "decode_ratio_s2_vs_single": raw["s2_decode_tps"] / raw["single_decode_tps"],
        "prefill_ratio_s2_overlap_vs_single": raw["s2_overlap_prefill_tps"] / raw["single_prefill_tps"],
        "prefill_ratio_s2_overlap_vs_s2_serial": raw["s2_overlap_prefill_tps"] / raw["s2_serial_prefill_tps"],
        "activation_mem_ratio_long_vs_short": max(
            lg / max(1, sh) for lg, sh in zip(mem["long"], mem["short"], strict=True)
        ),
        "throughput_ratio_2streams_vs_1": raw["s2_2stream_tps"] / raw["s2_1stream_tps"],
        "raw": raw,
    }
    _print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


TARGETS = {
    "decode_ratio_s2_vs_single": 0.95,
    "prefill_ratio_s2_overlap_vs_single": 1.8,
    "prefill_ratio_s2_overlap_vs_s2_serial": 1.7,
    "activation_mem_ratio_long_vs_short": 1.2,
    "throughput_ratio_2streams_vs_1": 1.6,
}


def _print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']} ({m['device']}), {m['blas']}"
    )
    print(f"model: {result['model']}")
    print(f"{'metric':42} {'ratio':>8} {'target':>8}")
    for key, target in TARGETS.items():
        better = "<=" if key.startswith("activation") else ">="
        print(f"{key:42} {result[key]:8.3f} {better}{target:6.2f}")
    for key, value in result["raw"].items():
        print(f"  {key}: {value if isinstance(value, list) else round(value, 2)}")
