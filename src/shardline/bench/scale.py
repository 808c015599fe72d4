"""`shardline bench scale`: a model larger than any one node's memory limit, placed across 3 nodes and served.

A synthetic model (`shardline models synth`, random weights: speed and memory only) is written once into the
models cache (quantized, or float32 with --bits 0): by default a llama of ~900M parameters, 3.6 GB as float32;
with --arch qwen3_moe a mixture of experts (MOE_SPEC: 24 layers, hidden 1024, 48 experts of which 8 route,
each of 512 columns: 1.8B parameters, 1.47 GB at 4 bits). Three node daemons start on loopback
(`LocalCluster`: multicast scouting off), each with a `--memory-limit` too small for the whole model; the
master places it across them (a pipeline, or groups: its `layout` says which and why, and --ep asks for
expert groups of k), the bench streams a few tokens through it, and the runners' resident memory is sampled
throughout (and their kernel high-water mark, VmHWM, read at the end).

Sizes: `model_bytes` is what the weights take as stored and loaded (packed integers, scales and biases for a
quantized model): what placement counts. `model_bytes_float32` is the same model in float32 (what the GGUF
import produced before quantized weights). The limit of each node is `fraction` (0.5) of model_bytes plus the
KV reservation and the activation headroom that placement adds to every stage, so that no node admits the
whole model and the nodes together do; `node_limit` checks both with placement's own function. Each node's
weights are what its runners hold as placement counts them (an expert group's member: the attention whole and
its share of the experts; cluster/experts.py: layer_memory).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from shardline.bench.machine import describe, peak_rss
from shardline.cluster.experts import EXPERT, PIPELINE, TENSOR, layer_memory
from shardline.cluster.placement import (
    DEFAULT_RESERVE_TOKENS,
    NodeCapacity,
    PlacementError,
    PlacementRequest,
    place,
)
from shardline.compute.kv import round_up
from shardline.models.footprint import ModelFootprint, footprint_from_dir
from shardline.models.synth import SYNTH_INFO_FILE, SynthSpec, arch_spec, weight_sizes, write_synth_model

NODES = ("n0", "n1", "n2")
TOKENS = 8
PROMPT = "The quick brown fox jumps over the lazy dog."
# Few short requests: the KV reservation stays small beside the weights, as in a bench that serves 8 tokens.
REQUEST = PlacementRequest(sequences=1, reserve_tokens=256)
# Runner settings: the quantized matmul on CPU is MLX's scalar kernel for now, so steps are slow.
RUNNERS = {"heartbeat_s": 0.5, "heartbeat_timeout": 20.0, "step_deadline_floor": 30.0, "step_timeout": 300.0}
RUNNERS |= {"backoff_s": 0.5, "load_timeout": 300.0}
BENCH_SPEC = SynthSpec(layers=32, bits=4, group_size=32, dtype="float32", context=4096)
# 48 experts: groups of 2, 3 (--ep 3: all three nodes), 4 or 8 members each hold whole experts.
MOE_SPEC = arch_spec(
    "qwen3_moe",
    layers=24,
    hidden=1024,
    intermediate=3072,
    heads=8,
    kv_heads=4,
    vocab=32000,
    experts=48,
    active=8,
    moe_intermediate=512,
    bits=4,
    group_size=32,
    dtype="float32",
    context=4096,
)
SPECS = {"llama": BENCH_SPEC, "qwen3_moe": MOE_SPEC}


def kv_bytes(fp: ModelFootprint, request: PlacementRequest) -> int:
    """The KV reservation of every layer together, as placement counts it."""
    tokens = round_up(request.reserve_tokens or min(fp.context_length, DEFAULT_RESERVE_TOKENS))
    return fp.kv_bytes_per_token_per_layer * tokens * request.sequences * fp.layers


def node_limit(fp: ModelFootprint, request: PlacementRequest, nodes: int = 3, fraction: float = 0.5) -> int:
    """Each node's memory limit: `fraction` of the weights plus the KV reservation and one stage's activation
    headroom. Raises ValueError unless one node cannot hold the model, the limit is below the weights' bytes,
    and `nodes` nodes of that limit can (placement's own function decides both)."""
    limit = int(fraction * fp.weight_bytes) + kv_bytes(fp, request) + request.activation_bytes
    if limit >= fp.weight_bytes:
        raise ValueError(
            f"a limit of {limit / 1e9:.3f} GB ({fraction} of the weights + KV + activation headroom) is not "
            f"below the weights' {fp.weight_bytes / 1e9:.3f} GB: use a larger model or a smaller fraction"
        )
    try:
        place(fp, [NodeCapacity("alone", limit, 1.0)], request.model_copy(update={"max_stages": 1}))
    except PlacementError:
        pass
    else:
        raise ValueError(f"one node of {limit / 1e9:.3f} GB holds the whole model: lower the fraction")
    caps = [NodeCapacity(f"n{i}", limit, 1.0) for i in range(nodes)]
    try:
        place(fp, caps, request)
    except PlacementError as exc:
        raise ValueError(f"{nodes} nodes of {limit / 1e9:.3f} GB cannot hold the model: {exc}") from exc
    return limit


def synth_model(models_dir: Path, spec: SynthSpec) -> Path:
    """The bench's synthetic model, written once (kept while its spec stays) with its digests recorded."""
    from shardline.models.store.manifest import import_record, record_import

    quant = f"q{spec.bits}-{spec.dtype}" if spec.bits else spec.dtype
    shape = f"{spec.layers}l-{spec.hidden}h" if spec.arch == "llama" else f"{spec.layers}l-{spec.experts}e"
    arch = "" if spec.arch == "llama" else f"{spec.arch.replace('_', '-')}-"
    path = models_dir / f"synth-scale-{arch}{shape}-{quant}"
    info = path / SYNTH_INFO_FILE
    current = info.is_file() and json.loads(info.read_text()).get("spec") == asdict(spec)
    if not current:
        print(f"bench scale: writing the synthetic model {path.name}", file=sys.stderr)
        write_synth_model(path, spec, progress=True, overwrite=True)
    if not current or import_record(path) is None:
        record_import(path, path.name, replace=True)
    return path


class PeakSampler:
    """Every runner's resident memory, sampled; node id -> pid -> highest RSS seen."""

    def __init__(self, cluster: object, period_s: float = 0.2) -> None:
        self.cluster = cluster
        self.period_s = period_s
        self.peaks: dict[str, dict[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        for node_id, node in self.cluster.nodes.items():  # type: ignore[attr-defined]
            for pid in node.runner_pids():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                seen = self.peaks.setdefault(node_id, {})
                seen[pid] = max(seen.get(pid, 0), rss, peak_rss(pid))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # a sampling period, not a synchronisation
            self.sample()


def _prompt(model_dir: Path) -> list[int]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_dir).encode(PROMPT, add_special_tokens=False)


def runner_bytes(
    fp: ModelFootprint, runners: Sequence[Any], request: PlacementRequest
) -> list[tuple[int, int]]:
    """(weight bytes, need bytes) of each runner (StageRecord: node_id, start, end, member, expert_owners) as
    placement counts them (cluster/parallelism.py: estimate): a group's members hold 1/k of each layer (tensor
    groups) or the attention whole and 1/k of the experts (expert groups, whose KV is whole on every member);
    the face also the embedding and head of its ends."""
    sizes = Counter((r.start, r.end) for r in runners)
    experts = any(r.expert_owners for r in runners)
    tokens = round_up(request.reserve_tokens or min(fp.context_length, DEFAULT_RESERVE_TOKENS))
    kv_layer = fp.kv_bytes_per_token_per_layer * tokens * request.sequences
    out = []
    for r in runners:
        k = sizes[(r.start, r.end)]
        mode = PIPELINE if k == 1 else EXPERT if experts else TENSOR
        held = sum(layer_memory(fp, i, mode, k) for i in range(r.start, r.end))
        if r.member == 0:
            held += (fp.embed_bytes if r.start == 0 else 0) + (fp.head_bytes if r.end == fp.layers else 0)
            if fp.tied and r.end == fp.layers and r.start > 0:
                held += fp.embed_bytes
        kv = kv_layer * (r.end - r.start) / (k if mode == TENSOR else 1)
        out.append((int(held), int(held + kv + request.activation_bytes)))
    return out


def _nodes_report(
    fp: ModelFootprint,
    runners: Sequence[Any],
    request: PlacementRequest,
    peaks: dict[str, dict[int, int]],
    limit: int,
) -> list[dict]:
    counted = runner_bytes(fp, runners, request)
    out = []
    for node_id in NODES:
        mine = [(r, b) for r, b in zip(runners, counted, strict=True) if r.node_id == node_id]
        rss = sum(peaks.get(node_id, {}).values())
        weights = sum(w for _, (w, _) in mine)
        out.append(
            {
                "node": node_id,
                "limit_bytes": limit,
                "runner_peak_rss_bytes": rss,
                "rss_over_limit": rss > limit,
                "rss_share_of_limit": round(rss / limit, 3),
                "runners": [
                    {"layers": [r.start, r.end], "member": r.member, **_held_experts(r, runners)}
                    for r, _ in mine
                ],
                "weight_bytes": weights,
                "weight_share": round(weights / fp.weight_bytes, 3),
                "placement_need_bytes": sum(n for _, (_, n) in mine),
            }
        )
    return out


def _held_experts(runner: Any, runners: Sequence[Any]) -> dict[str, int]:
    """How many routed experts of each MoE layer an expert group's member holds (by its face's map)."""
    span = (runner.start, runner.end)
    face = next((r for r in runners if (r.start, r.end) == span and r.member == 0), None)
    rows = [row for row in (face.expert_owners if face is not None else []) if row]
    return {"experts_held_per_layer": rows[0].count(runner.member)} if rows else {}


def run(
    json_path: Path | None,
    spec: SynthSpec = BENCH_SPEC,
    fraction: float = 0.5,
    tokens: int = TOKENS,
    models_dir: Path | None = None,
    ep: int | None = None,
) -> dict:
    """Serve `spec` on 3 local nodes of `fraction`'s limit; `ep`: ask for expert groups of that many."""
    from shardline.models.registry import cache_dir
    from shardline.testing.cluster import LocalCluster

    started = time.monotonic()
    models_dir = models_dir or cache_dir()
    model_dir = synth_model(models_dir, spec)
    fp = footprint_from_dir(model_dir)
    sizes = weight_sizes(model_dir)
    request = REQUEST.model_copy(update={"expert_parallel": ep}) if ep else REQUEST
    limit = node_limit(fp, request, len(NODES), fraction)
    prompt = _prompt(model_dir)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-scale-"))
    extra = ["--memory-limit", str(limit), "--compute-score", "10", "--prefill-step", "32"]
    cluster = LocalCluster(root, list(NODES), models_dir, extra=extra, runners=dict(RUNNERS))
    result: dict = {"machine": describe(), "model": model_dir.name, "arch": spec.arch}
    result["synthetic"] = asdict(spec)
    print(f"bench scale: 3 nodes, {limit / 1e9:.3f} GB each, {model_dir.name}", file=sys.stderr)
    try:
        cluster.start()
        client = cluster.client()  # closed with the cluster
        with PeakSampler(cluster) as sampler:
            client.wait(lambda v: sum(n.alive for n in v.nodes) == len(NODES), 60, "3 nodes")
            client.wait(lambda v: _holders(v, model_dir.name) == len(NODES), 60, "3 nodes listing the model")
            placed_at = time.monotonic()
            reply = client.place(model_dir.name, request)
            assert reply.instance is not None and reply.placement is not None
            record = client.wait_ready(reply.instance.instance, 600)
            ready_s = time.monotonic() - placed_at
            gen_at = time.monotonic()
            handle = client.front(reply.instance.instance).submit(prompt, max_tokens=tokens)
            generated = handle.tokens(timeout=600)
            gen_s = time.monotonic() - gen_at
            sampler.sample()  # the last look, VmHWM included, before the runners stop
            peaks = {k: dict(v) for k, v in sampler.peaks.items()}
    finally:
        cluster.close()
    nodes = _nodes_report(fp, record.stages, request, peaks, limit)
    groups = Counter((r.start, r.end) for r in record.stages)
    result.update(
        {
            "model_bytes": fp.weight_bytes,
            "model_bytes_float32": sizes["float32_bytes"],
            "parameters": sizes["parameters"],
            "largest_node_limit_bytes": limit,
            "model_larger_than_any_node": fp.weight_bytes > limit,
            "limit_rule": f"{fraction} x model_bytes + KV reservation ({kv_bytes(fp, request)} B for "
            f"{request.sequences} x {request.reserve_tokens} tokens) + activation headroom "
            f"({request.activation_bytes} B)",
            "experts": fp.experts,
            "experts_active": fp.experts_active,
            "expert_parallel_asked": ep,
            "layout": record.layout,
            "mode": _mode(record.stages),
            "stages": len(groups),
            "group_size": max(groups.values()),
            "runners": len(record.stages),
            "nodes": nodes,
            "nodes_over_limit": sum(n["rss_over_limit"] for n in nodes),
            "tokens_generated": len(generated),
            "place_to_ready_s": round(ready_s, 1),
            "generate_s": round(gen_s, 1),
            "total_s": round(time.monotonic() - started, 1),
            "rss": "each node's runners: the highest of RSS sampled every 0.2 s and the kernel's VmHWM",
        }
    )
    _print(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


def _mode(runners: Sequence[Any]) -> str:
    if len({(r.start, r.end) for r in runners}) == len(runners):
        return PIPELINE
    return EXPERT if any(r.expert_owners for r in runners) else TENSOR


def _holders(view: object, model: str) -> int:
    return sum(1 for n in view.nodes if n.alive and model in n.models)  # type: ignore[attr-defined]


def _print(r: dict) -> None:
    m = r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']}")
    print(
        f"model: {r['model']} (synthetic), {r['parameters'] / 1e6:.0f}M parameters: "
        f"{r['model_bytes'] / 1e9:.3f} GB stored, {r['model_bytes_float32'] / 1e9:.3f} GB as float32"
    )
    if r["experts"]:
        print(f"mixture of experts: {r['experts']} experts a MoE layer, {r['experts_active']} active a token")
    print(f"node limit: {r['largest_node_limit_bytes'] / 1e9:.3f} GB each ({r['limit_rule']})")
    print(
        f"placement: {r['mode']}, {r['stages']} stage(s) x {r['group_size']} "
        f"(expert_parallel asked: {r['expert_parallel_asked']}): {r['layout']}"
    )
    for n in r["nodes"]:
        held = ", ".join(
            f"layers {x['layers']} member {x['member']}"
            + (f" ({x['experts_held_per_layer']} experts a layer)" if "experts_held_per_layer" in x else "")
            for x in n["runners"]
        )
        print(
            f"  {n['node']}: {held or 'no runner'}, weights {n['weight_bytes'] / 1e9:.3f} GB "
            f"({n['weight_share']:.0%}), runner peak RSS {n['runner_peak_rss_bytes'] / 1e9:.3f} GB of "
            f"{n['limit_bytes'] / 1e9:.3f} GB{' OVER' if n['rss_over_limit'] else ''}"
        )
    print(
        f"nodes_over_limit {r['nodes_over_limit']}, tokens_generated {r['tokens_generated']} "
        f"in {r['generate_s']} s, ready {r['place_to_ready_s']} s after placing, total {r['total_s']} s"
    )
