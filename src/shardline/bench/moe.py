"""`shardline bench moe`: one MoE model in an expert-parallel group of 2 against one runner and against the
same two runners splitting every expert (tensor parallelism, as mlx-lm and exo split experts), side by side.

A synthetic qwen3_moe-shaped model (random weights, 4-bit) large enough that reading experts dominates a
token. Engines on the same weights, one runner per core: `single` (1 runner), `ep2` (a group of 2, each
member holding half of every layer's experts whole and the attention whole: one sum a MoE layer), `tp2`
(a group of 2, attention by heads and every expert by columns: two sums a layer). Each round runs single,
ep2, tp2, single; ep2 and tp2 are compared with the mean of the two single runs around them. `ep2_routed`
runs the group again with its experts placed by the routing the first ep2 run measured (hot experts spread:
cluster/experts.py), to state what routing-aware placement gains. Greedy outputs of ep2 are compared token
for token with single's, on prompts single decides by more than a near tie at every token.
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
from typing import Any

from shardline.bench import tp as tpb
from shardline.bench.machine import describe
from shardline.cluster.experts import measured_load
from shardline.compute.quantized_experts import measure
from shardline.engine.engine import Engine
from shardline.models.footprint import footprint_from_dir
from shardline.models.synth import SynthSpec, weight_sizes

# ~3.6B parameters: 24 layers of hidden 1024, 64 experts of 768 columns each, 8 of them a token, 16 heads of
# 64 (4 KV heads), 4-bit in groups of 64 with float32 scales: ~2.3 GB, of which a token reads ~0.3 GB.
BENCH_SPEC = SynthSpec(
    arch="qwen3_moe",
    layers=24,
    hidden=1024,
    intermediate=2816,
    heads=16,
    kv_heads=4,
    vocab=32000,
    bits=4,
    group_size=64,
    dtype="float32",
    experts=64,
    active=8,
    moe_intermediate=768,
)
STREAMS = 8
STREAM_TOKENS = 32
TARGETS = {
    "decode_ratio_ep2_vs_single": ">= 1.6",
    "decode_ratio_ep2_vs_tp2_experts": ">= 1.2",
    "prefill_ratio_ep2_vs_single": ">= 1.6",
    "moe_outputs_mismatched": "= 0",
    "expert_bytes_per_member_vs_half": "within 10% of 1.0",
}


def _throughput(engine: Engine, vocab: int) -> float:
    """Tokens a second of STREAMS streams decoding together (after their prompts)."""
    handles = [
        engine.submit(tpb.prompt_ids(24, vocab, 300 + k), max_tokens=STREAM_TOKENS) for k in range(STREAMS)
    ]
    start = time.perf_counter()
    done: list[int] = []
    lock = threading.Lock()

    def drain(h: Any) -> None:
        n = len(h.tokens(timeout=900))
        with lock:
            done.append(n)

    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    return sum(done) / (time.perf_counter() - start)


def _measure(engine: Engine, vocab: int) -> dict[str, float]:
    out = tpb.speeds(engine, vocab)
    out["streams_tps"] = _throughput(engine, vocab)
    return out


def _routed(engine: Engine) -> list[list[float]]:
    """Tokens routed to each expert of each model layer, from the group's faces' heartbeats."""
    assert engine.controller is not None
    views = engine.controller.state.views
    beats = engine.fresh_heartbeats(30)
    return measured_load([(views[b.slot].ready.layers[0], b.routed) for b in beats if b.routed])


def _expert_bytes(engine: Engine) -> list[int]:
    assert engine.controller is not None
    return [v.ready.expert_bytes for v in engine.controller.state.views if v.ready is not None]


def run(json_path: Path | None, rounds: int = 2, spec: SynthSpec = BENCH_SPEC, quick: bool = False) -> dict:
    if quick:  # a smoke run: every code path, a model of seconds
        spec = replace(
            spec,
            layers=2,
            hidden=256,
            heads=4,
            kv_heads=2,
            vocab=1024,
            experts=8,
            active=2,
            moe_intermediate=256,
            intermediate=512,
        )
        rounds = 1
    model_dir = tpb.synth_model(spec, "moe")
    vocab = spec.vocab
    fp = footprint_from_dir(model_dir)
    print(f"bench moe: {model_dir.name} on {describe()['cpu']}", file=sys.stderr)
    raws: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    mismatched, logits_rel = 0, 0.0
    held: list[int] = []
    load: list[list[float]] = []
    sums: dict[str, tuple[float, float]] = {}
    for r in range(rounds):
        print(f"bench moe: round {r + 1} of {rounds}", file=sys.stderr)
        with tpb.engine_with(model_dir, 1, 1) as engine:
            single = [_measure(engine, vocab)]
            if r == 0:
                reference = tpb.comparable(engine, vocab)
                fault_text = tpb.timed(engine, tpb.prompt_ids(tpb.PROMPT, vocab, 7), tpb.FAULT_TOKENS)[1]
        with tpb.engine_with(model_dir, 1, 2, group_kind="expert") as engine:
            ep2 = _measure(engine, vocab)
            if r == 0:
                mismatched, logits_rel = tpb.compare(engine, reference)
                held = _expert_bytes(engine)
            load = _routed(engine)
            face = engine.fresh_heartbeats(30)[0]
            sums = {"decode": face.sum_us_decode, "chunk": face.sum_us_chunk}
        with tpb.engine_with(model_dir, 1, 2, group_kind="expert", expert_heads=True) as engine:
            heads = _measure(engine, vocab)
        with tpb.engine_with(model_dir, 1, 2, group_kind="expert", expert_load=load) as engine:
            routed = _measure(engine, vocab)
        with tpb.engine_with(model_dir, 1, 2, group_kind="tensor") as engine:
            tp2 = _measure(engine, vocab)
        with tpb.engine_with(model_dir, 1, 1) as engine:
            single.append(_measure(engine, vocab))
        base = {k: statistics.mean(s[k] for s in single) for k in single[0]}
        runs = (("single", base), ("ep2", ep2), ("ep2_heads", heads), ("ep2_routed", routed), ("tp2", tp2))
        for name, figures in runs:
            for k, v in figures.items():
                raws[f"{name}_{k}"].append(v)
        ratios["decode_ratio_ep2_vs_single"].append(ep2["decode_tps"] / base["decode_tps"])
        ratios["decode_ratio_ep2_vs_tp2_experts"].append(ep2["decode_tps"] / tp2["decode_tps"])
        ratios["prefill_ratio_ep2_vs_single"].append(ep2["prefill_tps"] / base["prefill_tps"])
        ratios["throughput_ratio_8streams_ep2_vs_single"].append(ep2["streams_tps"] / base["streams_tps"])
        ratios["decode_ratio_tp2_experts_vs_single"].append(tp2["decode_tps"] / base["decode_tps"])
        ratios["decode_ratio_ep2_routed_vs_ep2"].append(routed["decode_tps"] / ep2["decode_tps"])
        ratios["decode_ratio_ep2_heads_vs_ep2"].append(heads["decode_tps"] / ep2["decode_tps"])
        ratios["prefill_ratio_ep2_heads_vs_ep2"].append(heads["prefill_tps"] / ep2["prefill_tps"])
        ratios["throughput_ratio_ep2_routed_vs_ep2"].append(routed["streams_tps"] / ep2["streams_tps"])
    sizes = weight_sizes(model_dir)
    experts_total = sum(fp.expert_bytes)
    result: dict = {
        "machine": describe(),
        "model": model_dir.name,
        "synthetic": asdict(spec),
        "parameters": sizes["parameters"],
        "weight_bytes": sizes["stored_bytes"],
        "expert_bytes": experts_total,
        "rounds": rounds,
        "setup": "engines single (1 runner), ep2 (1 stage, an expert group of 2, attention whole on each "
        "member), ep2_heads (the same with attention split by heads), ep2_routed (ep2 with its experts "
        "placed by the routing ep2 measured), tp2 (1 stage, a tensor group of 2 splitting every "
        "expert by columns), each runner pinned to its own core, one BLAS thread; each round single, ep2, "
        "ep2_heads, ep2_routed, tp2, single, the groups over the mean of the two single runs; decode: "
        f"{tpb.DECODE_TOKENS} tokens after a {tpb.DECODE_PROMPT}-token prompt, one stream; prefill: time to "
        f"first token of a {tpb.PROMPT}-token prompt in chunks of {tpb.PREFILL_STEP}; throughput: "
        f"{STREAMS} streams of {STREAM_TOKENS} tokens decoding together",
        "targets": TARGETS,
    }
    result.update(tpb.ratio_figures(ratios))
    result["moe_outputs_mismatched"] = mismatched
    result["moe_outputs_compared"] = tpb.compared(reference, "ep2")
    result["moe_logits_max_rel_diff"] = logits_rel
    result["expert_bytes_per_member"] = held
    result["expert_bytes_per_member_vs_half"] = round(max(held) / (experts_total / 2), 3) if held else 0.0
    result["sum_us_p50"], result["sum_us_p99"] = (round(x, 1) for x in sums["decode"])
    result["routing_load_spread"] = _spread(load)
    result["raw"] = {k: round(statistics.median(v), 3) for k, v in raws.items()}
    # The expert product alone: one decode row through `active` of the experts, the native gathered kernel
    # against MLX's gather_qmm and the dense kernel on the same bytes (compute/quantized_experts.py).
    result["gather_kernel"] = measure(
        experts=spec.experts,
        k=spec.active,
        shapes=((spec.hidden, spec.moe_intermediate), (spec.moe_intermediate, spec.hidden)),
        bits=spec.bits,
        group_size=spec.group_size,
        repeat=5 if quick else 50,
    )
    result["member_faults"] = [
        tpb.detection(model_dir, vocab, action, phase, fault_text, "expert")
        for phase in ("decode", "prefill")
        for action in ("sigstop", "sigkill")
    ]
    print(report(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _spread(load: list[list[float]]) -> dict[str, float]:
    """How uneven the measured routing was: the hottest expert's share over an even share, per layer."""
    shares = [max(row) / (sum(row) / len(row)) for row in load if row and sum(row) > 0]
    return {"hottest_over_even_median": round(statistics.median(shares), 2) if shares else 0.0}


