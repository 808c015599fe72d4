"""`shardline bench products`: one weight product per decode shape, GGUF's own blocks against MLX affine.

The shapes of issue 39's table: a 1.5B qwen2's gate/up (8960 x 1536) and down (1536 x 8960) in Q4_K, its
151,936-row head in Q6_K, and the default model's 1536 x 576 and 576 x 1536 in Q4_1. For each, the same
blocks are multiplied two ways, alternating within every round in one process on the same cores: the
native product on the GGUF bytes as stored (`_qmm.gguf_matmul`), and today's import of them, MLX affine
(`models/gguf_quant.to_affine`: exact 4 bits for Q4_K and Q4_1, Q6_K requantized to 8 bits) through
`compute.quantized.quantized_matmul`: the "before". Reported per product: ms (median over rounds of each
round's median call, and the range), GB/s (the bytes of the weights read), the time of 8 rows over 1 row,
and the share of the read bandwidth (node/resources.py `stream_bandwidth`: a plain streaming read by as many
threads) measured in the same process, at 1 thread (one pinned core) and at the node's thread count
(`_qmm.set_threads`, pinned to that many cores).

Weights: Q4_1 quantized by gguf-py from random floats; the K-quants (which gguf-py cannot quantize) as
random blocks with small float16 scales: the speed of a product does not depend on its values.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shardline.bench.machine import describe, run_worker

TIMEOUT_S = 1800
CALL_BUDGET_S = 0.05  # each round's calls of one product take about this long (at least MIN_CALLS)
MIN_CALLS, MAX_CALLS = 3, 400
AFFINE_ROWS_PER_CHUNK = 16384  # to_affine a chunk of rows at a time: Q6_K's float32 detour stays small


@dataclass(frozen=True)
class Shape:
    name: str
    out: int  # N: rows of the weight, outputs of the product
    inp: int  # K
    qtype: str  # GGMLQuantizationType name


SHAPES = (
    Shape("gate/up (1.5B)", 8960, 1536, "Q4_K"),
    Shape("down (1.5B)", 1536, 8960, "Q4_K"),
    Shape("head (1.5B)", 151936, 1536, "Q6_K"),
    Shape("gate/up (default)", 1536, 576, "Q4_1"),
    Shape("down (default)", 576, 1536, "Q4_1"),
)
QUICK_SHAPES = (Shape("tiny", 512, 256, "Q4_K"),)


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """(rows, bytes) of GGUF blocks of `qtype`: gguf-py's quantization of random floats where it has one,
    else random bytes with small finite float16 super-block scales (K-quants: d and dmin in bytes 0-3,
    Q6_K's d in bytes 208-209)."""
    block, size = GGML_QUANT_SIZES[qtype]
    from gguf.quants import quantize

    try:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02, qtype)
    except NotImplementedError:
        pass
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    at, count = (208, 1) if qtype == GGMLQuantizationType.Q6_K else (0, 2)
    scales = (np.abs(rng.standard_normal((n, count))) * 3e-4).astype("<f2")
    blocks[:, at : at + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _prepare(shapes: tuple[Shape, ...], into: Path, seed: int) -> list[dict[str, Any]]:
    """Each shape's GGUF blocks and their affine import, as .npy files in `into` (the workers map them)."""
    from shardline.models.gguf_quant import GROUP, to_affine

    rng = np.random.default_rng(seed)
    out = []
    for k, s in enumerate(shapes):
        qtype = GGMLQuantizationType[s.qtype]
        w = random_blocks(rng, qtype, s.out, s.inp)
        parts = [
            to_affine(w[r : r + AFFINE_ROWS_PER_CHUNK], qtype, (min(AFFINE_ROWS_PER_CHUNK, s.out - r), s.inp))
            for r in range(0, s.out, AFFINE_ROWS_PER_CHUNK)
        ]
        files = {
            "gguf": w,
            "affine_w": np.concatenate([p.weight for p in parts]),
            "affine_scales": np.concatenate([p.scales for p in parts]).astype(np.float32),
            "affine_biases": np.concatenate([p.biases for p in parts]).astype(np.float32),
        }
        for key, array in files.items():
            np.save(into / f"{k}-{key}.npy", array)
        bits = parts[0].bits
        out.append({**asdict(s), "index": k, "qtype_id": int(qtype), "affine_bits": bits, "group": GROUP})
    return out


# ---- the worker: one process per thread count, pinned ----------------------------------------------------


def _time_calls(f: Any, calls: int) -> float:
    import mlx.core as mx

    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(f())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _calls_for(f: Any) -> int:
    import mlx.core as mx

    mx.eval(f())  # warm: pages touched, kernels chosen
    start = time.perf_counter()
    mx.eval(f())
    one = max(time.perf_counter() - start, 1e-6)
    return max(MIN_CALLS, min(MAX_CALLS, math.ceil(CALL_BUDGET_S / one)))


def measure(args: dict[str, Any]) -> dict[str, Any]:
    """In this process (pinned by the caller): read bandwidth, then per shape and rows, each kernel's
    seconds per product in every round, the kernels alternating within a round."""
    from shardline.compute import quantized
    from shardline.node.resources import stream_bandwidth

    threads = int(args["threads"])
    module = quantized.native()
    if module is not None and hasattr(module, "set_threads"):
        module.set_threads(threads)
    gguf_native = module is not None and hasattr(module, "gguf_matmul")
    quick = bool(args["quick"])
    size = (16 << 20) if quick else (512 << 20)
    bandwidth = stream_bandwidth(threads, size)
    into = Path(args["dir"])
    result: dict[str, Any] = {
        "threads": module.threads() if module is not None and hasattr(module, "threads") else 1,
        "read_bandwidth_gbps": bandwidth,
        "gguf_native": gguf_native,
        "isa": module.isa() if module is not None else "mlx",
        "shapes": {},
    }
    for s in args["shapes"]:
        result["shapes"][str(s["index"])] = _measure_shape(module if gguf_native else None, s, into, args)
    # Measured again after the products, the best of both (as stream_bandwidth keeps its best run): a
    # neighbour's load during one of them would otherwise inflate every share.
    again = stream_bandwidth(threads, size)
    result["read_bandwidth_runs_gbps"] = [bandwidth, again]
    result["read_bandwidth_gbps"] = max(bandwidth, again)
    return result


def _measure_shape(module: Any, s: dict[str, Any], into: Path, args: dict[str, Any]) -> dict[str, Any]:
    """One shape: per rows, each kernel's seconds per product in every round (module None: affine only)."""
    import mlx.core as mx

    from shardline.compute import quantized

    def load(key: str) -> mx.array:
        return mx.array(np.load(into / f"{s['index']}-{key}.npy"))

    w = load("gguf")
    aw, scales, biases = load("affine_w"), load("affine_scales"), load("affine_biases")
    mx.eval(w, aw, scales, biases)
    bits, group, qtype = s["affine_bits"], s["group"], s["qtype_id"]
    per_rows: dict[str, Any] = {}
    for rows in args["rows"]:
        x = mx.random.normal((rows, s["inp"]), key=mx.random.key(rows))
        mx.eval(x)
        kernels = {"affine": lambda x=x: quantized.quantized_matmul(x, aw, scales, biases, group, bits)}
        if module is not None:
            kernels["gguf"] = lambda x=x: module.gguf_matmul(x, w, qtype)
        calls = {name: _calls_for(f) for name, f in kernels.items()}
        seconds: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args["rounds"]):
            for name, f in kernels.items():
                seconds[name].append(_time_calls(f, calls[name]))
        error = None
        if module is not None:  # the same blocks: equal but for x's rounding (and Q6_K's 8-bit requantizing)
            a, g = kernels["affine"](), kernels["gguf"]()
            error = float(mx.abs(a - g).max() / mx.maximum(mx.abs(a).max(), 1e-30))
        per_rows[str(rows)] = {"seconds": seconds, "calls": calls, "relative_difference": error}
    return {
        "gguf_bytes": int(w.nbytes),
        "affine_bytes": int(aw.nbytes + scales.nbytes + biases.nbytes),
        "rows": per_rows,
    }


