"""The commands that run on this machine alone: `shardline generate` (a local pipeline of runner processes,
or one request through a cluster with --cluster) and `shardline up` (a local cluster of node daemons)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardline.cli.cluster import DEFAULT_PORT, add_credential_args, credentials, generate_on_cluster
from shardline.cli.common import (
    MODEL_HELP,
    CliError,
    add_prefix_cache_arg,
    add_sampling_args,
    encode_prompt,
    positive,
    stream_tokens,
    wait_for_signal,
)
from shardline.instance import settings

if TYPE_CHECKING:
    from shardline.engine.engine import EngineConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one local runner process each")
    p.add_argument(
        "--tp", type=int, default=1, help="runners per stage: a tensor-parallel group of this size (1: none)"
    )
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="runners per stage: an expert-parallel group of this size, each holding whole experts of a "
        "mixture of experts (instead of --tp)",
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

    if args.ep is not None and args.tp != 1:
        raise CliError("--tp and --ep ask for different groups: give one")
    experts = args.ep is not None
    return EngineConfig(
        model_dir=model_dir,
        stages=args.stages,
        tp=positive(args.ep if experts else args.tp, "--ep" if experts else "--tp"),
        group_kind="expert" if experts else "tensor",
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


def start_nodes(
    count: int,
    base_dir: Path,
    port: int,
    extra: list[str] | None = None,
    quiet: bool = True,
    api_port: int | None = None,
    creds: Any = None,
    tls_root: Path | None = None,
) -> tuple[list[subprocess.Popen], str]:
    """`count` node daemons on loopback; the first listens on `port`, the others name it as a peer. Node i
    serves HTTP on api_port + i (none when api_port is None). The key (creds) reaches them in their
    environment; with tls_root, node i uses the TLS folder tls_root/nodes/node-i."""
    first = f"{'tls' if tls_root else 'tcp'}/127.0.0.1:{port}"
    env = {**os.environ, **(creds.env() if creds is not None else {})}
    env.pop("SHARDLINE_TLS_DIR", None)  # each node has its own folder
    procs = []
    for i in range(count):
        listen = first if i == 0 else "tcp/127.0.0.1:0"
        argv = [sys.executable, "-m", "shardline", "node", "--listen", listen, "--name", f"node-{i}"]
        argv += ["--data-dir", str(base_dir / f"node-{i}"), "--threads", "1", *(extra or [])]
        argv += ["--no-api"] if api_port is None else ["--api-port", str(api_port + i)]
        if tls_root is not None:
            argv += ["--tls", str(tls_root / "nodes" / f"node-{i}")]
        if i:
            argv += ["--peer", first]
        out = subprocess.DEVNULL if quiet else None
        procs.append(subprocess.Popen(argv, stdout=out, start_new_session=True, env=env))
    return procs, first


def stop_nodes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM (each node stops its runners), then SIGKILL what is left of each process group."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def cmd_up(args: argparse.Namespace) -> int:
    from platformdirs import user_data_dir

    from shardline.cluster.client import ClusterClient
    from shardline.models.registry import resolve_model
    from shardline.trust import ca
    from shardline.trust.credentials import Credentials

    positive(args.nodes, "--nodes")
    creds = credentials(args)  # the key, if one is given; TLS is made here when asked for
    model_dir = resolve_model(args.model)  # import the model once, before any node reports it
    base = Path(args.data_dir or Path(user_data_dir("shardline")) / "up")
    tls_root = None
    if args.make_tls:
        tls_root = base / "tls"
        shutil.rmtree(tls_root, ignore_errors=True)  # a fresh CA per run: nothing old is trusted
        ca.init(tls_root, [f"node-{i}" for i in range(args.nodes)])
        creds = Credentials(creds.key, tls_root / "nodes" / "client")
    from shardline.node.durable import ELECTION_FILE

    # `up` starts every node of its cluster at once: they form a fresh membership of these N (a run with
    # fewer nodes than the last must not wait for members that will never start).
    for i in range(args.nodes):
        (base / f"node-{i}" / ELECTION_FILE).unlink(missing_ok=True)
    extra = ["--models-dir", str(model_dir.parent), *node_flags(args)]
    procs, endpoint = start_nodes(
        args.nodes, base, args.port, extra, not args.verbose, args.api_port, creds, tls_root
    )
    try:
        with ClusterClient([endpoint], credentials=creds) as client:
            try:
                client.wait(lambda v: sum(n.alive for n in v.nodes) >= args.nodes, 60, f"{args.nodes} nodes")
                reply = client.place(model_dir.name)
                assert reply.instance is not None
                rec = client.wait_ready(reply.instance.instance, args.timeout)
            except Exception as exc:
                raise CliError(str(exc)) from exc
            stages = ", ".join(f"{s.node_id}[{s.start},{s.end})" for s in rec.stages)
            api = f"http://127.0.0.1:{args.api_port}"
            print(
                f"shardline: {model_dir.name} ready on {args.nodes} nodes ({stages}); OpenAI, Anthropic and "
                f"Ollama APIs on {api} (node i on port {args.api_port} + i), the dashboard at {api}/. Try:",
                curl_line(api, rec.model),
                sep="\n",
                flush=True,
            )
            if args.ask:
                _ask(client, rec.instance, model_dir, args.ask)
                print("shardline: serving until Ctrl-C", flush=True)
            wait_for_signal()
    finally:
        stop_nodes(procs)
    return 0


def node_flags(args: argparse.Namespace) -> list[str]:
    """The flags of `shardline up` that each node it starts takes as its own."""
    return ["--no-prefix-cache"] if args.no_prefix_cache else []


def curl_line(api: str, model: str, prompt: str = "Name the capital of France.") -> str:
    messages = [{"role": "user", "content": prompt}]
    body = json.dumps({"model": model, "stream": True, "temperature": 0, "messages": messages})
    return f"curl -N {api}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def _ask(client: Any, instance: str, model_dir: Path, prompt: str) -> None:
    """Stream one answer through this client's front (the demo of `make run`)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    print(f"> {prompt}", flush=True)
    ids = encode_prompt(tokenizer, prompt, raw=False)
    handle = client.front(instance).submit(ids, max_tokens=256, stop_tokens=list(tokenizer.eos_token_ids))
    stream_tokens(handle, tokenizer)


