"""`shardline bench tp`: one stream on a tensor-parallel group of 2 against one runner and against a
2-stage pipeline, side by side, on a synthetic llama large enough that compute dominates.

Three engines on the same weights, one runner per core, one BLAS thread each: `single` (1 stage),
`tp2` (1 stage, a group of 2), `pp2` (2 stages). Each round runs single, tp2, pp2, single; the tp2 and
pp2 figures are compared with the mean of the two single runs around them (drift over the minutes a
round takes cancels out). Greedy outputs of tp2 are compared token for token with single's over 8 prompts.
The group's sums are timed inside the face (its heartbeat): per sum, from its own partial ready to the total
sent back, so the figure holds the link, the member's lateness and the add.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import psutil

from shardline.bench.machine import describe
from shardline.engine.engine import Engine, EngineConfig
from shardline.instance.spec import Fault
from shardline.models.synth import SYNTH_INFO_FILE, SynthSpec, weight_sizes, write_synth_model

# ~1.1B parameters: 24 layers of hidden 2048 and MLP 5632 (16 heads, 4 KV heads), 4-bit in groups of 32
# with float32 scales (~910 MB): one decode step reads the weights once, which takes tens of ms on a core.
BENCH_SPEC = SynthSpec(
    layers=24, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, bits=4, dtype="float32"
)
PREFILL_STEP = 256
PROMPT = 512  # prefill: two chunks
DECODE_PROMPT = 32
DECODE_TOKENS = 64  # long enough that a burst of noise on this shared VM moves one round less
CHECK_PROMPTS = 8
CHECK_TOKENS = 16
CHECK_CANDIDATES = 32
NEAR_TIE = 1e-3  # a top-2 logit margin below this is a near tie (logits of a few units, float32 sums)
FAULT_TOKENS = 12
TARGETS = {
    "decode_ratio_tp2_vs_single": ">= 1.6",
    "prefill_ratio_tp2_vs_single": ">= 1.7",
    "decode_ratio_tp2_vs_pp2": ">= 1.5",
    "tp_outputs_mismatched": "= 0",
}


def bench_dir() -> Path:
    """Where bench models live: beside the model cache, never in it (nodes list every model there)."""
    from shardline.models.registry import cache_dir

    return cache_dir().parent / "bench"


def synth_model(spec: SynthSpec, bench: str = "tp") -> Path:
    """The bench's synthetic model, written once into bench_dir() and again only when its spec changes."""
    quant = f"q{spec.bits}-{spec.dtype}" if spec.bits else spec.dtype
    path = bench_dir() / f"synth-{bench}-{spec.layers}l-{spec.hidden}h-{quant}"
    info = path / SYNTH_INFO_FILE
    if not (info.is_file() and json.loads(info.read_text()).get("spec") == asdict(spec)):
        print(f"bench {bench}: writing the synthetic model {path.name}", file=sys.stderr)
        write_synth_model(path, spec, progress=True, overwrite=True)
    return path


def prompt_ids(n: int, vocab: int, offset: int) -> list[int]:
    return [(offset + 7919 * i) % (vocab - 1000) + 500 for i in range(n)]


