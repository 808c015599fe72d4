"""The `shardline` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.cli.common import CliError, add_prefix_cache_arg, encode_prompt, positive, stream_tokens
from shardline.instance import settings

if TYPE_CHECKING:
    from shardline.engine.engine import EngineConfig

MODEL_HELP = "model name or mlx-lm model directory (default: the built-in model)"
JSON_HELP = "write the results to this file"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one local runner process each")
    p.add_argument(
        "--tp", type=int, default=1, help="runners per stage: a tensor-parallel group of this size (1: none)"
    )
    p.add_argument(
        "--prefill-step",
        type=int,
        default=settings.default("prefill_step"),
        help="prompt tokens per prefill chunk",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=settings.default("step_timeout"),
        help="ceiling of the step deadline in seconds (deadlines scale with each step and measured speed)",
    )
    add_prefix_cache_arg(p)


def resolve(model: str | None) -> Path:
    from shardline.models.registry import resolve_model

    return resolve_model(model)


def engine_config(args: argparse.Namespace, model_dir: Path) -> EngineConfig:
    """A local pipeline's settings from the engine flags (_add_engine_args)."""
    from shardline.engine.engine import EngineConfig

    return EngineConfig(
        model_dir=model_dir,
        stages=args.stages,
        tp=positive(args.tp, "--tp"),
        prefill_step=args.prefill_step,
        step_timeout=args.step_timeout,
        prefix_cache=not args.no_prefix_cache,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from shardline.compute.sampling import SamplingParams
    from shardline.engine.engine import Engine

    positive(args.stages, "--stages")
    positive(args.prefill_step, "--prefill-step")
    positive(args.max_tokens, "--max-tokens")
    model_dir = resolve(args.model)
    tokenizer = load_tokenizer(model_dir)
    ids = encode_prompt(tokenizer, args.prompt, args.raw)
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        **({"seed": args.seed} if args.seed is not None else {}),
    )
    stops = list(tokenizer.eos_token_ids)
    if args.cluster:
        from shardline.cli.cluster import generate_on_cluster

        return generate_on_cluster(
            args, model_dir.name, ids, sampling, stops, lambda h: stream_tokens(h, tokenizer)
        )
    engine = Engine(engine_config(args, model_dir))
    try:
        engine.start()
        handle = engine.submit(ids, max_tokens=args.max_tokens, sampling=sampling, stop_tokens=stops)
        stream_tokens(handle, tokenizer)
    finally:
        engine.shutdown()
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from shardline.models.registry import DEFAULT_MODEL, pull

    path = pull(args.name or DEFAULT_MODEL, progress=True, weights=args.dtype)
    print(path)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from shardline.models.registry import KNOWN_MODELS, cache_dir, cached_models
    from shardline.models.store.formats import import_label
    from shardline.models.synth import is_synthetic

    for name in KNOWN_MODELS:
        path = cache_dir() / name
        present = (path / "config.json").exists()
        label = import_label(path) if present else ""
        print(f"{name}\t{'pulled' if present else 'not pulled'}" + (f"\t{label}" if label else ""))
    for name in cached_models():
        if name not in KNOWN_MODELS:
            print(f"{name}\t{'synthetic' if is_synthetic(cache_dir() / name) else 'local'}")
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cmd_models_synth(args: argparse.Namespace) -> int:
    from shardline.models.registry import NAME_PATTERN, cache_dir
    from shardline.models.store.manifest import record_import
    from shardline.models.synth import SynthSpec, weight_sizes, write_synth_model

    if not NAME_PATTERN.fullmatch(args.name):
        raise CliError(f"{args.name!r} is not a model name (letters, digits, . _ + -)")
    dtype = args.dtype or ("float16" if args.bits else "float32")
    spec = SynthSpec(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        bits=args.bits,
        group_size=args.group_size,
        dtype=dtype,
        context=args.context,
        tied=args.tied,
        seed=args.seed,
    )
    target = (args.models_dir or cache_dir()) / args.name
    path = write_synth_model(target, spec, progress=True, overwrite=args.force)
    record_import(path, args.name, replace=True)  # its digests, as an import records them: nodes can serve it
    sizes = weight_sizes(path)
    quant = f"{spec.bits}-bit, groups of {spec.group_size}, {dtype} scales" if spec.bits else dtype
    print(
        f"{path}: synthetic llama ({quant}), {sizes['parameters'] / 1e6:.1f}M parameters, "
        f"{_size(sizes['stored_bytes'])} of weights ({_size(sizes['float32_bytes'])} as float32); "
        "random weights: for speed and memory benchmarks only"
    )
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from shardline.bench.engine import run

    run(model=args.model, json_path=args.json, quick=args.quick, pairs=positive(args.rounds, "--rounds"))
    return 0


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from shardline.bench.tp import run

    run(json_path=args.json, rounds=positive(args.rounds, "--rounds"), quick=args.quick)
    return 0


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from shardline.bench.attention import run

    run(model=args.model, json_path=args.json, rounds=positive(args.rounds, "--rounds"))
    return 0


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    from shardline.bench.chaos import run

    positive(args.requests, "--requests")
    if args.stages not in (2, 3):
        raise CliError(f"--stages must be 2 or 3, got {args.stages}")
    run(model=args.model, json_path=args.json, requests=args.requests, seed=args.seed, stages=args.stages)
    return 0


