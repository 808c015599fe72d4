"""`shardline bench engine`: the engine against single-process mlx-lm and llama.cpp, side by side, on this
machine, for any model reference (llama.cpp runs on the GGUF the model was imported from).

Every number is a ratio against a baseline run in the same invocation; raw numbers stand beside them.
Stages are pinned one per core with one BLAS thread each, and the baseline to one core with one thread:
the comparison is per core of work. The baseline is loaded once and kept idle between runs, so each engine
run sits between two baseline runs and is compared with their mean: a shared machine's speed drifts over
minutes, and a ratio taken seconds apart, with linear drift cancelled, is steadier. Speed ratios come
from `pairs` rounds; each is reported as the median with the range of the rounds. Besides: one stage on
every core of the node against llama.cpp at its best thread count, the share of the cores' measured read
bandwidth a decode token uses, and one decode token's time op kind by op kind.

Here: the rounds and the report. The baselines (mlx-lm's process, llama.cpp's llama-bench) are in
engine_references.py, what a stage's memory is measured against in engine_memory.py, the runs it times in
engine_runs.py, the prefix cache's figures in engine_prefix.py, the bandwidth in engine_node.py, the decode
token's profile in engine_profile.py.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from shardline.bench.engine_memory import (
    activation_bytes,
    memory_ratios,
    runtime_allowance_bytes,
    stage_memory,
    weights_bytes,
)
from shardline.bench.engine_node import (
    bandwidth_share,
    bytes_per_token,
    node_cores,
    read_bandwidth_gbps,
    stage_bytes,
)
from shardline.bench.engine_prefix import PrefixWork, prefix_round
from shardline.bench.engine_profile import measure_or_reason as measure_profile
from shardline.bench.engine_profile import token_accounts
from shardline.bench.engine_references import LLAMA_PROMPT, Baseline, LlamaCpp, llama_reference
from shardline.bench.engine_runs import (
    PREFILL_STEP,
    decode_tps,
    prompt_ids,
    start_engine,
    streams,
    timed_request,
)
from shardline.bench.machine import describe
from shardline.compute.constraints import Matchers, json_schema
from shardline.compute.sampling import SamplingParams
from shardline.engine.engine import Engine
from shardline.models.gguf_split import split_parts

PREFILL_CHUNKS = 24
DECODE_TOKENS = 64
STREAMS = 8
MEM_SHORT, MEM_LONG = 1024, 16384
PROFILE_CONTEXT = 64  # the decode stream's context, about: its 32-token prompt and half of 64 tokens


# Long enough that every stream decodes to max_tokens: 8 streams measured while all of them decode.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer", "minimum": 0}},
                "required": ["name", "count"],
            },
        },
    },
    "required": ["title", "items"],
}


def _constrained_sampling(model_dir: Path) -> SamplingParams:
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    end = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return SamplingParams(constraint=json_schema(BENCH_SCHEMA, end))


def _mask_ms(model_dir: Path, outputs: list[list[int]], vocab: int) -> tuple[float, float]:
    """The sampling stage's cost per constrained token: each output replayed token by token through the
    same matcher cache a runner keeps (in this process, one core), the time of each mask."""
    c = _constrained_sampling(model_dir).constraint
    assert c is not None
    matchers = Matchers(model_dir / "tokenizer.json")
    times = []
    for i, out in enumerate(outputs):
        for n in range(len(out)):
            start = time.perf_counter()
            matchers.mask(f"r{i}", c, out[:n], vocab)
            times.append((time.perf_counter() - start) * 1e3)
    matchers.close()
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]


def _last_step_ms(engine: Engine) -> list[float]:
    beats = sorted(engine.fresh_heartbeats(30), key=lambda h: h.slot)
    return [round(1000 * h.last_step.seconds, 2) if h.last_step else 0.0 for h in beats]


def _profile(raw: dict) -> dict:
    """One decode token, in milliseconds: single-process mlx-lm, then each pipeline's stages and the rest."""
    out: dict = {"single_process": round(1000 / raw["single_decode_tps"], 2)}
    for s in ("s1", "s2"):
        token = 1000 / raw[f"{s}_decode_tps"]
        compute = raw[f"{s}_stage_ms"]
        out[s] = {"token": round(token, 2), "stages": compute, "rest": round(token - sum(compute), 2)}
    return out


