"""`shardline bench arch`: one stream through the stages of six kinds of architecture, against mlx-lm.

Each architecture (dense llama-shaped, sliding window, latent attention, mixture of experts, hybrid
recurrent, soft-capped) is a random model of testing/arch_zoo.py at a size where a decode step is
compute-bound (`SIZES`), written as an mlx-lm model directory; llama also quantized to 4 bits by mlx-lm's
own `quantize_model`, where the fast path's native kernel shows. Each is measured in a process of its own,
pinned to one core with one BLAS thread (bench/engine.py's baseline setting), which holds three things
loaded from the same directory:

- mlx-lm: `load_model`, its model and `make_prompt_cache` stepped as `generate_step` steps them;
- S=1: `load_shard` of every layer, driven as a runner drives its stage (a chunk, `forward`, `mx.eval`);
- S=2: `load_shard` of each half, chained in the same process: the compute of two stages without the hops
  between processes (bench engine measures those).

Each round runs the three prefills in turn (backwards every other round), then the three decodes a token of
each in turn, so that a shared machine's drift and bursts hit each alike; every ratio is taken within a
round, and the median over rounds reported. The path is `shard.path`: the fast path
(llama-shaped blocks in native ops) or the generic one (the model's own forward for a layer range).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardline.bench.machine import describe, run_worker

# The 4-bit variant's group size (mlx-lm's default), and the stage's KV block: the prefill chunk.
GROUP_SIZE = 64
PREFILL_STEP = 128
WORKER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Variant:
    arch: str
    bits: int = 0  # 0: float32 as built

    @property
    def name(self) -> str:
        return f"{self.arch}-q{self.bits}" if self.bits else self.arch


VARIANTS = (
    Variant("llama"),
    Variant("llama", 4),
    Variant("gemma3_text"),
    Variant("deepseek_v3"),
    Variant("qwen3_moe"),
    Variant("qwen3_next"),
    Variant("gemma2"),
)

# Fields set instead of testing/arch_configs.py's COMMON (by name, wherever a ModelArgs has them): hidden
# 768 in 8 layers and a 32k vocabulary, so that a decode step's matmuls outweigh its Python.
SIZES: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "max_position_embeddings": 4096,
    "sliding_window": 64,  # below the prompts: the sliding layers' caches rotate
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
# --quick: the same shapes at a size where a smoke run takes seconds (Python-bound, its ratios mean little).
QUICK_SIZES: dict[str, Any] = {
    **SIZES,
    "vocab_size": 2048,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 16,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}


@dataclass(frozen=True)
class Work:
    decode_prompt: int = 64  # tokens before the timed decode steps
    decode_tokens: int = 32
    # One chunk: mlx's own quantized matmul on CPU (mlx-lm's side of the 4-bit variant) takes ~10 s.
    prefill_prompt: int = 128
    rounds: int = 3
    prefills: int = 3  # per side and round, in turn: a prefill is over in a fraction of a second

    @classmethod
    def quick(cls) -> Work:
        return cls(decode_prompt=16, decode_tokens=8, prefill_prompt=48, rounds=1, prefills=1)


def _prompt(n: int, vocab: int, offset: int = 0) -> list[int]:
    # Deterministic, vocabulary-spread ids (past the byte tokenizer's specials).
    return [(offset + 7919 * i) % (vocab - 3) + 3 for i in range(n)]


class _MlxLm:
    """mlx-lm's side: its model and `make_prompt_cache`, stepped as its `generate_step` steps them (the
    prompt but its last token in chunks that fill the cache, then one step per token, greedy), each step
    evaluated before the next: generate_step's overlap of the next step's graph with this one's compute
    would run into whichever side is timed next (its graph time is reported, `graph_ms`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: list[Any] = []

    def prefill(self, prompt: list[int]) -> int:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        for i in range(0, len(prompt) - 1, PREFILL_STEP):
            self.model(mx.array([prompt[i : min(i + PREFILL_STEP, len(prompt) - 1)]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        return self.step(prompt[-1])[0]

    def step(self, token: int) -> tuple[int, float, float]:
        import mlx.core as mx

        start = time.perf_counter()
        y = mx.argmax(self.model(mx.array([[token]]), cache=self.cache)[:, -1, :], axis=-1)
        built = time.perf_counter()
        out = int(y.item())
        return out, built - start, time.perf_counter() - built


class _Stages:
    """Stages chained in this process, each driven as runner/stage.py drives it (the stage's forward of a
    chunk or a token, then `mx.eval` of what it sends on); the last stage's logits sampled greedily."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards
        self.caches: list[Any] = []

    def prefill(self, prompt: list[int]) -> int:
        import mlx.core as mx

        self.caches = [s.make_cache(PREFILL_STEP) for s in self.shards]
        for i in range(0, len(prompt), PREFILL_STEP):
            token = self._run(mx.array([prompt[i : i + PREFILL_STEP]]))[0]
        return token

    def step(self, token: int) -> tuple[int, float, float]:
        import mlx.core as mx

        return self._run(mx.array([[token]]))

    def _run(self, x: Any) -> tuple[int, float, float]:
        import mlx.core as mx

        graph = run = 0.0
        for shard, cache in zip(self.shards, self.caches, strict=True):
            t0 = time.perf_counter()
            x = shard.forward(x, cache)
            t1 = time.perf_counter()
            mx.eval(x)
            graph, run = graph + t1 - t0, run + time.perf_counter() - t1
        t0 = time.perf_counter()
        if self.shards[-1].head_split:  # a tied head shared with the first stage, which samples
            x = self.shards[0].finish_head(x)
        out = int(mx.argmax(x).item())
        return out, graph, run + time.perf_counter() - t0


Side = _MlxLm | _Stages
STEP_PARTS = ("graph_ms", "eval_ms", "step_ms")


def _round(sides: dict[str, Side], work: Work, vocab: int, r: int) -> dict[str, Any]:
    """One round: each side's prefill in turn (backwards every other round; `prefills` times, the median
    kept), then every side's decode from a prompt of its own, a token of each side in turn (the order
    rotating): a shared machine's drift and bursts hit every side alike. Decode speed: the median step's."""
    names = list(sides) if r % 2 == 0 else list(sides)[::-1]
    prefill = _prompt(work.prefill_prompt, vocab, offset=5 + r)
    figures: dict[str, Any] = {"prefill_tok_s": {}, "decode_tok_s": {}, "decode_step_ms": {}}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(work.prefills):
        for name in names:
            start = time.perf_counter()
            sides[name].prefill(prefill)
            seconds[name].append(time.perf_counter() - start)
    for name, times in seconds.items():
        figures["prefill_tok_s"][name] = len(prefill) / statistics.median(times)
    tokens = {name: sides[name].prefill(_prompt(work.decode_prompt, vocab, offset=1 + r)) for name in names}
    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(work.decode_tokens):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            tokens[name], graph, run = sides[name].step(tokens[name])
            steps[name].append((graph, run))
    for name, times in steps.items():
        total = statistics.median(g + e for g, e in times)
        figures["decode_tok_s"][name] = 1 / total
        figures["decode_step_ms"][name] = {
            "graph_ms": round(1e3 * statistics.median(g for g, _ in times), 3),
            "eval_ms": round(1e3 * statistics.median(e for _, e in times), 3),
            "step_ms": round(1e3 * total, 3),
        }
    return figures


def measure(variant: Variant, sizes: dict[str, Any], work: Work, directory: Path) -> dict[str, Any]:
    """One architecture's figures, in this process: its model written to `directory`, then loaded by
    mlx-lm, as one stage and as two."""
    import gc

    from mlx_lm.utils import load_model, quantize_model

    from shardline.compute.layer_range import split_layers
    from shardline.compute.shard import load_shard
    from shardline.testing import arch_zoo

    started = time.perf_counter()
    model, config = arch_zoo.build(variant.arch, seed=0, sizes=sizes)
    kind = arch_zoo.kind(variant.arch, model)
    if variant.bits:
        model, config = quantize_model(model, config, GROUP_SIZE, variant.bits)
    arch_zoo.save(model, config, directory)
    del model
    gc.collect()
    vocab = int(config.get("vocab_size") or sizes["vocab_size"])
    baseline, _ = load_model(directory)
    total = len(baseline.layers)
    s1 = [load_shard(directory, r) for r in split_layers(total, 1)]
    s2 = [load_shard(directory, r) for r in split_layers(total, 2)]
    loaded = time.perf_counter()
    sides: dict[str, Side] = {"mlx_lm": _MlxLm(baseline), "s1": _Stages(s1), "s2": _Stages(s2)}
    for side in sides.values():  # warm: a prompt chunk, then decode steps
        token = side.prefill(_prompt(16, vocab, offset=3))
        for _ in range(2):
            token = side.step(token)[0]
    rounds = [_round(sides, work, vocab, r) for r in range(work.rounds)]
    figures = {
        key: {side: statistics.median(r[key][side] for r in rounds) for side in sides}
        for key in ("decode_tok_s", "prefill_tok_s")
    }
    ratios: dict[str, Any] = {}
    for key, short in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
        for s in ("s1", "s2"):
            per_round = [r[key][s] / r[key]["mlx_lm"] for r in rounds]
            ratios[f"{short}_ratio_{s}_vs_mlx_lm"] = statistics.median(per_round)
            ratios[f"{short}_ratio_{s}_vs_mlx_lm_range"] = [min(per_round), max(per_round)]
    return {
        "arch": variant.arch,
        "bits": variant.bits,
        "kind": kind,
        "path": s1[0].path,
        "paths_s2": [s.path for s in s2],
        "why_generic": s1[0].why_generic,
        "layers": total,
        "weights_bytes": sum(s.weight_bytes() for s in s1),
        **figures,
        "ratios": ratios,
        # Where a decode step's time goes: building its graph (Python) and evaluating it, per side.
        "decode_step_profile_ms": {
            side: {k: statistics.median(r["decode_step_ms"][side][k] for r in rounds) for k in STEP_PARTS}
            for side in sides
        },
        "rounds": rounds,
        "seconds": {
            "build_and_load": round(loaded - started, 1),
            "measure": round(time.perf_counter() - loaded, 1),
        },
    }


def _worker() -> None:
    """A variant's measurement in this fresh process, pinned to one core: its result as one JSON line."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    args = json.loads(sys.argv[1])
    result = measure(Variant(**args["variant"]), args["sizes"], Work(**args["work"]), Path(args["dir"]))
    print(json.dumps(result), flush=True)


def _measure_in_child(variant: Variant, sizes: dict[str, Any], work: Work, root: Path) -> dict[str, Any]:
    # A fresh process per variant: the runners' BLAS is chosen in the environment before a process starts,
    # and one architecture's memory is gone before the next is built.
    args = {"variant": asdict(variant), "sizes": sizes, "work": asdict(work), "dir": str(root / variant.name)}
    done = run_worker("shardline.bench.arch", args, WORKER_TIMEOUT_S, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"arch": variant.arch, "bits": variant.bits, "error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _minimum(results: dict[str, dict[str, Any]], path: str) -> float | None:
    found = [r["ratios"]["decode_ratio_s1_vs_mlx_lm"] for r in results.values() if r.get("path") == path]
    return min(found) if found else None


def _stamps_tps(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_s2(directory: Path, work: Work) -> dict[str, Any]:
    """S=2 through the engine: two runner processes pinned one per core, with the hops between them. Each
    figure sits between two runs of mlx-lm in a pinned process of its own (bench engine's baseline, A-B-A)
    and is compared with their mean; the prefix cache is off, so that a repeated prompt is computed."""
    from shardline.bench.engine_references import Baseline
    from shardline.engine.engine import Engine, EngineConfig

    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    decode = _prompt(work.decode_prompt, vocab, offset=1)
    prefill = _prompt(work.prefill_prompt, vocab, offset=5)
    config = EngineConfig(
        model_dir=directory, stages=2, prefill_step=PREFILL_STEP, pin_cpus=True, prefix_cache=False
    )
    with Baseline(directory, PREFILL_STEP) as baseline, Engine(config).start() as engine:

        def stages(prompt: list[int], max_tokens: int) -> list[float]:
            start = time.perf_counter()
            return [time.perf_counter() - start for _ in engine.submit(prompt, max_tokens=max_tokens)]

        stages(_prompt(16, vocab, offset=3), 3)  # warm
        around = [_stamps_tps(baseline.run(decode, work.decode_tokens))]
        decode_tps = _stamps_tps(stages(decode, work.decode_tokens))
        around.append(_stamps_tps(baseline.run(decode, work.decode_tokens)))
        single = [len(prefill) / baseline.run(prefill, 1)[0]]
        prefill_tps = len(prefill) / stages(prefill, 1)[0]
        single.append(len(prefill) / baseline.run(prefill, 1)[0])
    return {
        "decode_tok_s": {"mlx_lm": statistics.mean(around), "s2_engine": decode_tps},
        "prefill_tok_s": {"mlx_lm": statistics.mean(single), "s2_engine": prefill_tps},
        "decode_ratio_s2_engine_vs_mlx_lm": decode_tps / statistics.mean(around),
        "prefill_ratio_s2_engine_vs_mlx_lm": prefill_tps / statistics.mean(single),
    }


def run(
    json_path: Path | None,
    quick: bool = False,
    rounds: int | None = None,
    variants: tuple[Variant, ...] = VARIANTS,
    engine: bool = False,
) -> dict[str, Any]:
    work = Work.quick() if quick else Work()
    if rounds is not None:
        work = dataclasses.replace(work, rounds=rounds)
    sizes = QUICK_SIZES if quick else SIZES
    machine = describe()
    print(f"bench arch: {len(variants)} models on {machine['cpu']} ({machine['blas']})", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardline-bench-arch-") as tmp:
        for variant in variants:
            print(f"bench arch: {variant.name}", file=sys.stderr)
            results[variant.name] = _measure_in_child(variant, sizes, work, Path(tmp))
            if engine and "error" not in results[variant.name]:
                try:
                    results[variant.name]["engine"] = engine_s2(Path(tmp) / variant.name, work)
                except Exception as e:  # the in-process figures stand without it
                    results[variant.name]["engine"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    result: dict[str, Any] = {
        "machine": machine,
        "setup": "each architecture in a process of its own pinned to one core, one BLAS thread; mlx-lm "
        "(its model and make_prompt_cache, stepped as generate_step steps them, each step evaluated before "
        "the next) beside load_shard's stages loaded from the same model directory; S=1 one stage of every "
        "layer, S=2 two stages chained in-process (their compute, no hops between processes); prefill chunks "
        f"of {PREFILL_STEP}; each round the three prefills in turn (backwards every other round), then their "
        "decodes a token of each in turn; decode speed from the median step; each ratio taken within a "
        "round, the median of the rounds reported",
        # In-process: the stages' compute against mlx-lm's on one core, interleaved token by token. With
        # --engine, also S=2 through the engine's runner processes (hops included), A-B-A around mlx-lm.
        "s2": "in-process" + (", and the engine (runner processes, one per core)" if engine else ""),
        "sizes": sizes,
        "work": asdict(work),
        "architectures": results,
        "generic_decode_ratio_s1_vs_mlx_lm_min": _minimum(results, "generic"),
        "fast_decode_ratio_s1_vs_mlx_lm_min": _minimum(results, "fast"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    _print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


def _print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']} ({m['device']})")
    print(f"BLAS: {m['blas']}")
    print(f"{result['setup']}; {result['work']}")
    head = ("architecture", "kind", "path", "dec mlx", "dec s1", "dec s2", "s1/mlx", "s2/mlx", "pre mlx")
    print(
        f"{head[0]:<14} {head[1]:<24} {head[2]:<8} {head[3]:>8} {head[4]:>8} {head[5]:>8} {head[6]:>7} "
        f"{head[7]:>7} {head[8]:>8} {'pre s1':>8} {'pre s2':>8} {'s1/mlx':>7} {'s2/mlx':>7}"
    )
    for name, r in result["architectures"].items():
        if "error" in r:
            print(f"{name:<14} error: {r['error']}")
            continue
        d, p, q = r["decode_tok_s"], r["prefill_tok_s"], r["ratios"]
        print(
            f"{name:<14} {r['kind']:<24} {r['path']:<8} {d['mlx_lm']:8.1f} {d['s1']:8.1f} {d['s2']:8.1f} "
            f"{q['decode_ratio_s1_vs_mlx_lm']:7.2f} {q['decode_ratio_s2_vs_mlx_lm']:7.2f} "
            f"{p['mlx_lm']:8.1f} {p['s1']:8.1f} {p['s2']:8.1f} "
            f"{q['prefill_ratio_s1_vs_mlx_lm']:7.2f} {q['prefill_ratio_s2_vs_mlx_lm']:7.2f}"
        )
    for name, r in result["architectures"].items():
        if "decode_step_profile_ms" in r:
            prof = r["decode_step_profile_ms"]
            parts = ", ".join(f"{side} {p['graph_ms']:.2f} + {p['eval_ms']:.2f}" for side, p in prof.items())
            print(f"  {name} decode step ms (graph + eval, median): {parts}")
    for name, r in result["architectures"].items():
        if "engine" in r:
            e = r["engine"]
            if "error" in e:
                print(f"  {name} S=2 engine: {e['error']}")
                continue
            d, p = e["decode_tok_s"], e["prefill_tok_s"]
            print(
                f"  {name} S=2 engine (runner processes, A-B-A): decode {d['s2_engine']:.1f} vs mlx-lm "
                f"{d['mlx_lm']:.1f} ({e['decode_ratio_s2_engine_vs_mlx_lm']:.2f}), prefill "
                f"{p['s2_engine']:.1f} vs {p['mlx_lm']:.1f} ({e['prefill_ratio_s2_engine_vs_mlx_lm']:.2f})"
            )
    for path in ("generic", "fast"):
        value = result[f"{path}_decode_ratio_s1_vs_mlx_lm_min"]
        shown = "n/a" if value is None else f"{value:.3f}"
        print(f"{path}_decode_ratio_s1_vs_mlx_lm_min: {shown}")
