"""`shardline bench scale`: a model larger than any one node's memory limit, placed across 3 nodes and served.

A synthetic llama (`shardline models synth`, random weights: speed and memory only) of ~900M parameters,
3.6 GB as float32, is written once into the models cache (quantized, or float32 with --bits 0). Three node
daemons start on loopback (`LocalCluster`: multicast scouting off), each with a `--memory-limit` too small
for the whole model; the master places it across them, the bench streams a few tokens through it, and the
runners' resident memory is sampled throughout (and their kernel high-water mark, VmHWM, read at the end).

Sizes: `model_bytes` is what the weights take as stored and loaded (packed integers, scales and biases for a
quantized model): what placement counts. `model_bytes_float32` is the same model in float32 (what the GGUF
import produced before quantized weights). The limit of each node is `fraction` (0.5) of model_bytes plus the
KV reservation and the activation headroom that placement adds to every stage, so that no node admits the
whole model and the nodes together do; `node_limit` checks both with placement's own function.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil

from shardline.bench.machine import describe, peak_rss
from shardline.cluster.placement import (
    DEFAULT_RESERVE_TOKENS,
    NodeCapacity,
    PlacementError,
    PlacementRequest,
    place,
)
from shardline.compute.kv import round_up
from shardline.models.footprint import ModelFootprint, footprint_from_dir
from shardline.models.synth import SYNTH_INFO_FILE, SynthSpec, weight_sizes, write_synth_model

NODES = ("n0", "n1", "n2")
TOKENS = 8
PROMPT = "The quick brown fox jumps over the lazy dog."
# Few short requests: the KV reservation stays small beside the weights, as in a bench that serves 8 tokens.
REQUEST = PlacementRequest(sequences=1, reserve_tokens=256)
# Runner settings: the quantized matmul on CPU is MLX's scalar kernel for now, so steps are slow.
RUNNERS = {"heartbeat_s": 0.5, "heartbeat_timeout": 20.0, "step_deadline_floor": 30.0, "step_timeout": 300.0}
RUNNERS |= {"backoff_s": 0.5, "load_timeout": 300.0}
BENCH_SPEC = SynthSpec(layers=32, bits=4, group_size=32, dtype="float32", context=4096)


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
    path = models_dir / f"synth-scale-{spec.layers}l-{spec.hidden}h-{quant}"
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


def _nodes_report(
    placement: object, peaks: dict[str, dict[int, int]], limit: int, weights: int
) -> list[dict]:
    stages = {a.node_id: a for a in placement.stages}  # type: ignore[attr-defined]
    out = []
    for node_id in NODES:
        a = stages.get(node_id)
        rss = sum(peaks.get(node_id, {}).values())
        out.append(
            {
                "node": node_id,
                "limit_bytes": limit,
                "runner_peak_rss_bytes": rss,
                "rss_over_limit": rss > limit,
                "rss_share_of_limit": round(rss / limit, 3),
                "layers": [a.start, a.end] if a else None,
                "weight_bytes": a.weight_bytes if a else 0,
                "weight_share": round(a.weight_bytes / weights, 3) if a else 0.0,
                "placement_need_bytes": a.need_bytes if a else 0,
            }
        )
    return out


def run(
    json_path: Path | None,
    spec: SynthSpec = BENCH_SPEC,
    fraction: float = 0.5,
    tokens: int = TOKENS,
    models_dir: Path | None = None,
) -> dict:
    from shardline.models.registry import cache_dir
    from shardline.testing.cluster import LocalCluster

    started = time.monotonic()
    models_dir = models_dir or cache_dir()
    model_dir = synth_model(models_dir, spec)
    fp = footprint_from_dir(model_dir)
    sizes = weight_sizes(model_dir)
    limit = node_limit(fp, REQUEST, len(NODES), fraction)
    prompt = _prompt(model_dir)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-scale-"))
    extra = ["--memory-limit", str(limit), "--compute-score", "10", "--prefill-step", "32"]
    cluster = LocalCluster(root, list(NODES), models_dir, extra=extra, runners=dict(RUNNERS))
    result: dict = {"machine": describe(), "model": model_dir.name, "synthetic": asdict(spec)}
    print(f"bench scale: 3 nodes, {limit / 1e9:.3f} GB each, {model_dir.name}", file=sys.stderr)
    try:
        cluster.start()
        client = cluster.client()  # closed with the cluster
        with PeakSampler(cluster) as sampler:
            client.wait(lambda v: sum(n.alive for n in v.nodes) == len(NODES), 60, "3 nodes")
            client.wait(lambda v: _holders(v, model_dir.name) == len(NODES), 60, "3 nodes listing the model")
            placed_at = time.monotonic()
            reply = client.place(model_dir.name, REQUEST)
            assert reply.instance is not None and reply.placement is not None
            client.wait_ready(reply.instance.instance, 600)
            ready_s = time.monotonic() - placed_at
            gen_at = time.monotonic()
            handle = client.front(reply.instance.instance).submit(prompt, max_tokens=tokens)
            generated = handle.tokens(timeout=600)
            gen_s = time.monotonic() - gen_at
            sampler.sample()  # the last look, VmHWM included, before the runners stop
            peaks = {k: dict(v) for k, v in sampler.peaks.items()}
    finally:
        cluster.close()
    nodes = _nodes_report(reply.placement, peaks, limit, fp.weight_bytes)
    result.update(
        {
            "model_bytes": fp.weight_bytes,
            "model_bytes_float32": sizes["float32_bytes"],
            "parameters": sizes["parameters"],
            "largest_node_limit_bytes": limit,
            "model_larger_than_any_node": fp.weight_bytes > limit,
            "limit_rule": f"{fraction} x model_bytes + KV reservation ({kv_bytes(fp, REQUEST)} B for "
            f"{REQUEST.sequences} x {REQUEST.reserve_tokens} tokens) + activation headroom "
            f"({REQUEST.activation_bytes} B)",
            "stages": len(reply.placement.stages),
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


def _holders(view: object, model: str) -> int:
    return sum(1 for n in view.nodes if n.alive and model in n.models)  # type: ignore[attr-defined]


def _print(r: dict) -> None:
    m = r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']}")
    print(
        f"model: {r['model']} (synthetic), {r['parameters'] / 1e6:.0f}M parameters: "
        f"{r['model_bytes'] / 1e9:.3f} GB stored, {r['model_bytes_float32'] / 1e9:.3f} GB as float32"
    )
    print(f"node limit: {r['largest_node_limit_bytes'] / 1e9:.3f} GB each ({r['limit_rule']})")
    for n in r["nodes"]:
        print(
            f"  {n['node']}: layers {n['layers']}, weights {n['weight_bytes'] / 1e9:.3f} GB "
            f"({n['weight_share']:.0%}), runner peak RSS {n['runner_peak_rss_bytes'] / 1e9:.3f} GB of "
            f"{n['limit_bytes'] / 1e9:.3f} GB{' OVER' if n['rss_over_limit'] else ''}"
        )
    print(
        f"nodes_over_limit {r['nodes_over_limit']}, tokens_generated {r['tokens_generated']} "
        f"in {r['generate_s']} s, ready {r['place_to_ready_s']} s after placing, total {r['total_s']} s"
    )
