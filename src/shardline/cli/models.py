"""`shardline models`: pull, list and synthesise the models in the local cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardline.cli.common import CliError


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


def add_commands(sub: Any) -> None:
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