def add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="stream an answer from a local pipeline of runner processes")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    add_sampling_args(gen, temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the best")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument(
        "--cluster", metavar="ENDPOINT", default=None, help="send through a cluster (e.g. tcp/127.0.0.1:7447)"
    )
    gen.add_argument("--namespace", default="shardline", help="the cluster's namespace (with --cluster)")
    add_credential_args(gen)
    gen.add_argument("prompt", help="the text to answer")
    gen.set_defaults(func=cmd_generate)


def add_up(sub: Any) -> None:
    up = sub.add_parser("up", help="a local cluster of N node daemons serving a model")
    up.add_argument("--nodes", type=int, default=2, help="node daemons to start on this machine")
    up.add_argument("--model", default=None, help=MODEL_HELP)
    up.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="cluster port of the first node (the others join it)"
    )
    up.add_argument("--api-port", type=int, default=8000, help="node i serves HTTP on this port + i")
    up.add_argument(
        "--data-dir", type=Path, default=None, help="node i keeps its identity and logs in DIR/node-i"
    )
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the model to be ready")
    up.add_argument("--ask", default=None, help="once ready, stream the answer to this prompt")
    add_prefix_cache_arg(up)
    up.add_argument(
        "--tls",
        dest="make_tls",
        action="store_true",
        help="every link over TLS: a fresh cluster CA and node certificates",
    )
    up.add_argument(
        "--cluster-key-file",
        type=Path,
        default=None,
        help="file (mode 600) holding a shared secret the nodes require (default: $SHARDLINE_CLUSTER_KEY)",
    )
    up.set_defaults(func=cmd_up)