def _median(values: list) -> float | list[float]:
    """The median of per-round figures; of each position, for per-stage lists."""
    if isinstance(values[0], list):
        return [statistics.median(x) for x in zip(*values, strict=True)]
    return statistics.median(values)


def _serial_prefill_tps(model_dir: Path, prompt: list[int]) -> float:
    with start_engine(model_dir, 2, window=1) as engine:
        return len(prompt) / timed_request(engine, prompt, 1)[0]


def _node_round(model_dir: Path, prompt: list[int], decode_tokens: int, llama: LlamaCpp | None) -> dict:
    """One stage using every core of the node (unpinned, as many threads as cores), between two runs of
    llama-bench at each thread count 1..cores on the same cores: against the best of them (A-B-A)."""
    cores = len(node_cores())
    raw: dict = {}
    by_threads = [llama.decode_by_threads(cores)] if llama else []
    with start_engine(model_dir, 1, pin_cpus=False) as engine:
        raw["node_decode_tps"] = decode_tps(timed_request(engine, prompt, decode_tokens))
        raw["node_weight_bytes"], raw["node_kv_bytes_per_token"] = stage_bytes(engine)
    if llama:
        by_threads.append(llama.decode_by_threads(cores))
        mean = {t: statistics.mean(run[t] for run in by_threads) for t in by_threads[0]}
        best = max(mean, key=lambda t: mean[t])
        raw["llama_cpp_best_decode_tps"], raw["llama_cpp_best_threads"] = mean[best], best
    return raw