def cmd_bench_resume(args: argparse.Namespace) -> int:
    from shardline.bench.resume import run

    run(model=args.model, json_path=args.json)
    return 0


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from shardline.bench.cluster import run

    run(model=args.model, json_path=args.json, tls=args.tls)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from shardline.bench.serve import run

    positive(args.clients, "--clients")
    positive(args.max_tokens, "--max-tokens")
    positive(args.pairs, "--pairs")
    run(
        model=args.model,
        json_path=args.json,
        clients=args.clients,
        max_tokens=args.max_tokens,
        pairs=args.pairs,
    )
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from shardline.bench.quality import run

    try:
        stages = [positive(int(x), "--stages") for x in args.stages.split(",") if x.strip()]
    except ValueError as exc:
        raise CliError(f"--stages takes stage counts separated by commas, e.g. 1,2 ({exc})") from exc
    positive(args.ctx, "--ctx")
    if args.chunks is not None:
        positive(args.chunks, "--chunks")
    run(
        model=args.model,
        text_file=args.text,
        stages=stages,
        ctx=args.ctx,
        chunks=args.chunks,
        gguf=args.gguf,
        json_path=args.json,
    )
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from shardline.bench.scale import BENCH_SPEC, run

    positive(args.tokens, "--tokens")
    if not 0 < args.fraction < 1:
        raise CliError(f"--fraction must be between 0 and 1, got {args.fraction}")
    dtype = args.dtype or BENCH_SPEC.dtype
    spec = replace(BENCH_SPEC, layers=positive(args.layers, "--layers"), bits=args.bits, dtype=dtype)
    spec.check()
    run(json_path=args.json, spec=spec, fraction=args.fraction, tokens=args.tokens)
    return 0