def report(r: dict) -> str:
    lines = [f"bench moe: {r['model']} ({r['parameters'] / 1e6:.0f}M parameters) on {r['machine']['cpu']}"]
    for k, target in TARGETS.items():
        lines.append(f"  {k}: {r[k]} (target {target})")
    for k in (
        "throughput_ratio_8streams_ep2_vs_single",
        "decode_ratio_tp2_experts_vs_single",
        "decode_ratio_ep2_routed_vs_ep2",
        "throughput_ratio_ep2_routed_vs_ep2",
        "decode_ratio_ep2_heads_vs_ep2",
        "prefill_ratio_ep2_heads_vs_ep2",
    ):
        lines.append(f"  {k}: {r[k]}")
    lines.append(
        f"  moe_logits_max_rel_diff: {r['moe_logits_max_rel_diff']:.2e} ({r['moe_outputs_compared']})"
    )
    lines.append(f"  group sum per MoE layer: decode p50 {r['sum_us_p50']} us, p99 {r['sum_us_p99']} us")
    raw = r["raw"]
    lines.append(
        "  tokens/s: "
        + ", ".join(
            f"{n} decode {raw[f'{n}_decode_tps']:.2f}" for n in ("single", "ep2", "ep2_routed", "tp2")
        )
    )
    lines.append(
        "  prefill tokens/s: "
        + ", ".join(f"{n} {raw[f'{n}_prefill_tps']:.1f}" for n in ("single", "ep2", "tp2"))
    )
    for shape in r["gather_kernel"].get("shapes", []):
        rates = ", ".join(f"{op} {shape[f'{op}_gbps']:.1f}" for op in ("native", "mlx", "dense"))
        lines.append(f"  gather kernel {shape['in']}x{shape['out']}, GB/s: {rates}")
    for f in r["member_faults"]:
        lines.append(
            f"  {f['signal']} of the member in {f['phase']}: detected after {f['detected_s']} s, serving "
            f"again after {f['serving_again_s']} s, text exact: {bool(f['text_exact'])} ({f['why']})"
        )
    return "\n".join(lines)
