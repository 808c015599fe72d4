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

    if not NAME_PATTERN.fullmatch(args.name):
        raise CliError(f"{args.name!r} is not a model name (letters, digits, . _ + -)")
    dtype = args.dtype or ("float16" if args.bits else "float32")
    shape = {k: getattr(args, k) for k in _SHAPE if getattr(args, k) is not None}
    spec = arch_spec(
        args.arch,
        **shape,
        vocab=args.vocab,
        bits=args.bits,
        group_size=args.group_size,
        dtype=dtype,
        context=args.context,
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
        "synth",
        help="write a random-weight llama or mixture of experts of any size (speed and memory benchmarks)",
    )
    syn.add_argument("name", help="the model's name (its directory in the models directory)")
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
