"""Footprints of every architecture of mlx-lm: layer i is mlx-lm's `model.layers[i]`, every byte counted
once, a KV figure that bounds what mlx-lm's caches take, and which layers a tensor-parallel group splits.

The tiny models of testing/arch_zoo.py are written with mlx-lm's own parameter names (those sanitize gives)
and loaded back by mlx-lm's loader, so every layer's bytes are checked against the module a stage loads.
Checkpoints as published name some tensors otherwise (multimodal prefixes, towers, next-token-prediction
layers): a few are written by hand here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from shardline.cluster.parallelism import LOOPBACK, estimate
from shardline.cluster.placement import NodeCapacity, PlacementRequest
from shardline.models.errors import CorruptModelError
from shardline.models.footprint import OLD_REPORT, ModelFootprint, footprint_from_dir
from shardline.testing import arch_zoo

# One token's bytes in each cache mlx-lm makes, after a prompt: per cache entry, attention caches only.
_MEASURE = """
import json, sys
import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache
from shardline.testing import arch_zoo
with mx.stream(mx.cpu):
    for arch in sys.argv[1:]:
        try:
            model, _ = arch_zoo.build(arch)
            cache = make_prompt_cache(model)
            model(mx.array([arch_zoo.PROMPT[:6]]), cache=cache)
        except Exception:
            continue
        entries = []
        for c in cache:
            per_token = 0.0
            for part in c.caches if isinstance(c, CacheList) else [c]:
                if not isinstance(part, ArraysCache):
                    per_token += sum(a.nbytes / a.shape[2] for a in part.state if getattr(a, "ndim", 0) == 4)
            entries.append(per_token)
        print("KV", json.dumps([arch, entries]), flush=True)
