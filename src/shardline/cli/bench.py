"""`shardline bench`: each benchmark's flags, checked here, and its run in shardline.bench."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardline.cli.common import MODEL_HELP, CliError, positive

JSON_HELP = "write the results to this file"


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from shardline.bench.engine import run

    run(model=args.model, json_path=args.json, quick=args.quick, pairs=positive(args.rounds, "--rounds"))
    return 0


def cmd_bench_arch(args: argparse.Namespace) -> int:
    from shardline.bench.arch import run

    rounds = None if args.rounds is None else positive(args.rounds, "--rounds")
    run(json_path=args.json, quick=args.quick, rounds=rounds, engine=args.engine)
    return 0


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from shardline.bench.tp import run

    run(json_path=args.json, rounds=positive(args.rounds, "--rounds"), quick=args.quick)
    return 0


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from shardline.bench.moe import run

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


def cmd_bench_extract(args: argparse.Namespace) -> int:
    from shardline.bench.extract import CLIENTS, run

    positive(args.max_tokens, "--max-tokens")
    positive(args.concurrency, "--concurrency")
    clients = tuple(args.clients.split(",")) if args.clients else CLIENTS
    run(args.model, args.json, args.max_tokens, args.concurrency, clients, args.tasks)
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

    from shardline.bench.scale import SPECS, run

    positive(args.tokens, "--tokens")
    if not 0 < args.fraction < 1:
        raise CliError(f"--fraction must be between 0 and 1, got {args.fraction}")
    base = SPECS[args.arch]
    if args.ep is not None and (args.ep < 2 or not base.experts):
        raise CliError("--ep asks a mixture of experts (--arch qwen3_moe) for expert groups of 2 or more")
    layers = positive(args.layers, "--layers") if args.layers is not None else base.layers
    spec = replace(base, layers=layers, bits=args.bits, dtype=args.dtype or base.dtype)
    try:
        spec.check()
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    run(json_path=args.json, spec=spec, fraction=args.fraction, tokens=args.tokens, ep=args.ep)
    return 0


def _counts(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(positive(int(x), flag) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise CliError(f"{flag} takes counts separated by commas, e.g. 1,8 ({exc})") from exc


def cmd_bench_products(args: argparse.Namespace) -> int:
    import os

    from shardline.bench.products import run

    rows = _counts(args.rows, "--rows")
    threads = _counts(args.threads, "--threads") if args.threads else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads and max(threads) > cores:
        raise CliError(f"--threads {max(threads)}: this process may use {cores} cores")
    rounds = positive(args.rounds, "--rounds")
    run(json_path=args.json, rows=rows, threads=threads, rounds=rounds, quick=args.quick)
    return 0


def cmd_bench_llama_cpp(args: argparse.Namespace) -> int:
    from shardline.bench.llama_cpp import main

    return main(args.build, args.jobs)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from shardline.bench.soak import run
    from shardline.bench.soak_faults import fault_kinds, use_netns

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


def add_commands(sub: Any) -> None:
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
    bar = bsub.add_parser(
        "arch", help="one stream through 1 and 2 stages of six kinds of architecture, against mlx-lm"
    )
    bar.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bar.add_argument("--quick", action="store_true", help="small models, one round: a smoke run")
    bar.add_argument(
        "--rounds", type=int, default=None, help="interleaved mlx-lm / S=1 / S=2 rounds (3; --quick: 1)"
    )
    bar.add_argument(
        "--engine", action="store_true", help="also S=2 through the engine's runner processes (about +1 min)"
    )
    bar.set_defaults(func=cmd_bench_arch)
    btp = bsub.add_parser(
        "tp", help="one stream on a tensor-parallel group of 2 against one runner and a 2-stage pipeline"
    )
    btp.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    btp.add_argument("--rounds", type=int, default=2, help="rounds of single, tp2, pp2, single")
    btp.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke run")
    btp.set_defaults(func=cmd_bench_tp)
    bmoe = bsub.add_parser(
        "moe", help="a MoE model in an expert group of 2 against one runner and a tensor group of 2"
    )
    bmoe.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bmoe.add_argument("--rounds", type=int, default=2, help="rounds of single, ep2, ep2_routed, tp2, single")
    bmoe.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke run")
    bmoe.set_defaults(func=cmd_bench_moe)
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
    bx = bsub.add_parser(
        "extract",
        help="share of instructor, langchain and pydantic-ai extractions that finish, open/closed",
    )
    bx.add_argument("--model", default=None, help=MODEL_HELP)
    bx.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bx.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    bx.add_argument("--concurrency", type=int, default=4, help="extractions in flight at once")
    bx.add_argument("--clients", default=None, help="comma-separated subset of the clients (default: all)")
    bx.add_argument("--tasks", type=int, default=None, help="only the first N tasks")
    bx.set_defaults(func=cmd_bench_extract)
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
    bsc.add_argument(
        "--arch",
        choices=["llama", "qwen3_moe"],
        default="llama",
        help="llama (32 layers, 3.6 GB as float32) or a mixture of experts: qwen3_moe (24 layers, "
        "48 experts of which 8 route, 1.47 GB at 4 bits)",
    )
    bsc.add_argument(
        "--ep",
        type=int,
        default=None,
        help="ask for expert groups of this many nodes (qwen3_moe; default: placement chooses)",
    )
    bsc.add_argument("--bits", type=int, default=4, help="quantization bits of the synthetic model (0: none)")
    bsc.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="of its scales, biases and norms (default float32: MLX's fast CPU path today)",
    )
    bsc.add_argument(
        "--layers", type=int, default=None, help="layers of the synthetic model (default: 32 llama, 24 moe)"
    )
    bsc.add_argument(
        "--fraction", type=float, default=0.5, help="each node's limit: this much of the weights"
    )
    bsc.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    bsc.set_defaults(func=cmd_bench_scale)
    bp = bsub.add_parser(
        "products",
        help="one weight product per decode shape: GGUF's own blocks against MLX affine (GB/s, bandwidth)",
    )
    bp.add_argument("--json", type=Path, default=None, help=JSON_HELP)
    bp.add_argument("--rows", default="1,8", help="rows of x (tokens) per product, comma-separated")
    bp.add_argument(
        "--threads", default=None, help="thread counts, comma-separated (default: 1 and every core)"
    )
    bp.add_argument("--rounds", type=int, default=3, help="rounds, the two products alternating in each")
    bp.add_argument("--quick", action="store_true", help="one tiny shape, one round: a smoke run")
    bp.set_defaults(func=cmd_bench_products)
    bl = bsub.add_parser(
        "llama-cpp", help="build llama.cpp's llama-bench, llama-perplexity, llama-tokenize (the reference)"
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