def _round(
    baseline: Baseline,
    model_dir: Path,
    vocab: int,
    chunks: int,
    decode_tokens: int,
    check_batched: bool,
    llama: LlamaCpp | None = None,
) -> tuple[dict, dict, list[dict[str, int]]]:
    """One round: each engine run right after the baseline run it is compared with. Its ratios, the raw
    figures they come from, and (first round) each stage's memory. One engine is up at a time (an idle one
    still beats and listens), while the baseline process stays loaded, idle on its input. llama.cpp's runs sit
    around the engine runs they are compared with, while no engine is up (A-B-A as with the baseline)."""
    long_prompt = prompt_ids(chunks * PREFILL_STEP, vocab)
    short_prompt = prompt_ids(32, vocab, offset=3)
    llama_prompt = prompt_ids(llama.prompt if llama else LLAMA_PROMPT, vocab, offset=13)
    stream_prompts = [prompt_ids(24 + 4 * k, vocab, offset=5 + k) for k in range(STREAMS)]
    raw: dict[str, float] = {}
    memory: list[dict[str, int]] = []
    llama_1t = [llama.bench(1)] if llama else []
    # Where a decode token's time goes: each stage's compute (its last step, from its heartbeat) and the rest
    # (hops, framing, the leader's Python between steps), on one stage and on two.
    with start_engine(model_dir, 1) as engine:
        raw["s1_single_decode_tps"] = decode_tps(baseline.run(short_prompt, decode_tokens))
        raw["s1_decode_tps"] = decode_tps(timed_request(engine, short_prompt, decode_tokens))
        raw["s1_stage_ms"] = _last_step_ms(engine)  # type: ignore[assignment]
        raw["s1_weight_bytes"], raw["s1_kv_bytes_per_token"] = stage_bytes(engine)
        raw["s1_prefill_tps"] = len(llama_prompt) / timed_request(engine, llama_prompt, 1)[0]
    if llama:
        llama_1t.append(llama.bench(1))
        raw["llama_cpp_1t_decode_tps"] = statistics.mean(x["decode_tps"] for x in llama_1t)
        raw["llama_cpp_1t_prefill_tps"] = statistics.mean(x["prefill_tps"] for x in llama_1t)

    raw.update(_node_round(model_dir, short_prompt, decode_tokens, llama))

    # The serial pipeline (one chunk in flight) is an engine of its own: it runs before and after the
    # overlapped one, and the overlap is compared with the mean of the two, like every figure here.
    serial = [_serial_prefill_tps(model_dir, long_prompt)]
    llama_2t = [llama.bench(2)] if llama else []
    with start_engine(model_dir, 2) as engine:
        # Each engine figure sits between two baseline runs and is compared with their mean (A-B-A): drift
        # that is linear over the minute they take cancels out.
        single = [decode_tps(baseline.run(short_prompt, decode_tokens))]
        raw["s2_decode_tps"] = decode_tps(timed_request(engine, short_prompt, decode_tokens))
        raw["s2_stage_ms"] = _last_step_ms(engine)  # type: ignore[assignment]
        single.append(decode_tps(baseline.run(short_prompt, decode_tokens)))
        raw["single_decode_tps"] = statistics.mean(single)
        single = [len(long_prompt) / baseline.run(long_prompt, 1)[0]]
        raw["s2_overlap_prefill_tps"] = len(long_prompt) / timed_request(engine, long_prompt, 1)[0]
        single.append(len(long_prompt) / baseline.run(long_prompt, 1)[0])
        raw["single_prefill_tps"] = statistics.mean(single)
        one = [streams(engine, stream_prompts[:1], decode_tokens)[0]]
        raw["s2_2stream_tps"], _ = streams(engine, stream_prompts[:2], decode_tokens)
        one.append(streams(engine, stream_prompts[:1], decode_tokens)[0])
        raw["s2_8stream_tps"], together = streams(engine, stream_prompts, decode_tokens)
        # The same 8 streams under a JSON schema, between two unconstrained runs (A-B-A).
        free = [raw["s2_8stream_tps"]]
        raw["s2_8stream_constrained_tps"], constrained = streams(
            engine, stream_prompts, decode_tokens, _constrained_sampling(model_dir)
        )
        free.append(streams(engine, stream_prompts, decode_tokens)[0])
        raw["s2_8stream_free_tps"] = statistics.mean(free)
        one.append(streams(engine, stream_prompts[:1], decode_tokens)[0])
        raw["s2_1stream_tps"] = statistics.mean(one[:2])  # the one the 2 streams sat between
        raw["s2_1stream_after_tps"] = statistics.mean(one[1:])  # and the one the 8 streams sat between
        if check_batched:
            alone = [streams(engine, [p], decode_tokens)[1][0] for p in stream_prompts]
            raw["batched_outputs_mismatched"] = sum(a != b for a, b in zip(alone, together, strict=True))
            memory = stage_memory(engine)  # after the long prefill and the 8 streams: every peak is in
            raw["mask_ms_p50"], raw["mask_ms_p99"] = _mask_ms(model_dir, constrained, vocab)
    if llama:
        llama_2t.append(llama.bench(2))
        raw["llama_cpp_2t_decode_tps"] = statistics.mean(x["decode_tps"] for x in llama_2t)

    serial.append(_serial_prefill_tps(model_dir, long_prompt))
    raw["s2_serial_prefill_tps"] = statistics.mean(serial)

    ratios = {
        "decode_ratio_s2_vs_single": raw["s2_decode_tps"] / raw["single_decode_tps"],
        "prefill_ratio_s2_overlap_vs_single": raw["s2_overlap_prefill_tps"] / raw["single_prefill_tps"],
        "prefill_ratio_s2_overlap_vs_s2_serial": raw["s2_overlap_prefill_tps"] / raw["s2_serial_prefill_tps"],
        "throughput_ratio_2streams_vs_1": raw["s2_2stream_tps"] / raw["s2_1stream_tps"],
        "throughput_ratio_8streams_vs_1": raw["s2_8stream_tps"] / raw["s2_1stream_after_tps"],
        "throughput_ratio_8streams_vs_single_process": raw["s2_8stream_tps"] / raw["single_decode_tps"],
        "constrained_decode_ratio": raw["s2_8stream_constrained_tps"] / raw["s2_8stream_free_tps"],
    }
    # The decode stream's mean context: its prompt and half its tokens.
    context = len(short_prompt) + decode_tokens / 2
    shares = (("decode_bandwidth_share", "s1", 1), ("decode_bandwidth_share_node", "node", len(node_cores())))
    for key, prefix, cores in shares:
        raw[f"read_gbps_{prefix}"] = read_bandwidth_gbps(cores)
        nbytes = bytes_per_token(raw, prefix, context)
        ratios[key] = bandwidth_share(raw[f"{prefix}_decode_tps"], nbytes, raw[f"read_gbps_{prefix}"])
    if llama:
        best = raw["llama_cpp_best_decode_tps"]
        ratios["decode_ratio_node_vs_llama_cpp_best"] = raw["node_decode_tps"] / best
        ratios["decode_ratio_s1_vs_llama_cpp_1t"] = raw["s1_decode_tps"] / raw["llama_cpp_1t_decode_tps"]
        ratios["prefill_ratio_s1_vs_llama_cpp_1t"] = raw["s1_prefill_tps"] / raw["llama_cpp_1t_prefill_tps"]
        ratios["throughput_ratio_8streams_s2_vs_llama_cpp_2t"] = (
            raw["s2_8stream_tps"] / raw["llama_cpp_2t_decode_tps"]
        )
    return ratios, raw, memory