def _worker() -> None:
    args = json.loads(sys.argv[1])
    if hasattr(os, "sched_setaffinity"):  # first: every thread MLX and the pool start inherits it
        os.sched_setaffinity(0, args["cores"])
    print(json.dumps(measure(args)), flush=True)


# ---- the run -------------------------------------------------------------------------------------------


def _summary(seconds: list[float], nbytes: int, bandwidth: float) -> dict[str, Any]:
    ms = [1000 * s for s in seconds]
    median = statistics.median(ms)
    gbps = nbytes / (median / 1000) / 1e9
    return {
        "ms": round(median, 4),
        "ms_range": [round(min(ms), 4), round(max(ms), 4)],
        "gbps": round(gbps, 2),
        "bandwidth_share": round(gbps / bandwidth, 3) if bandwidth > 0 else None,
    }


def _report(raw: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """One shape at one thread count: each kernel's figures per rows, its rows-over-1-row ratios, and the
    native product's speedup over the affine one."""
    out: dict[str, Any] = {}
    nbytes = {"gguf": raw["gguf_bytes"], "affine": raw["affine_bytes"]}
    for kernel in ("gguf", "affine"):
        per = {r: v["seconds"][kernel] for r, v in raw["rows"].items() if kernel in v["seconds"]}
        if not per:
            out[kernel] = {"absent": "this build of the extension has no gguf_matmul (`make native`)"}
            continue
        entry: dict[str, Any] = {"rows": {r: _summary(s, nbytes[kernel], bandwidth) for r, s in per.items()}}
        if "1" in per:
            one = statistics.median(per["1"])
            for r, s in per.items():
                if r != "1":
                    entry[f"rows{r}_over_1"] = round(statistics.median(s) / one, 3)
        out[kernel] = entry
    if "rows" in out["gguf"]:
        out["speedup_gguf_vs_affine"] = {
            r: round(statistics.median(v["seconds"]["affine"]) / statistics.median(v["seconds"]["gguf"]), 3)
            for r, v in raw["rows"].items()
        }
        out["relative_difference"] = {r: v["relative_difference"] for r, v in raw["rows"].items()}
    return out


def run(
    json_path: Path | None = None,
    rows: tuple[int, ...] = (1, 8),
    threads: tuple[int, ...] | None = None,
    rounds: int = 3,
    quick: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    machine = describe()
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    counts = sorted(set(threads or (1, len(cores))))
    if counts[-1] > len(cores):
        raise ValueError(f"{counts[-1]} threads asked, {len(cores)} cores available")
    shapes = QUICK_SHAPES if quick else SHAPES
    rounds = 1 if quick else rounds
    print(f"bench products: {len(shapes)} shapes on {machine['cpu']}, threads {counts}", file=sys.stderr)
    result: dict[str, Any] = {
        "machine": machine,
        "setup": "one process per thread count, pinned to that many cores (_qmm.set_threads); the "
        "GGUF-native and the MLX affine product of the same blocks alternate within each round; each figure "
        f"the median over {rounds} rounds of each round's median call (range: min-max over rounds); GB/s "
        "from the bytes of the weights read; share of the read bandwidth measured in the same process",
        "rounds": rounds,
        "rows": list(rows),
        "threads": counts,
        "read_bandwidth_gbps": {},
        "read_bandwidth_runs_gbps": {},
        "shapes": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-products-") as tmp:
        prepared = _prepare(shapes, Path(tmp), seed)
        raws = {}
        for t in counts:
            args = {
                "dir": tmp,
                "shapes": prepared,
                "rows": list(rows),
                "rounds": rounds,
                "threads": t,
                "cores": cores[:t],
                "quick": quick,
            }
            done = run_worker("shardline.bench.products", args, TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"bench products worker ({t} threads) failed: {done.stderr[-2000:]}")
            raws[t] = json.loads(done.stdout.strip().splitlines()[-1])
            result["read_bandwidth_gbps"][str(t)] = raws[t]["read_bandwidth_gbps"]
            result["read_bandwidth_runs_gbps"][str(t)] = raws[t]["read_bandwidth_runs_gbps"]
            result["isa"] = raws[t]["isa"]
            result["gguf_native"] = raws[t]["gguf_native"]
    for s in prepared:
        k = str(s["index"])
        first = raws[counts[0]]["shapes"][k]
        entry = {
            "name": s["name"],
            "out": s["out"],
            "in": s["inp"],
            "gguf_type": s["qtype"],
            "gguf_bytes": first["gguf_bytes"],
            "affine_bits": s["affine_bits"],
            "affine_bytes": first["affine_bytes"],
            "threads": {
                str(t): _report(raws[t]["shapes"][k], raws[t]["read_bandwidth_gbps"]) for t in counts
            },
        }
        result["shapes"].append(entry)
    print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, mlx {m['mlx']}, kernels {result.get('isa', '?')}")
    bw = ", ".join(f"{t} thread(s) {g} GB/s" for t, g in result["read_bandwidth_gbps"].items())
    print(f"read bandwidth: {bw}")
    rows = [str(r) for r in result["rows"]]
    head = ["threads", "matrix (out x in)", "format", *[f"{r} row ms" for r in rows], "1 row GB/s", "share"]
    head += [f"{r}/1" for r in rows if r != "1"]
    print(" | ".join(head))
    for s in result["shapes"]:
        for t, per in s["threads"].items():
            for kernel, fmt in (("gguf", s["gguf_type"]), ("affine", f"affine{s['affine_bits']}")):
                k = per[kernel]
                label = f"{s['name']} {s['out']}x{s['in']}"
                if "rows" not in k:
                    print(f"{t} | {label} | {fmt} | {k['absent']}")
                    continue
                first = k["rows"].get("1") or next(iter(k["rows"].values()))
                cells = [t, label, fmt]
                for r in rows:
                    v = k["rows"][r]
                    cells.append(f"{v['ms']:.3f} ({v['ms_range'][0]:.3f}-{v['ms_range'][1]:.3f})")
                cells += [f"{first['gbps']:.1f}", f"{first['bandwidth_share'] or 0:.2f}"]
                cells += [f"{k[f'rows{r}_over_1']:.2f}x" for r in rows if r != "1" and f"rows{r}_over_1" in k]
                print(" | ".join(cells))