def timed(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    start = time.perf_counter()
    stamps, tokens = [], []
    for t in engine.submit(prompt, max_tokens=max_tokens):
        stamps.append(time.perf_counter() - start)
        tokens.append(t.token)
    return stamps, tokens


def speeds(engine: Engine, vocab: int) -> dict[str, float]:
    stamps, _ = timed(engine, prompt_ids(DECODE_PROMPT, vocab, 1), DECODE_TOKENS)
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    first, _ = timed(engine, prompt_ids(PROMPT, vocab, 2), 1)
    return {"decode_tps": decode, "prefill_tps": PROMPT / first[0]}


def greedy(engine: Engine, prompt: list[int]) -> tuple[list[int], list[mx.array]]:
    got = list(engine.submit(prompt, max_tokens=CHECK_TOKENS, want_logits=True))
    return [t.token for t in got], [t.logits for t in got]


Greedy = tuple[list[int], list[int], list[mx.array]]  # prompt, tokens, each token's logits


def comparable(engine: Engine, vocab: int) -> list[Greedy]:
    """CHECK_PROMPTS prompts whose greedy text one runner decides by more than NEAR_TIE at every token
    (prompt, tokens, logits): a random-weight model has near ties, where any other order of the same sums
    may pick the other token ("where rounding allows"; the correctness tests ask the same of theirs)."""
    out = []
    for k in range(CHECK_CANDIDATES):
        prompt = prompt_ids(40 + 9 * k, vocab, 100 + k)
        tokens, logits = greedy(engine, prompt)
        margins = [float(mx.subtract(*mx.sort(lg)[-1:-3:-1])) for lg in logits]
        if min(margins) > NEAR_TIE:
            out.append((prompt, tokens, logits))
        if len(out) == CHECK_PROMPTS:
            break
    return out


def compare(engine: Engine, reference: list[Greedy]) -> tuple[int, float]:
    """Prompts whose greedy text differs from one runner's, and the largest logit difference at any
    position before a difference, relative to the largest logit."""
    mismatched, worst = 0, 0.0
    for prompt, tokens, logits in reference:
        got, got_logits = greedy(engine, prompt)
        mismatched += got != tokens
        for a, b, x, y in zip(got, tokens, got_logits, logits, strict=True):
            worst = max(worst, float(mx.abs(x - y).max() / mx.abs(y).max()))
            if a != b:
                break
    return mismatched, worst


def ratio_figures(ratios: dict[str, list[float]]) -> dict:
    """Each ratio's median over the rounds, and their ranges."""
    out: dict = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
    out["ratio_ranges"] = {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()}
    return out


def compared(reference: list[Greedy], engine: str) -> str:
    """What `compare` compared, for the report."""
    return (
        f"{len(reference)} prompts x {CHECK_TOKENS} greedy tokens, {engine} vs single: the first "
        f"{CHECK_PROMPTS} of {CHECK_CANDIDATES} candidates whose every token single decides by a top-2 "
        f"margin above {NEAR_TIE}"
    )


def engine_with(
    model_dir: Path,
    stages: int,
    tp: int,
    faults: dict[int, Fault] | None = None,
    group_kind: Literal["tensor", "expert"] = "tensor",
    **settings: Any,
) -> Engine:
    config = EngineConfig(
        model_dir=model_dir,
        stages=stages,
        tp=tp,
        group_kind=group_kind,
        prefill_step=PREFILL_STEP,
        pin_cpus=True,
        load_timeout=600.0,
        prefix_cache=False,  # every run computes its whole prompt
        faults=faults or {},
        **settings,
    )
    return Engine(config).start()


def stopped_or_gone(pid: int, timeout: float) -> float:
    """When the process stopped or ended (monotonic), polled every few ms: a fault's own moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                return time.monotonic()
        except psutil.NoSuchProcess:
            return time.monotonic()
        time.sleep(0.005)  # the poll period: the figure's resolution
    raise RuntimeError(f"process {pid} never stopped within {timeout:.0f}s")


def detection(
    model_dir: Path,
    vocab: int,
    action: str,
    phase: str,
    expected: list[int],
    group_kind: Literal["tensor", "expert"] = "tensor",
) -> dict:
    """The group's member stops (SIGSTOP) or dies (SIGKILL) inside a step of the prompt's second chunk or
    of its third decode step: seconds until the instance named the failure and until it served again, and
    whether the request's text is the undisturbed one."""
    # Steps the member counted before: the ring's warm-up (2), the prompt's chunks (2), decode steps.
    fault = Fault(phase=phase, action=action, after_steps=3 if phase == "prefill" else 6)
    with engine_with(model_dir, 1, 2, {1: fault}, group_kind) as engine:
        member = engine.runner_pids()[1]
        watch: dict[str, float] = {}
        watcher = threading.Thread(target=lambda: watch.update(t0=stopped_or_gone(member, 600)))
        watcher.start()
        tokens = engine.submit(prompt_ids(PROMPT, vocab, 7), max_tokens=len(expected)).tokens(timeout=900)
        watcher.join(timeout=600)
        if not engine.wait_recovered(1, 300) or "t0" not in watch:
            raise RuntimeError(f"no recovery after {action} of the member in {phase}")
        failure = engine.recoveries[0]
        assert failure.recovered_at is not None
        return {
            "signal": action.upper(),
            "phase": phase,
            "detected_s": round(max(0.0, failure.detected_at - watch["t0"]), 3),  # polled every 5 ms
            "serving_again_s": round(failure.recovered_at - watch["t0"], 2),
            "why": failure.why[:160],
            "text_exact": int(tokens == expected),
        }


def run(json_path: Path | None, rounds: int = 2, spec: SynthSpec = BENCH_SPEC, quick: bool = False) -> dict:
    if quick:  # a smoke run: every code path, a model of seconds
        spec = replace(spec, layers=2, hidden=256, intermediate=704, heads=4, kv_heads=2, vocab=1024)
        rounds = 1
    model_dir = synth_model(spec)
    vocab = spec.vocab
    print(f"bench tp: {model_dir.name} on {describe()['cpu']}", file=sys.stderr)
    raws: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    mismatched, logits_rel = 0, 0.0
    sums: dict[str, tuple[float, float]] = {}
    for r in range(rounds):
        print(f"bench tp: round {r + 1} of {rounds}", file=sys.stderr)
        with engine_with(model_dir, 1, 1) as engine:
            single = [speeds(engine, vocab)]
            if r == 0:
                reference = comparable(engine, vocab)
                fault_text = timed(engine, prompt_ids(PROMPT, vocab, 7), FAULT_TOKENS)[1]
        with engine_with(model_dir, 1, 2) as engine:
            tp2 = speeds(engine, vocab)
            if r == 0:
                mismatched, logits_rel = compare(engine, reference)
            face = engine.fresh_heartbeats(30)[0]
            sums = {"decode": face.sum_us_decode, "chunk": face.sum_us_chunk}
        with engine_with(model_dir, 2, 1) as engine:
            pp2 = speeds(engine, vocab)
        with engine_with(model_dir, 1, 1) as engine:
            single.append(speeds(engine, vocab))
        base = {k: statistics.mean(s[k] for s in single) for k in single[0]}
        for name, figures in (("single", base), ("tp2", tp2), ("pp2", pp2)):
            for k, v in figures.items():
                raws[f"{name}_{k}"].append(v)
        ratios["decode_ratio_tp2_vs_single"].append(tp2["decode_tps"] / base["decode_tps"])
        ratios["prefill_ratio_tp2_vs_single"].append(tp2["prefill_tps"] / base["prefill_tps"])
        ratios["decode_ratio_tp2_vs_pp2"].append(tp2["decode_tps"] / pp2["decode_tps"])
        ratios["prefill_ratio_pp2_vs_single"].append(pp2["prefill_tps"] / base["prefill_tps"])
    sizes = weight_sizes(model_dir)
    result: dict = {
        "machine": describe(),
        "model": model_dir.name,
        "synthetic": asdict(spec),
        "parameters": sizes["parameters"],
        "weight_bytes": sizes["stored_bytes"],
        "rounds": rounds,
        "setup": "engines single (1 runner), tp2 (1 stage, a group of 2), pp2 (2 stages), each runner pinned "
        "to its own core, one BLAS thread; each round single, tp2, pp2, single, tp2 and pp2 over the mean "
        f"of the two single runs; decode: {DECODE_TOKENS} tokens after a {DECODE_PROMPT}-token prompt, one "
        f"stream; prefill: time to first token of a {PROMPT}-token prompt in chunks of {PREFILL_STEP}",
        "targets": TARGETS,
    }
    result.update(ratio_figures(ratios))
    result["tp_outputs_mismatched"] = mismatched
    result["tp_outputs_compared"] = compared(reference, "tp2")
    result["tp_logits_max_rel_diff"] = logits_rel
    result["allreduce_us_p50"], result["allreduce_us_p99"] = (round(x, 1) for x in sums["decode"])
    result["allreduce_chunk_us_p50"], result["allreduce_chunk_us_p99"] = (round(x, 1) for x in sums["chunk"])
    result["allreduce_setup"] = (
        f"per sum of a decode step ({spec.hidden} floats) and of a prefill chunk ({PREFILL_STEP} x "
        f"{spec.hidden}), timed in the face from its partial ready to the total sent: link both ways, the "
        "member's lateness, the add; 2 sums a layer"
    )
    result["raw"] = {k: round(statistics.median(v), 3) for k, v in raws.items()}
    result["member_faults"] = [
        detection(model_dir, vocab, action, phase, fault_text)
        for phase in ("decode", "prefill")
        for action in ("sigstop", "sigkill")
    ]
    print(report(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(r: dict) -> str:
    lines = [f"bench tp: {r['model']} ({r['parameters'] / 1e6:.0f}M parameters) on {r['machine']['cpu']}"]
    for k, target in TARGETS.items():
        lines.append(f"  {k}: {r[k]} (target {target})")
    lines.append(f"  tp_logits_max_rel_diff: {r['tp_logits_max_rel_diff']:.2e} ({r['tp_outputs_compared']})")
    lines.append(f"  decode_ratio tp2 range over rounds: {r['ratio_ranges']['decode_ratio_tp2_vs_single']}")
    lines.append(
        f"  allreduce per sum: decode p50 {r['allreduce_us_p50']} us, p99 {r['allreduce_us_p99']} us; "
        f"prefill chunk p50 {r['allreduce_chunk_us_p50']} us, p99 {r['allreduce_chunk_us_p99']} us"
    )
    raw = r["raw"]
    lines.append(
        f"  tokens/s: single decode {raw['single_decode_tps']:.2f}, tp2 {raw['tp2_decode_tps']:.2f}, "
        f"pp2 {raw['pp2_decode_tps']:.2f}; prefill single {raw['single_prefill_tps']:.1f}, "
        f"tp2 {raw['tp2_prefill_tps']:.1f}, pp2 {raw['pp2_prefill_tps']:.1f}"
    )
    for f in r["member_faults"]:
        lines.append(
            f"  {f['signal']} of the member in {f['phase']}: detected after {f['detected_s']} s, serving "
            f"again after {f['serving_again_s']} s, text exact: {bool(f['text_exact'])} ({f['why']})"
        )
    return "\n".join(lines)