def cmd_bench_llama_cpp(args: argparse.Namespace) -> int:
    from shardline.bench.llama_cpp import main

    return main(args.build, args.jobs)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from shardline.bench.soak import fault_kinds, run, use_netns

    minutes = args.seconds / 60 if args.seconds is not None else args.minutes
    if not minutes > 0:
        raise CliError("--minutes (or --seconds) must be > 0")
    if args.nodes < 2:
        raise CliError(f"--nodes must be at least 2, got {args.nodes}")
    if args.concurrency is not None:
        positive(args.concurrency, "--concurrency")
    model = None if args.model in (None, "default") else args.model
    if args.fault_interval is not None and not args.fault_interval > 0:
        raise CliError("--fault-interval must be > 0")
    try:
        netns = use_netns(args.netns)
        kinds = [k.strip() for k in args.faults.split(",") if k.strip()] if args.faults is not None else None
        faults = fault_kinds(kinds, netns, args.nodes)
    except (RuntimeError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    run(
        minutes,
        args.nodes,
        args.json,
        model,
        args.concurrency,
        args.seed,
        args.max_tokens,
        args.fault_interval,
        netns,
        faults,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer from a local pipeline of runner processes")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among this many best tokens (0: all)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the best")
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="penalise tokens already seen (1: none)"
    )
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument(
        "--cluster", metavar="ENDPOINT", default=None, help="send through a cluster (e.g. tcp/127.0.0.1:7447)"
    )
    gen.add_argument("--namespace", default="shardline", help="the cluster's namespace (with --cluster)")
    from shardline.cli.cluster import add_commands, add_credential_args

    add_credential_args(gen)
    gen.add_argument("prompt", help="the text to answer")
    gen.set_defaults(func=cmd_generate)

    add_commands(sub)

    models = sub.add_parser("models", help="manage local models")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="import a known model into the local cache")
    pull.add_argument("name", nargs="?", default=None, help="a known model (default: the built-in one)")
    pull.add_argument(
        "--dtype",
        choices=["quantized", "float32"],
        default=None,
        help="quantized: GGUF quantized matrices stay quantized (MLX affine, the default for a new import); "
        "float32: every weight dequantized (4-8x the bytes). Imports again when the cached copy differs",
    )
    pull.set_defaults(func=cmd_models_pull)
    lst = msub.add_parser("list", help="known models, and the other models in the cache")
    lst.set_defaults(func=cmd_models_list)
    syn = msub.add_parser(
        "synth", help="write a random-weight llama of any size (speed and memory benchmarks only)"
    )
    syn.add_argument("name", help="the model's name (its directory in the models directory)")
    syn.add_argument("--layers", type=int, default=28, help="transformer layers")
    syn.add_argument("--hidden", type=int, default=1536, help="hidden size")
    syn.add_argument("--intermediate", type=int, default=4096, help="MLP intermediate size")
    syn.add_argument("--heads", type=int, default=12, help="attention heads")
    syn.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    syn.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    syn.add_argument("--context", type=int, default=4096, help="max_position_embeddings")
    syn.add_argument("--bits", type=int, default=4, help="MLX affine quantization bits (0: none)")
    syn.add_argument("--group-size", type=int, default=32, help="quantization group size")
    syn.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="of scales, biases, norms (and weights with --bits 0); default: float16, float32 with --bits 0",
    )
    syn.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    syn.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    syn.add_argument("--models-dir", type=Path, default=None, help="where to write it (default: the cache)")
    syn.add_argument("--force", action="store_true", help="replace a model of that name")
    syn.set_defaults(func=cmd_models_synth)

    bench = sub.add_parser("bench", help="benchmarks, reported as ratios against a side-by-side baseline")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    be = bsub.add_parser(
        "engine", help="decode, prefill overlap, activation memory, batched streams, against mlx-lm"
    )
    be.add_argument("--model", default=None, help=MODEL_HELP)
    be.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    be.add_argument("--quick", action="store_true", help="smaller prompts, for a fast smoke run")
    be.add_argument("--rounds", type=int, default=3, help="alternating baseline / engine rounds")
    be.set_defaults(func=cmd_bench_engine)
    btp = bsub.add_parser(
        "tp", help="one stream on a tensor-parallel group of 2 against one runner and a 2-stage pipeline"
    )
    btp.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    btp.add_argument("--rounds", type=int, default=2, help="rounds of single, tp2, pp2, single")
    btp.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke run")
    btp.set_defaults(func=cmd_bench_tp)
    ba = bsub.add_parser("attention", help="a prefill chunk's attention: the runner's kernel against MLX's")
    ba.add_argument("--model", default=None, help=MODEL_HELP)
    ba.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    ba.add_argument("--rounds", type=int, default=3, help="alternating rounds over the kernels")
    ba.set_defaults(func=cmd_bench_attention)
    bc = bsub.add_parser("chaos", help="requests while stages are killed, stalled and aborted at random")
    bc.add_argument("--model", default=None, help=MODEL_HELP)
    bc.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bc.add_argument("--requests", type=int, default=8, help="requests to run through the faults")
    bc.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    bc.add_argument("--stages", type=int, default=2, help="pipeline stages (2 or 3)")
    bc.set_defaults(func=cmd_bench_chaos)
    br = bsub.add_parser("resume", help="pause and exactness of exact vs fast resume after a SIGKILL")
    br.add_argument("--model", default=None, help=MODEL_HELP)
    br.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    br.set_defaults(func=cmd_bench_resume)
    bcl = bsub.add_parser("cluster", help="join, master failover and node loss times on loopback daemons")
    bcl.add_argument("--model", default=None, help=MODEL_HELP)
    bcl.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bcl.add_argument(
        "--tls", action="store_true", help="every link over TLS, and the node kill also on a plain cluster"
    )
    bcl.set_defaults(func=cmd_bench_cluster)
    bs = bsub.add_parser(
        "serve", help="streaming clients over HTTP against the Python API, on a 2-node cluster"
    )
    bs.add_argument("--model", default=None, help=MODEL_HELP)
    bs.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bs.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    bs.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    bs.add_argument("--pairs", type=int, default=3, help="alternating HTTP / Python API rounds")
    bs.set_defaults(func=cmd_bench_serve)
    bq = bsub.add_parser(
        "quality", help="perplexity of a text through the engine's stages, scored as llama-perplexity"
    )
    bq.add_argument("--model", default=None, help=MODEL_HELP)
    bq.add_argument("--text", type=Path, required=True, help="a UTF-8 text file (at least 2 x ctx tokens)")
    bq.add_argument("--stages", default="1,2", help="stage counts to compare, e.g. 1,2")
    bq.add_argument("--ctx", type=int, default=512, help="window of tokens; its second half is scored")
    bq.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    bq.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="llama.cpp's reference on this GGUF (default: the model's source)",
    )
    bq.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bq.set_defaults(func=cmd_bench_quality)
    bsc = bsub.add_parser(
        "scale", help="a synthetic model larger than any node's memory limit, across 3 local nodes"
    )
    bsc.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bsc.add_argument("--bits", type=int, default=4, help="quantization bits of the synthetic model (0: none)")
    bsc.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="of its scales, biases and norms (default float32: MLX's fast CPU path today)",
    )
    bsc.add_argument("--layers", type=int, default=32, help="layers of the synthetic model (~28M each)")
    bsc.add_argument(
        "--fraction", type=float, default=0.5, help="each node's limit: this much of the weights"
    )
    bsc.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    bsc.set_defaults(func=cmd_bench_scale)
    bl = bsub.add_parser(
        "llama-cpp", help="build llama.cpp's llama-bench and llama-perplexity (the reference)"
    )
    bl.add_argument("--build", action="store_true", help="fetch and build them now (about 10 minutes)")
    bl.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    bl.set_defaults(func=cmd_bench_llama_cpp)
    bso = bsub.add_parser(
        "soak", help="minutes of HTTP load through every node of a local cluster, with chaos"
    )
    bso.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    bso.add_argument("--seconds", type=float, default=None, help="instead of --minutes (smoke runs)")
    bso.add_argument("--nodes", type=int, default=3, help="node daemons of the local cluster")
    bso.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bso.add_argument("--model", default=None, help="default, tiny (a tiny random model), or a name or path")
    bso.add_argument("--concurrency", type=int, default=None, help="client threads (default: 2 per node)")
    bso.add_argument("--seed", type=int, default=0, help="seed of the prompts and the faults")
    bso.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default: the bench's)")
    bso.add_argument(
        "--fault-interval", type=float, default=None, help="mean seconds between faults (default 60)"
    )
    bso.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each node in its own network namespace, clients in another, with link flaps "
        "(default: on where namespaces work, i.e. as root)",
    )
    bso.add_argument(
        "--faults",
        default=None,
        help="fault kinds, comma-separated: node_kill, node_stop, runner_stop, abusive_client (a client "
        "sending the largest bodies the API takes, 1/s throughout), link_flap and partition (need --netns; "
        "partition: the master and one node cut off from the rest) (default: all)",
    )
    bso.set_defaults(func=cmd_bench_soak)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    from pydantic import ValidationError

    from shardline.errors import EngineError, OverloadError, RequestError
    from shardline.models.errors import ModelError

    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nshardline: interrupted", file=sys.stderr)
        return 130
    except (
        CliError,
        ModelError,
        EngineError,
        OverloadError,
        RequestError,
        ValueError,
        ValidationError,
        OSError,
    ) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"shardline: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