def run(model: str | None, json_path: Path | None, quick: bool = False, pairs: int = 3) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    chunks = 4 if quick else PREFILL_CHUNKS
    decode_tokens = 16 if quick else DECODE_TOKENS
    pairs = 1 if quick else pairs
    work = PrefixWork.quick() if quick else PrefixWork()
    print(f"bench engine: {model_dir.name} on {describe()['cpu']} ({describe()['blas']})", file=sys.stderr)

    llama, gguf, llama_missing = llama_reference(model, model_dir, quick)
    if llama_missing:
        print(f"bench engine: {llama_missing}", file=sys.stderr)
    rounds: dict[str, list[float]] = defaultdict(list)
    raws: dict[str, list[float]] = defaultdict(list)
    memory: list[dict[str, int]] = []
    with Baseline(model_dir, PREFILL_STEP) as baseline:
        for i in range(pairs):
            print(f"bench engine: round {i + 1} of {pairs}", file=sys.stderr)
            ratios, raw, mem_i = _round(
                baseline, model_dir, vocab, chunks, decode_tokens, check_batched=i == 0, llama=llama
            )
            memory = memory or mem_i
            prefix, prefix_raw, mismatched = prefix_round(model_dir, vocab, work)
            ratios.update(prefix)
            raw.update(prefix_raw, prefix_outputs_mismatched=mismatched)
            for k, v in ratios.items():
                rounds[k].append(v)
            for k, v in raw.items():
                raws[k].append(v)
    gguf_bytes = sum(p.stat().st_size for p in split_parts(gguf)) if gguf else 0
    if gguf:  # the weights one stage holds (its heartbeat) over the file's
        rounds["weights_bytes_ratio_vs_gguf"] = [b / gguf_bytes for b in raws["s1_weight_bytes"]]
    print("bench engine: one decode token, op by op", file=sys.stderr)
    ops = measure_profile(model_dir, PROFILE_CONTEXT, 8 if quick else 32)
    allowance = runtime_allowance_bytes()
    with_tokenizer = runtime_allowance_bytes(model_dir / "tokenizer.json")

    mem = {}
    short, long = (256, 1024) if quick else (MEM_SHORT, MEM_LONG)
    for name, n in (("short", short), ("long", long)):
        # The long prompt may pass the model's trained context: memory is what is measured, not answers.
        with start_engine(model_dir, 2, context_length=long + 1) as engine:
            timed_request(engine, prompt_ids(n, vocab, offset=11), 1)
            mem[name] = activation_bytes(engine)

    result: dict = {
        "machine": describe(),
        "model": model_dir.name,
        "prefill_step": PREFILL_STEP,
        "prefill_prompt_tokens": chunks * PREFILL_STEP,
        "pairs": pairs,
        "setup": "stages pinned one per core, one BLAS thread each; baseline pinned to one core, one thread; "
        "the baseline kept loaded; each engine run between two baseline runs (A-B-A), compared with their "
        "mean; the overlapped prefill likewise between two serial-pipeline runs",
    }
    result.update({k: statistics.median(v) for k, v in rounds.items()})
    result["decode_tps_s1"] = statistics.median(raws["s1_decode_tps"])
    # Per constrained token on the sampling stage, replayed from round 1's outputs (reported, no target).
    result["mask_ms_p50"] = statistics.median(raws["mask_ms_p50"])
    result["mask_ms_p99"] = statistics.median(raws["mask_ms_p99"])
    result.setdefault("weights_bytes_ratio_vs_gguf", None)
    result["weights_bytes"] = {"held_one_stage": statistics.median(raws["s1_weight_bytes"])}
    result["weights_bytes"].update(files=weights_bytes(model_dir), gguf=gguf_bytes or None)
    stages = memory_ratios(memory, allowance, with_tokenizer)
    result["peak_rss_ratio_per_stage"] = [m["ratio"] for m in stages]
    result["stage_memory"] = stages
    result["memory_setup"] = (
        "each stage runner's peak RSS (VmHWM, after the long prefill and the 8 streams of round 1) over its "
        "weights + its KV cache at peak + a runtime allowance: the VmHWM of a bare process that imported a "
        f"runner's modules (mlx, mlx-lm, zenoh) and ran one MLX op, {allowance / 1e6:.0f} MB here; for the "
        "stage that loaded the constraint engine's tokenizer (the sampling stage, after 8 streams under a "
        f"JSON schema) the same process that also built it, {with_tokenizer / 1e6:.0f} MB"
    )
    result["llama_cpp"] = (
        {
            "gguf": llama.gguf.name,
            "gguf_bytes": llama.gguf.stat().st_size,
            "llama_bench": f"-p {llama.prompt} -n {llama.gen} -r {llama.repetitions}, pinned to 1, 2 cores; "
            f"-p 0 -n {llama.gen} at -t 1..{len(node_cores())} on all {len(node_cores())} cores",
            "setup": "llama-bench at 1 thread before and after the one-stage engine's runs, at 2 threads "
            "before and after the two-stage engine's, at each thread count before and after the engine of "
            "one stage on every core (its best mean is the reference); each ratio against the mean of its "
            "two runs. The 8-stream figure is against llama.cpp's single-stream decode on 2 threads",
        }
        if llama
        else {"skipped": llama_missing}
    )
    result["activation_mem_ratio_long_vs_short"] = max(
        lg / max(1, sh) for lg, sh in zip(mem["long"], mem["short"], strict=True)
    )
    result["activation_mem_prompts"] = [short, long]
    result["batched_outputs_mismatched"] = int(max(raws["batched_outputs_mismatched"]))
    result["prefix_outputs_mismatched"] = int(sum(raws["prefix_outputs_mismatched"]))
    result["prefix_setup"] = (
        f"2 stages, prefill chunk {PREFILL_STEP}; turn 5 of a conversation (system prompt {work.system} "
        f"tokens, turns of a {work.user}-token user message and a {work.reply}-token reply), time to first "
        "token with the cache warm from turns 1-4 over the same prompt on an engine without it; "
        f"{work.shared_requests} concurrent requests of a {work.shared_system}-token system prompt and "
        f"{work.shared_user} tokens of their own, {work.reply} tokens each, from a cold cache, tokens/s with "
        "over without; every reply compared between the two"
    )
    result["ranges"] = {k: [min(v), max(v)] for k, v in rounds.items()}
    result["raw"] = {k: _median(v) for k, v in raws.items()}
    result["rounds"] = [{k: v[i] for k, v in raws.items() if i < len(v)} for i in range(pairs)]
    result["decode_token_profile_ms"] = _profile(result["raw"])
    s1_token_ms = 1000 / result["raw"]["s1_decode_tps"]
    result["decode_token_ops_ms"] = token_accounts(ops, s1_token_ms, result["raw"]["s1_stage_ms"][0])
    result["bandwidth_setup"] = (
        "bytes read per decode token (the stage's weights held, from its heartbeat, and the KV of the "
        "stream's mean context) x its tokens/s over node/resources stream_bandwidth measured in this run in "
        "a process pinned as the stage: one core, one thread (decode_bandwidth_share, one pinned stage); "
        "every core, as many threads (decode_bandwidth_share_node, one unpinned stage)"
    )
    result["raw"]["activation_bytes_short_per_stage"] = mem["short"]
    result["raw"]["activation_bytes_long_per_stage"] = mem["long"]
    _print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


