"""The commands that run or reach a cluster: `shardline node` (this machine's daemon), `cluster` (its TLS
certificates and membership), `place`, and generating through a cluster (`generate --cluster`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline.cli.common import CliError, add_prefix_cache_arg, positive, wait_for_signal
from shardline.instance import settings

DEFAULT_PORT = 7447


def credentials(args: argparse.Namespace) -> Any:
    """The key (--cluster-key-file, else $SHARDLINE_CLUSTER_KEY) and TLS folder (--tls DIR, else
    $SHARDLINE_TLS_DIR) this command joins the cluster with."""
    from shardline.trust.credentials import CredentialsError, resolve

    try:
        return resolve(getattr(args, "cluster_key_file", None), getattr(args, "tls", None))
    except CredentialsError as exc:
        raise CliError(str(exc)) from exc


def add_credential_args(parser: argparse.ArgumentParser) -> None:
    """The flags every command that joins a cluster takes (the key itself is never a flag: it would show
    in the process list)."""
    parser.add_argument(
        "--cluster-key-file",
        type=Path,
        default=None,
        help="file (mode 600) holding the cluster's shared secret (default: $SHARDLINE_CLUSTER_KEY)",
    )
    parser.add_argument(
        "--tls",
        type=Path,
        default=None,
        metavar="DIR",
        help="TLS folder from `shardline cluster init` (ca.pem, node.pem, node.key); links become tls/",
    )


def runner_settings(args: argparse.Namespace) -> Any:
    """The instance settings `shardline node` runs its instances with: --runner-settings, then the flags."""
    from shardline.node.config import ClusterInstanceSettings

    for value, flag in (
        (args.prefill_step, "--prefill-step"),
        (args.max_queue, "--max-queue"),
        (args.max_batch, "--max-batch"),
    ):
        positive(value, flag)
    update: dict[str, Any] = {
        "prefill_step": args.prefill_step,
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
    }
    if args.no_prefix_cache:  # only when given: {"prefix_cache": false} in --runner-settings stands
        update["prefix_cache"] = False
    return ClusterInstanceSettings.model_validate_json(args.runner_settings or "{}").model_copy(update=update)


def cmd_node(args: argparse.Namespace) -> int:
    from shardline.node.allocator import bound_arenas
    from shardline.node.config import NodeConfig
    from shardline.node.daemon import Node
    from shardline.node.resources import parse_size
    from shardline.trust.exposure import open_refusal

    creds = credentials(args)
    refusal = open_refusal(
        args.listen,
        args.peer or [],
        args.multicast_interface,
        creds.key is not None or creds.tls,
        args.insecure,
    )
    if refusal is not None:
        raise CliError(refusal)
    if creds.tls_dir is not None and (why := own_certificate_refusal(creds.tls_dir)):
        raise CliError(f"{creds.tls_dir}: {why}: it cannot run a node")
    if creds.key is None and not creds.tls and args.insecure:
        print(
            "shardline: an open cluster (--insecure): anyone who reaches this node may use it",
            file=sys.stderr,
        )
    runners = runner_settings(args)
    config = NodeConfig(
        namespace=args.namespace,
        listen=args.listen,
        peers=args.peer or [],
        multicast_interface=args.multicast_interface,
        credentials=creds,
        allow_faults=args.allow_faults,
        data_dir=args.data_dir,
        models_dir=args.models_dir,
        memory_limit=parse_size(args.memory_limit) if args.memory_limit else None,
        holds_stages=not args.no_stages,
        name=args.name,
        threads=args.threads,
        compute_score=args.compute_score,
        lease_ms=args.lease_ms,
        runners=runners,
        api=None if args.no_api else api_settings(args),
    )
    bound_arenas()  # before the node's threads start
    node = Node(config).start()
    api = f", HTTP API on {node.api.url}" if node.api is not None else ""
    print(f"shardline node {node.node_id} ({node.name}) listening on {node.endpoint}{api}", flush=True)
    try:
        wait_for_signal()
    finally:
        node.close()
    return 0


def own_certificate_refusal(tls_dir: Path) -> str | None:
    """Why this TLS folder's certificate may not run a node (a client's, revoked, or without a role)."""
    from cryptography import x509

    from shardline.trust import roles
    from shardline.trust.credentials import CERT_FILE, CredentialsError

    try:
        cert = x509.load_pem_x509_certificate((tls_dir / CERT_FILE).read_bytes())
        return roles.refusal(cert, roles.NODE, roles.revoked_serials(tls_dir))
    except (OSError, ValueError, CredentialsError) as exc:
        return str(exc)


def api_settings(args: argparse.Namespace) -> Any:
    from shardline.api.service import ApiSettings

    return ApiSettings(
        host=args.api_host,
        port=args.api_port,
        api_key=args.api_key or os.environ.get("SHARDLINE_API_KEY") or None,
        cors_origins=args.cors_origin or [],
        allowed_hosts=args.allowed_host or [],
        auto_place=not args.no_auto_place,
        max_pending=args.max_pending,
        structured_objects=args.structured_objects,
    )


def placed_name(model: str) -> tuple[str, str]:
    """(name, source) to place: a hub repository (one node downloads it for the cluster), a local GGUF file
    or model directory (imported into this machine's model cache, whose node serves it by name), or a name."""
    from shardline.cluster.downloads import named
    from shardline.models.registry import cache_dir, resolve_model

    path = Path(model).expanduser()
    if not path.exists():
        return named(model)
    local = resolve_model(path)
    if local.parent != cache_dir().resolve():
        raise CliError(
            f"{model} is a model directory outside the model cache, which nodes do not serve: "
            "copy it into the models directory of a node (or give a GGUF file, which is imported there)"
        )
    return local.name, ""


def show_download(d: Any, p: Any) -> None:
    """One line, rewritten in place, while a node downloads the model for the cluster."""
    if p is None:
        what = "starting"
    elif p.total_bytes:
        what = f"{p.phase} {p.done_bytes / p.total_bytes:.0%} of {p.total_bytes / 1e9:.2f} GB"
    else:
        what = f"{p.phase} {p.done_bytes / 1e6:.0f} MB"
    print(f"\rnode {d.node_id} downloads {d.source}: {what}   ", end="", file=sys.stderr, flush=True)


def cmd_place(args: argparse.Namespace) -> int:
    from shardline.cluster.client import ClusterClient
    from shardline.cluster.placement import PlacementRequest
    from shardline.instance.generation import generation_label

    for value, flag in ((args.tp, "--tp"), (args.ep, "--ep"), (args.stages, "--stages")):
        if value is not None:
            positive(value, flag)
    if args.tp is not None and args.ep is not None:
        raise CliError("--tp and --ep ask for different groups: give one")
    request = PlacementRequest(
        sequences=args.sequences,
        reserve_tokens=args.reserve_tokens,
        tensor_parallel=args.tp,
        expert_parallel=args.ep,
        max_stages=args.stages,
    )
    name, source = placed_name(args.model)
    with ClusterClient([args.cluster], args.namespace, credentials(args)) as client:
        reply = client.place(name, request, dry_run=args.dry_run, source=source, on_download=show_download)
        assert reply.placement is not None
        if not any(r.member for r in reply.runners):
            for k, a in enumerate(reply.placement.stages):
                print(
                    f"stage {k}: node {a.node_id} layers [{a.start}, {a.end}) needs "
                    f"{a.need_bytes / 1e9:.2f} GB of {a.available_bytes / 1e9:.2f} GB"
                )
        else:
            for r in reply.runners:
                stage = r.ring if r.ring is not None else reply.runners.index(r)
                role = "face" if r.member == 0 else f"member {r.member}"
                # An expert group's map is on its face's record (the faces come first, in ring order).
                row = next((x for x in reply.runners[stage].expert_owners if x), [])
                held = f"{row.count(r.member)} of {len(row)} experts a MoE layer" if row else "1/k of each"
                print(f"stage {stage} {role}: node {r.node_id} layers [{r.start}, {r.end}), {held}")
        if reply.layout:
            print(f"layout: {reply.layout}")
        if not args.dry_run and reply.instance is not None:
            rec = client.wait_ready(reply.instance.instance, args.timeout)
            print(f"instance {rec.instance} ready (generation {generation_label(rec.generation)})")
    return 0


def cmd_cluster_init(args: argparse.Namespace) -> int:
    from shardline.trust import ca
    from shardline.trust.credentials import CredentialsError

    try:
        folders = ca.init(args.dir, args.node or ["node-0", "node-1"])
    except CredentialsError as exc:
        raise CliError(str(exc)) from exc
    print(f"cluster CA in {args.dir / 'ca'} (its ca.key stays on this machine); a TLS folder per node:")
    for f in folders:
        if f.name == "client":
            print(f"  {f}  (a client's, for commands: shardline place|generate --tls {f} ...; never a node)")
        else:
            print(f"  {f}  (copy it to machine {f.name}, then: shardline node --tls FOLDER ...)")
    return 0


def cmd_cluster_add_node(args: argparse.Namespace) -> int:
    from shardline.trust import ca
    from shardline.trust.credentials import CredentialsError

    try:
        folder = ca.add_node(args.dir, args.name, args.address, role="client" if args.client else "node")
    except (CredentialsError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    if args.client:
        print(f"{folder}: a client's (commands only): shardline place|generate --tls {folder} ...")
    else:
        print(
            f"{folder}: copy to the new machine, then `shardline node --tls FOLDER --peer tls/HOST:PORT ...`"
        )
    return 0


def cmd_cluster_forget(args: argparse.Namespace) -> int:
    from shardline.cluster.client import ClusterClient

    with ClusterClient([args.cluster], args.namespace, credentials(args)) as client:
        client.forget(args.node)
    print(f"{args.node}: removal from the membership proposed; it is committed once a quorum holds it")
    return 0


def cmd_cluster_revoke(args: argparse.Namespace) -> int:
    from shardline.trust import ca
    from shardline.trust.credentials import CredentialsError

    try:
        serial = ca.revoke(args.dir, args.name)
    except CredentialsError as exc:
        raise CliError(str(exc)) from exc
    print(
        f"revoked {args.name} (serial {serial:x}): {args.dir / 'ca' / 'crl.pem'} is copied into every folder "
        f"under {args.dir / 'nodes'}; copy it into each running node's TLS folder too"
    )
    return 0


def generate_on_cluster(
    args: argparse.Namespace,
    model: str,
    ids: list[int],
    sampling: Any,
    stops: list[int],
    stream: Callable[[Any], None],
) -> int:
    from shardline.cluster.client import ClusterClient

    with ClusterClient([args.cluster], args.namespace, credentials(args)) as client:
        view = client.wait(lambda v: True, 10, "the cluster's view")
        rec = next((r for r in view.instances if r.model == model and r.phase != "failed"), None)
        if rec is None:
            reply = client.place(model)
            assert reply.instance is not None
            rec = reply.instance
        client.wait_ready(rec.instance, 600)
        front = client.front(rec.instance)
        handle = front.submit(ids, max_tokens=args.max_tokens, sampling=sampling, stop_tokens=stops)
        stream(handle)
    return 0


def add_node(sub: Any) -> None:
    node = sub.add_parser("node", help="run this machine's node daemon (agent, weights, master when elected)")
    node.add_argument(
        "--listen", default=f"tcp/127.0.0.1:{DEFAULT_PORT}", help="endpoint for peers and runners"
    )
    node.add_argument("--peer", action="append", help="endpoint of another node (repeatable)")
    node.add_argument(
        "--namespace", default="shardline", help="clusters with different namespaces never meet"
    )
    node.add_argument(
        "--multicast-interface", default=None, help="discover peers by multicast on this interface"
    )
    add_credential_args(node)
    node.add_argument(
        "--insecure",
        action="store_true",
        help="run an open cluster (no key, no TLS) beyond loopback: anyone who reaches it may use it",
    )
    node.add_argument(
        "--allow-faults",
        action="store_true",
        help="obey commands that inject faults (tests and benches only)",
    )
    node.add_argument("--data-dir", type=Path, default=None, help="identity and logs (default: XDG data dir)")
    node.add_argument(
        "--models-dir", type=Path, default=None, help="models this node holds (default: the cache)"
    )
    node.add_argument("--memory-limit", default=None, help="memory this node offers, e.g. 24G")
    # --no-worker: the flag's first name, kept for scripts that use it
    node.add_argument(
        "--no-stages", "--no-worker", dest="no_stages", action="store_true", help="never hold a stage"
    )
    node.add_argument("--name", default=None, help="a readable name for this node (default: the host name)")
    node.add_argument("--threads", type=int, default=0, help="threads per runner (0: cores / stages)")
    node.add_argument(
        "--prefill-step",
        type=int,
        default=settings.default("prefill_step"),
        help="prompt tokens per prefill chunk",
    )
    node.add_argument(
        "--max-queue",
        type=int,
        default=settings.default("max_queue"),
        help="requests an instance's leader holds before refusing more",
    )
    node.add_argument(
        "--max-batch",
        type=int,
        default=settings.default("max_batch"),
        help="decode positions of different requests per step (1: none)",
    )
    add_prefix_cache_arg(node)
    node.add_argument("--runner-settings", default=None, help="JSON: deadlines, heartbeats, restart budget")
    node.add_argument("--lease-ms", type=int, default=2000, help="a node silent this long has left")
    node.add_argument(
        "--compute-score", type=float, default=None, help="GFLOP/s to place by (default: measured at start)"
    )
    node.add_argument("--api-port", type=int, default=8000, help="HTTP API port (0: any free port)")
    node.add_argument("--api-host", default="127.0.0.1", help="HTTP API address (0.0.0.0: every interface)")
    node.add_argument(
        "--api-key", default=None, help="require this key on the HTTP API (default: $SHARDLINE_API_KEY)"
    )
    node.add_argument(
        "--cors-origin", action="append", help="allow browsers from this origin (repeatable; *: any)"
    )
    node.add_argument(
        "--allowed-host",
        action="append",
        help="answer requests addressed to this host name too (repeatable; *: any); without --api-key on "
        "loopback, only localhost names are answered",
    )
    node.add_argument("--no-auto-place", action="store_true", help="never place a model a request names")
    node.add_argument("--max-pending", type=int, default=64, help="HTTP requests in flight before 429")
    node.add_argument(
        "--structured-objects",
        choices=["closed", "open"],
        default="closed",
        help="schema objects that do not say which other keys they take: closed (none, the default) or open",
    )
    node.add_argument("--no-api", action="store_true", help="serve no HTTP API")
    node.set_defaults(func=cmd_node)


def add_cluster(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="a cluster's TLS certificates (a CA, and one folder per node)")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    init = csub.add_parser("init", help="make a cluster CA in DIR/ca and a TLS folder per node in DIR/nodes")
    init.add_argument("dir", type=Path, help="where the CA and the node folders go")
    init.add_argument(
        "--node", action="append", default=None, help="a node's name (repeatable; default: node-0, node-1)"
    )
    init.set_defaults(func=cmd_cluster_init)
    add = csub.add_parser("add-node", help="sign a TLS folder for one more node with DIR's CA")
    add.add_argument("dir", type=Path, help="the folder `cluster init` made")
    add.add_argument("name", help="the new node's name")
    add.add_argument(
        "--address", action="append", default=None, help="an IP address the node is reached at (repeatable)"
    )
    add.add_argument("--client", action="store_true", help="a client's certificate (commands), not a node's")
    add.set_defaults(func=cmd_cluster_add_node)
    rev = csub.add_parser("revoke", help="revoke the certificate DIR/nodes/NAME (a CRL signed by DIR's CA)")
    rev.add_argument("dir", type=Path, help="the folder `cluster init` made")
    rev.add_argument("name", help="the node or client whose certificate is revoked")
    rev.set_defaults(func=cmd_cluster_revoke)
    fgt = csub.add_parser(
        "forget", help="remove a member that died for good, so it no longer counts against the quorum"
    )
    fgt.add_argument("node", help="the dead member's node id")
    fgt.add_argument(
        "--cluster", default=f"tcp/127.0.0.1:{DEFAULT_PORT}", help="endpoint of any node of the cluster"
    )
    fgt.add_argument("--namespace", default="shardline", help="the cluster's namespace")
    add_credential_args(fgt)
    fgt.set_defaults(func=cmd_cluster_forget)


def add_place(sub: Any) -> None:
    place = sub.add_parser("place", help="place a model on a running cluster (or preview with --dry-run)")
    place.add_argument("model", help="the model to place (a name some node holds)")
    place.add_argument(
        "--cluster", default=f"tcp/127.0.0.1:{DEFAULT_PORT}", help="endpoint of any node of the cluster"
    )
    place.add_argument("--namespace", default="shardline", help="the cluster's namespace")
    add_credential_args(place)
    place.add_argument(
        "--dry-run", action="store_true", help="print where the stages would go, and why; place nothing"
    )
    place.add_argument("--sequences", type=int, default=4, help="concurrent requests to reserve KV cache for")
    place.add_argument(
        "--tp",
        type=int,
        default=None,
        help="runners per stage: 1 for pipeline stages only, k for tensor-parallel groups of k (default: "
        "placement chooses from read bandwidth, links and memory)",
    )
    place.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel groups of k for a mixture-of-experts model: each member holds 1/k of every "
        "MoE layer's experts, whole (default: placement chooses)",
    )
    place.add_argument(
        "--stages", type=int, default=None, help="at most this many stages (with --tp or --ep: these)"
    )
    place.add_argument(
        "--reserve-tokens", type=int, default=None, help="KV cache tokens per sequence (default: the model's)"
    )
    place.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the instance to be ready"
    )
    place.set_defaults(func=cmd_place)