"""


@dataclass(frozen=True)
class Written:
    path: Path
    layer_bytes: list[int]  # nbytes of model.layers[i]'s parameters, as mlx-lm loads the directory
    total_bytes: int
    attention: bool  # mlx-lm makes a KV cache (full or sliding) for some layer


def _attention_caches(model: object) -> bool:
    from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

    flat = []
    for c in make_prompt_cache(model):
        flat.extend(c.caches if isinstance(c, CacheList) else [c])
    return any(isinstance(c, KVCache | RotatingKVCache) for c in flat)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    """Every architecture that builds, written once (olmo needs a package this environment lacks, and
    prism_hadamard_qwen35 a Hadamard pack: they do not build), and loaded back by mlx-lm's own loader, its
    sanitize included: the model a stage loads."""
    from mlx_lm.utils import load_model

    root = tmp_path_factory.mktemp("zoo")
    written = {}
    with mx.stream(mx.cpu):
        for arch in arch_zoo.architectures():
            try:
                path = arch_zoo.write(arch, root / arch)
            except Exception:
                continue
            model, _ = load_model(path, lazy=True)
            sizes = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers]
            total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            written[arch] = Written(path, sizes, total, _attention_caches(model))
    return written


def _file_bytes(path: Path) -> int:
    with (path / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


@pytest.mark.timeout(120)
def test_every_architecture_s_layers_are_mlx_lm_s_layers(zoo: dict[str, Written]) -> None:
    assert len(zoo) >= len(arch_zoo.architectures()) - 2
    wrong = {}
    for arch, w in zoo.items():
        fp = footprint_from_dir(w.path, arch)
        problems = []
        if fp.layers != len(w.layer_bytes) or fp.layer_bytes != w.layer_bytes:
            problems.append(f"layers {fp.layer_bytes}, mlx-lm's {w.layer_bytes}")
        if fp.weight_bytes != _file_bytes(w.path) or fp.weight_bytes != w.total_bytes:
            problems.append(f"{fp.weight_bytes} bytes, the file holds {_file_bytes(w.path)}")
        if fp.embed_bytes < arch_zoo.VOCAB * 4 or fp.head_bytes <= 0:
            problems.append(f"embedding {fp.embed_bytes}, head {fp.head_bytes}")
        if w.attention and fp.kv_bytes_per_token_per_layer <= 0:
            problems.append("no KV figure for attention layers")
        if fp.hidden_size <= 0 or fp.vocab_size != arch_zoo.VOCAB:
            problems.append(f"hidden {fp.hidden_size}, vocab {fp.vocab_size}")
        if ModelFootprint.model_validate_json(fp.model_dump_json()) != fp:
            problems.append("does not survive a report")
        if problems:
            wrong[arch] = problems
    assert not wrong, wrong


@pytest.mark.timeout(120)
def test_the_kv_figure_bounds_what_mlx_lm_caches_and_is_not_absurd(zoo: dict[str, Written]) -> None:
    """Measured in a child: a forward of some architectures may take the process down."""
    archs = [a for a, w in zoo.items() if w.attention]
    child = subprocess.run(
        [sys.executable, "-c", _MEASURE, *archs], capture_output=True, text=True, timeout=100, check=False
    )
    measured = dict(json.loads(line[3:]) for line in child.stdout.splitlines() if line.startswith("KV "))
    # bitnet and muse_spark need Metal kernels for their forward.
    assert len(measured) >= len(archs) - 4, child.stderr[-2000:]
    wrong = {}
    for arch, entries in measured.items():
        fp = footprint_from_dir(zoo[arch].path, arch)
        kv, biggest = fp.kv_bytes_per_token_per_layer, max(entries)
        # A stage of attention layers only reserves kv a layer; every layer's caches together, kv x layers.
        if kv < biggest or kv * fp.layers < sum(entries) or kv > 2 * biggest:
            wrong[arch] = f"{kv} a layer; mlx-lm's caches take {entries}"
    assert not wrong, wrong


@pytest.mark.timeout(60)
def test_kinds_of_attention_and_their_kv_figures(zoo: dict[str, Written]) -> None:
    def kv(arch: str) -> int:
        return footprint_from_dir(zoo[arch].path).kv_bytes_per_token_per_layer

    # float32, 2 KV heads of 16 (testing/arch_configs.py); MLA: the latent (16) and rope keys (8)
    assert kv("llama") == kv("qwen3_next") == 2 * 2 * 16 * 4
    assert kv("deepseek_v3") == kv("kimi_linear") == (16 + 8) * 4
    assert kv("deepseek_v32") == (16 + 8 + 2 * 16) * 4  # and the indexer's keys
    assert kv("deepseek_v2") == 4 * (16 + 16) * 4  # caches every head, decompressed
    assert kv("longcat_flash") == 2 * (16 + 8) * 4  # two attentions a layer
    assert kv("mamba") == 0  # a recurrent state is per sequence, not per token


def _write(path: Path, config: dict, tensors: dict[str, tuple[int, ...]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.zeros(s, mx.bfloat16) for k, s in tensors.items()}
    )
    return path


@pytest.mark.timeout(60)
def test_published_checkpoint_names(tmp_path: Path) -> None:
    """Names as published, before mlx-lm's sanitize: a multimodal prefix with towers beside the language
    model, next-token-prediction layers, experts one by one."""
    layer = {
        "self_attn.q_proj.weight": (64, 32),
        "mlp.experts.0.up_proj.weight": (8, 32),
        "norm.weight": (32,),
    }
    tensors = {f"model.language_model.layers.{i}.{k}": s for i in range(3) for k, s in layer.items()}
    tensors |= {f"model.visual.blocks.{i}.attn.qkv.weight": (96, 32) for i in range(5)}  # more blocks
    tensors |= {
        "mtp.layers.0.mlp.up_proj.weight": (8, 32),
        "model.language_model.embed_tokens.weight": (50, 32),
    }
    tensors |= {"lm_head.weight": (50, 32), "model.language_model.norm.weight": (32,)}
    config = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 3, "hidden_size": 32}}
    config["text_config"] |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50}
    fp = footprint_from_dir(_write(tmp_path / "vl", config, tensors))
    per_layer = 2 * (64 * 32 + 8 * 32 + 32)
    assert fp.layers == 3 and fp.layer_bytes == [per_layer] * 3 and fp.embed_bytes == 2 * 50 * 32
    # The tower and the prediction layer are not the language model's: counted once, with the head.
    assert fp.head_bytes == 2 * (5 * 96 * 32 + 8 * 32 + 50 * 32 + 32) and not fp.tied
    assert fp.kv_bytes_per_token_per_layer == 2 * 2 * 8 * 2  # bfloat16, head_dim 32 / 4
    # Experts one by one are experts all the same (mlx-lm's sanitize stacks them); the layers lack attention.
    assert (fp.experts, fp.expert_bytes, fp.expert_columns) == (1, [2 * 8 * 32] * 3, 8)
    assert fp.tensor_split == "layers lack self_attn.k_proj, which a tensor-parallel group splits"

    # deepseek_v3's checkpoints hold the next-token-prediction layer after the last: mlx-lm drops it.
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": (8, 32) for i in range(3)}
    tensors |= {"model.embed_tokens.weight": (50, 32), "model.norm.weight": (32,)}
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 50}
    config |= {"num_attention_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    with pytest.raises(CorruptModelError, match=r"model\.layers\.2\.\S+ but num_hidden_layers is 2"):
        footprint_from_dir(_write(tmp_path / "v3", config, tensors))
    fp = footprint_from_dir(_write(tmp_path / "v3", {**config, "num_nextn_predict_layers": 1}, tensors))
    assert fp.layers == 2 and fp.weight_bytes == 2 * (2 * 8 * 32 + 50 * 32 + 32) and fp.tied


@pytest.mark.timeout(60)
def test_afm7_kv_reuse_layers_follow_its_layers(tmp_path: Path) -> None:
    """afm7's Model.layers is model.layers + model.kv_reuse_layers."""
    import mlx_lm.models.afm7 as afm7

    config = {**arch_zoo.tiny_config("afm7"), "num_kv_reuse_layers": 2, "num_layers": 5}
    model = afm7.Model(afm7.ModelArgs.from_dict(config))
    path = tmp_path / "afm7"
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    fp = footprint_from_dir(path)
    assert fp.layers == len(model.layers) == 5
    assert fp.layer_bytes == [sum(v.nbytes for _, v in tree_flatten(x.parameters())) for x in model.layers]