TARGETS = {
    "decode_ratio_s2_vs_single": 0.97,
    "prefill_ratio_s2_overlap_vs_single": 1.85,
    "prefill_ratio_s2_overlap_vs_s2_serial": 1.8,
    "activation_mem_ratio_long_vs_short": 1.2,
    "throughput_ratio_2streams_vs_1": 1.9,
    "throughput_ratio_8streams_vs_1": 5.0,
    "throughput_ratio_8streams_vs_single_process": 4.0,
    "batched_outputs_mismatched": 0,
    "constrained_decode_ratio": 0.9,
    "prefix_ttft_ratio_turn5": 0.3,
    "prefix_shared_prompt_throughput_ratio": 2.0,
    "prefix_outputs_mismatched": 0,
    "decode_bandwidth_share": 0.8,
}


# Against llama.cpp on the model's GGUF (absent, with the reason, where either is missing).
LLAMA_TARGETS = {
    "decode_ratio_s1_vs_llama_cpp_1t": 1.0,
    "decode_ratio_node_vs_llama_cpp_best": 1.0,
    "prefill_ratio_s1_vs_llama_cpp_1t": 1.0,
    "throughput_ratio_8streams_s2_vs_llama_cpp_2t": 1.5,
}
LLAMA_KEYS = tuple(LLAMA_TARGETS)


