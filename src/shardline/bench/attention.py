"""`shardline bench attention`: one prefill chunk's attention, the stock MLX kernel against the runner's.

A runner routes attention through `BoundedAttention`; on CPU every prefill chunk takes its tiled path with
a polynomial exp2 (see `compute.attention`). This measures that path, and the same tiles with MLX's own
exp, against `mx.fast.scaled_dot_product_attention` on the model's head shape, for a chunk of
`prefill_step` queries at several context lengths. Timings alternate between the kernels in each round and
run in one process pinned to one core with one BLAS thread, as a runner's stage does.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from shardline.bench.machine import describe, run_worker

CONTEXTS = (512, 1024, 2048, 3072)
PREFILL_STEP = 128
REPEATS = 5
TIMEOUT_S = 900


def _shapes(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    return {
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads", heads)),
        "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
    }


def measure(shapes: dict[str, int], contexts: list[int], n: int, rounds: int) -> dict:
    """In this process: seconds per call of each kernel at each context, per round, and their max error."""
    import mlx.core as mx

    from shardline.compute.attention import BoundedAttention, score_budget, tiled_causal_attention

    def stock(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):  # type: ignore[no-untyped-def]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    budget = score_budget(n)
    runner = BoundedAttention(stock, budget)
    scale = shapes["head_dim"] ** -0.5
    kernels = {
        "stock": lambda q, k, v: stock(q, k, v, scale=scale, mask="causal"),
        "tiled_exp": lambda q, k, v: tiled_causal_attention(q, k, v, scale, max(64, budget // n)),
        "runner": lambda q, k, v: runner(q, k, v, cache=None, scale=scale, mask="causal"),
    }
    out: dict = {}
    for length in contexts:
        keys = mx.random.split(mx.random.key(length), 3)
        q = mx.random.normal((1, shapes["heads"], n, shapes["head_dim"]), key=keys[0]) * 2.0
        k = mx.random.normal((1, shapes["kv_heads"], length, shapes["head_dim"]), key=keys[1]) * 2.0
        v = mx.random.normal((1, shapes["kv_heads"], length, shapes["head_dim"]), key=keys[2])
        mx.eval(q, k, v)
        want = kernels["stock"](q, k, v)
        errors = {name: float(mx.abs(f(q, k, v) - want).max()) for name, f in kernels.items()}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(rounds):
            for name, f in kernels.items():
                mx.eval(f(q, k, v))  # warm
                samples = []
                for _ in range(REPEATS):
                    start = time.perf_counter()
                    mx.eval(f(q, k, v))
                    samples.append(time.perf_counter() - start)
                times[name].append(statistics.median(samples))
        out[str(length)] = {"seconds": times, "max_abs_error": errors}
    return out


def _worker() -> None:
    import os

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    args = json.loads(sys.argv[1])
    print(json.dumps(measure(args["shapes"], args["contexts"], args["n"], args["rounds"])), flush=True)


def run(model: str | None, json_path: Path | None, rounds: int = 3) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    shapes = _shapes(model_dir)
    args = {"shapes": shapes, "contexts": list(CONTEXTS), "n": PREFILL_STEP, "rounds": rounds}
    machine = describe()
    print(f"bench attention: {model_dir.name} heads on {machine['cpu']} ({machine['blas']})", file=sys.stderr)
    done = run_worker("shardline.bench.attention", args, TIMEOUT_S, check=True)
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    result: dict = {
        "machine": machine,
        "model": model_dir.name,
        "shapes": shapes,
        "chunk_queries": PREFILL_STEP,
        "rounds": rounds,
        "setup": "one process pinned to one core, one BLAS thread; kernels alternate within each round; "
        f"each figure the median of {REPEATS} calls",
        "contexts": {},
    }
    for length, figures in raw.items():
        secs = figures["seconds"]
        speedups = [s / r for s, r in zip(secs["stock"], secs["runner"], strict=True)]
        exact = [s / t for s, t in zip(secs["stock"], secs["tiled_exp"], strict=True)]
        result["contexts"][length] = {
            "stock_ms": round(1000 * statistics.median(secs["stock"]), 2),
            "tiled_exp_ms": round(1000 * statistics.median(secs["tiled_exp"]), 2),
            "runner_ms": round(1000 * statistics.median(secs["runner"]), 2),
            "speedup_runner_vs_stock": statistics.median(speedups),
            "speedup_runner_vs_stock_range": [min(speedups), max(speedups)],
            "speedup_tiled_exp_vs_stock": statistics.median(exact),
            "max_abs_error": figures["max_abs_error"],
        }
    _print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


def _print_table(result: dict) -> None:
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, mlx {m['mlx']} ({m['device']}), {m['blas']}")
    print(f"model heads: {result['shapes']}; {result['chunk_queries']} queries per chunk; {result['setup']}")
    header = ("keys", "stock ms", "tiled ms", "runner ms", "speedup", "range", "error")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 9, 9, 10, 8, 13, 9), strict=True)))
    for length, c in result["contexts"].items():
        lo, hi = c["speedup_runner_vs_stock_range"]
        err = c["max_abs_error"]["runner"]
        print(
            f"{length:>6} {c['stock_ms']:9.2f} {c['tiled_exp_ms']:9.2f} {c['runner_ms']:10.2f} "
            f"{c['speedup_runner_vs_stock']:8.2f} {lo:6.2f}-{hi:<6.2f} {err:9.1e}"
        )