# ---- tensor-parallel groups --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_layers_of_attention_and_a_gated_mlp_split(
    zoo: dict[str, Written], tiny_quantized_models: dict[str, Path]
) -> None:
    # Which of these a group computes exactly is tests/test_groups_every_architecture.py's to check.
    splits = {a for a, w in zoo.items() if footprint_from_dir(w.path).tensor_split == ""}
    assert {"llama", "qwen2", "qwen3", "granite", "gemma3_text", "cohere2"} <= splits
    assert not splits & {"deepseek_v3", "qwen3_next", "mamba2", "phi3", "olmo2", "plamo"}
    assert all(footprint_from_dir(p).tensor_split == "" for p in tiny_quantized_models.values())
    # A mixture of experts splits every expert by columns, its router whole (compute/expert_parallel.py).
    assert {"mixtral", "qwen3_moe", "qwen2_moe"} <= splits


def _edit(source: Path, target: Path, config: dict | None = None, extra: dict | None = None) -> Path:
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    tensors = {k: tuple(v.shape) for k, v in weights.items()} | (extra or {})
    merged = json.loads((source / "config.json").read_text()) | (config or {})
    return _write(target, merged, tensors)


@pytest.mark.timeout(60)
def test_why_a_llama_does_not_split(zoo: dict[str, Written], tmp_path: Path) -> None:
    llama = zoo["llama"].path
    unknown = _edit(llama, tmp_path / "a", extra={"model.layers.1.mlp.mystery.weight": (8, 64)})
    assert footprint_from_dir(unknown).tensor_split == (
        "layers hold tensors a tensor-parallel group does not split (mlp.mystery)"
    )
    # olmo2's q_norm normalises all heads together: no member has them all.
    wide = _edit(llama, tmp_path / "b", extra={"model.layers.0.self_attn.q_norm.weight": (64,)})
    assert "q_norm.weight normalises (64,)" in footprint_from_dir(wide).tensor_split
    windows = _edit(llama, tmp_path / "c", config={"layer_types": ["sliding_attention"] * 4})
    assert footprint_from_dir(windows).tensor_split == ""  # a window is a mask: every member keeps it
    assert (
        footprint_from_dir(_edit(llama, tmp_path / "d", config={"model_type": "mistral"})).tensor_split == ""
    )


@pytest.mark.timeout(60)
def test_reports_without_the_field() -> None:
    """Reports from before tensor_split came from llama, qwen2 and qwen3 alone: those with the shapes split
    as before; without them nothing is known."""
    fields: dict = dict(name="m", layers=2, layer_bytes=[1, 1], embed_bytes=1, head_bytes=1, tied=True)
    fields |= dict(kv_bytes_per_token_per_layer=1, context_length=8, hidden_size=8, vocab_size=8)
    shapes = dict(heads=4, kv_heads=2, head_dim=2, intermediate_size=16)
    assert ModelFootprint.model_validate_json(json.dumps(fields)).tensor_split == OLD_REPORT
    assert ModelFootprint.model_validate_json(json.dumps(fields | shapes)).tensor_split == ""
    told = ModelFootprint.model_validate_json(json.dumps(fields | shapes | {"tensor_split": "why"}))
    assert told.tensor_split == "why" and ModelFootprint(**fields).tensor_split == OLD_REPORT


@pytest.mark.timeout(60)
def test_a_group_is_not_possible_where_the_layers_do_not_split(zoo: dict[str, Written]) -> None:
    nodes = [NodeCapacity(f"n{i}", 10**9, 100.0, 10e9) for i in range(2)]
    fp = footprint_from_dir(zoo["jamba"].path)  # recurrent layers beside its attention and experts
    grouped = estimate(fp, nodes, 1, 2, LOOPBACK, PlacementRequest())
    assert not grouped.fits and grouped.why_not == fp.tensor_split
    assert f"not possible: {fp.tensor_split}" in grouped.describe()
    assert estimate(fp, nodes, 2, 1, LOOPBACK, PlacementRequest()).fits  # a pipeline is
    assert estimate(footprint_from_dir(zoo["qwen3"].path), nodes, 1, 2, LOOPBACK, PlacementRequest()).fits