def _row(result: dict, key: str, target: float, better: str = ">=") -> str:
    lo, hi = result["ranges"].get(key, [result[key], result[key]])
    return f"{key:46} {result[key]:8.3f} {lo:8.3f}-{hi:<8.3f} {better}{target:6.2f}"


def _print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']} ({m['device']}), {m['blas']}"
    )
    print(f"model: {result['model']}; {result['setup']}; {result['pairs']} alternating rounds")
    print(f"{'metric':46} {'median':>8} {'range':>17} {'target':>8}")
    for key, target in TARGETS.items():
        better = "<=" if key.startswith(("activation", "batched", "prefix_ttft", "prefix_outputs")) else ">="
        print(_row(result, key, target, better))
    for key, value in result["raw"].items():
        print(f"  {key}: {value if isinstance(value, list) else round(value, 2)}")
    print(f"  decode token profile (ms): {result['decode_token_profile_ms']}")
    print(f"decode_tps_s1 (one stream, one stage, one core): {result['decode_tps_s1']:.2f}")
    share = result["decode_bandwidth_share_node"]
    print(f"decode_bandwidth_share_node (one stage on every core): {share:.3f} ({result['bandwidth_setup']})")
    p50, p99 = result["mask_ms_p50"], result["mask_ms_p99"]
    print(f"constrained mask per token (ms): p50 {p50:.3f}, p99 {p99:.3f}")
    if "skipped" in result["llama_cpp"]:
        print(f"llama.cpp: {result['llama_cpp']['skipped']}")
    else:
        print(f"against llama.cpp ({result['llama_cpp']['gguf']}; {result['llama_cpp']['setup']}):")
        for key, target in LLAMA_TARGETS.items():
            print(_row(result, key, target))
    if result["weights_bytes_ratio_vs_gguf"] is None:
        print("weights_bytes_ratio_vs_gguf: n/a (no GGUF)")
    else:
        print(_row(result, "weights_bytes_ratio_vs_gguf", 1.02, "<="))
    print(f"peak_rss_ratio_per_stage: {result['peak_rss_ratio_per_stage']} ({result['memory_setup']})")
    _print_ops(result["decode_token_ops_ms"])


def _print_ops(ops: dict) -> None:
    """One decode token on one pinned stage, in milliseconds, from the whole token down to each op kind."""
    if "skipped" in ops:
        print(f"one decode token, op by op: skipped ({ops['skipped']})")
        return
    why = f": {ops['why_generic']}" if ops.get("why_generic") else ""
    print(f"one decode token, one pinned stage, ms ({ops['path']} path{why}; context {ops['context']}):")
    rest = ops["transport_and_leader"]
    print(f"  token {ops['token']:.3f} = step {ops['step']:.3f} + transport and leader {rest:.3f}")
    print(
        f"  step = forward {ops['forward']:.3f} + sampling {ops['sampling_greedy']:.3f} (greedy; top-k/top-p "
        f"{ops['sampling_top_k_top_p']:.3f}) + runner {ops['runner_other']:.3f}"
    )
    parts = " + ".join(f"{k} {v:.3f}" for k, v in sorted(ops["ops"].items(), key=lambda kv: -kv[1]))
    print(f"  forward = {parts} - eager overhead {ops['eager_overhead']:.3f}")
