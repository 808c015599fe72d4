"""What a model needs, per part, read from its directory: the figures placement and the KV budget start from.

`footprint_from_dir` reads only config.json and the JSON headers of the safetensors files, never a tensor.
It knows every architecture of mlx-lm by the names mlx-lm's modules give their tensors: layer i is the i-th
entry of the Model's `layers` (what a stage for layers [start, end) holds), whatever the list is called and
wherever it sits (`model.layers.N.`, `language_model.model.layers.N.`, `backbone.layers.N.`,
`transformer.h.N.`, `model.blocks.N.`, ...); the embedding is what embeds tokens outside the layers; the
rest (final norm, lm_head, anything unexpected) is the head, held by the last stage.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.models.errors import CorruptModelError
from shardline.models.gguf_quant import largest_block
from shardline.models.store.formats import describe_weights
from shardline.models.validate import mlx_lm_architecture

# A layer's ops besides its matmuls, as bytes of matmul work: measured on the default model with quantized
# weights (2.2 MB a layer), a layer took 0.40 ms and the tied 35 MB head 4.0 ms, so a layer costs what ~1.3 MB
# of head costs. Negligible for big layers; for small ones it keeps the head's stage from getting too many.
LAYER_OVERHEAD_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # a safetensors header beyond this is garbage, not a model
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# The names of mlx-lm's layer lists; kv_reuse_layers (afm7) follow its `layers` in the Model's `layers`.
_LAYER_LIST = re.compile(r"(?:^|\.)(layers|h|blocks|kv_reuse_layers)\.(\d+)\.")
_APPENDED_LIST = "kv_reuse_layers"
# Vision and audio towers of multimodal checkpoints have layer lists too; mlx-lm's text models drop them.
_TOWER = re.compile(r"(?:^|\.)(vision\w*|visual|audio\w*|image\w*|mm_projector|multi_modal_projector)\.")
# What embeds tokens (or positions) before the first layer, by module name; embed_out is gpt-neox's head.
_EMBEDDING = re.compile(
    r"(?:^|\.)(embed_tokens\w*|embed_in|embed|embedding|embeddings|\w+_embeddings|wte|wpe|embd)\."
)
# What multiplies by the vocabulary at the end: its absence means the embedding does (tied).
_HEAD_MATRIX = re.compile(r"(?:^|\.)(lm_head|output|output_layer|embed_out)(\.|$)")
# MLA attentions that cache the decompressed keys and values of every head, not the latent.
_MLA_DECOMPRESSED = frozenset({"deepseek_v2", "minicpm3", "youtu_llm"})
# Attentions that cache every head, whatever num_key_value_heads says.
_EVERY_HEAD_CACHED = frozenset({"gpt2", "gpt_neox"})


OLD_REPORT = "unknown: an old report without the layer shapes"
# The architectures whose groups take the fast path (its blocks' sums are checked exact in groups for these);
# any other architecture whose layers split (below) runs its groups on the generic path (compute/shard.py).
TENSOR_PARALLEL_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# A layer's tensors that a group splits (self_attn's q/k/v/o by heads, mlp's gate/up/down by columns) or
# keeps whole on every member (the layer's own norms, per-head query and key norms), relative to the layer.
_SPLIT_TENSOR = re.compile(
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(weight|bias|scales|biases)"
    r"|\w*(norm|ln)\w*\.(weight|bias)|self_attn\.[qk]_(norm|layernorm)\.weight"
    r"|self_attn\.rotary_emb\.inv_freq"
)
# Layers whose tensors split and whose modules a group still cannot run (found by
# tests/test_groups_every_architecture.py): why, in one line.
_NO_GROUPS = {
    "iquestloopcoder": "it runs every layer twice, the second time with the first pass's keys and values",
    "plamo": "its attention keeps its head counts under names a group does not know",
}
_SPLIT_NEEDS = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
)

# Mixture of experts. Routed experts sit in a module of mlx-lm's switch layers (`mlp.switch_mlp`,
# `block_sparse_moe.switch_mlp`, gpt_oss's `mlp.experts`, `mlp.experts.switch_mlp`), each tensor stacked with
# the expert first; a checkpoint before mlx-lm's sanitize numbers them (`mlp.experts.N.`).
_SWITCH = re.compile(r"(?:^|\.)(\w*switch\w*|experts)$")
_NUMBERED_EXPERT = re.compile(r"^(?P<switch>(?:.*\.)?experts)\.(?P<expert>\d+)\.")
# Shared experts, under the names compute/expert_parallel.py splits by columns (its SHARED_NAMES); the MoE
# module's other parts (router, gates, coefficients) run whole on every member, before the group's sum.
_SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp", "share_expert")
_FIRST_PRODUCT = re.compile(r"\.(gate_proj|up_proj|fc1|w1|w3)\.weight$")
_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_ACTIVE_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_top_k",
    "moe_k",
    "num_selected_experts",
)
# MoE layers an expert group cannot run although their parts are known: why, in one line (the runner refuses
# them too: compute/expert_parallel.py; tests/test_expert_groups_every_architecture.py finds them).
NO_EXPERT_GROUPS = {
    "dbrx": "its experts are modules of its own, not mlx-lm's switch layers that a member slices",
    "longcat_flash": "its zero experts add the input itself, which every member would add again",
    "longcat_flash_ngram": "its zero experts add the input itself, which every member would add again",
}
NO_EXPERTS = "the model has no routed experts"


class ModelFootprint(BaseModel):
    """What a model needs, per part; sent inside node reports, so pydantic and tolerant of extra fields."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    layers: int = Field(ge=1)
    layer_bytes: list[int]  # weight bytes of each transformer layer
    embed_bytes: int = Field(ge=0)
    head_bytes: int = Field(ge=0)  # final norm + lm_head (only the norm when tied)
    tied: bool  # lm_head is the embedding: the last stage holds (and multiplies by) it too
    kv_bytes_per_token_per_layer: int = Field(ge=0)  # 2 * kv_heads * head_dim * dtype bytes
    context_length: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    layer_overhead_bytes: int = Field(0, ge=0)  # see LAYER_OVERHEAD_BYTES; 0 in old reports
    # How the weights are stored, for people: "q4_1→affine4/g32", "mlx 4-bit g64", "float32" (models/formats)
    weight_format: str = ""
    # The shapes tensor parallelism splits (cluster/parallelism.py); 0 in old reports: never split.
    heads: int = Field(0, ge=0)
    kv_heads: int = Field(0, ge=0)
    head_dim: int = Field(0, ge=0)
    intermediate_size: int = Field(0, ge=0)
    quant_group: int = Field(0, ge=0)  # affine quantization's group size (0: float weights)
    # "" where a tensor-parallel group can split every layer (compute/tensor_parallel.py), else why not.
    tensor_split: str = OLD_REPORT
    model_type: str = ""  # config.json's; "" in old reports (llama, qwen2 and qwen3 only)
    # Mixture of experts (cluster/experts.py); dense models and old reports: none.
    experts: int = Field(0, ge=0)  # routed experts of each MoE layer
    experts_active: int = Field(0, ge=0)  # routed experts a token goes to
    expert_bytes: list[int] = []  # per layer: its routed experts' bytes (0: a dense layer); []: no MoE
    shared_expert_bytes: list[int] = []  # per layer: its shared experts' bytes (an expert group splits them)
    # "" where an expert-parallel group can hold whole experts of every MoE layer, else why not.
    expert_split: str = NO_EXPERTS
    # The gcd of the experts' column counts, which a tensor-parallel group splits (0: no experts).
    expert_columns: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _old_reports(cls, data: Any) -> Any:
        # Reports from before this field came only from llama, qwen2 and qwen3, the architectures split_block
        # splits: those that carry the shapes may split as they did; without the shapes nothing is checked.
        if isinstance(data, Mapping) and "tensor_split" not in data:
            shapes = all(data.get(k) for k in ("heads", "kv_heads", "head_dim", "intermediate_size"))
            return {**data, "tensor_split": "" if shapes else OLD_REPORT}
        return data

    @model_validator(mode="after")
    def _one_size_per_layer(self) -> ModelFootprint:
        if len(self.layer_bytes) != self.layers or min(self.layer_bytes) < 0:
            raise ValueError(f"layer_bytes needs {self.layers} sizes >= 0, got {len(self.layer_bytes)}")
        for name in ("expert_bytes", "shared_expert_bytes"):
            sizes = getattr(self, name)
            if sizes and (len(sizes) != self.layers or min(sizes) < 0):
                raise ValueError(f"{name} needs none or {self.layers} sizes >= 0, got {len(sizes)}")
        if any(self.expert_at(i) + self.shared_at(i) > b for i, b in enumerate(self.layer_bytes)):
            raise ValueError("a layer's experts take more bytes than the layer")
        return self

    def expert_at(self, layer: int) -> int:
        """Bytes of layer `layer`'s routed experts (0: a dense layer)."""
        return self.expert_bytes[layer] if self.expert_bytes else 0

    def shared_at(self, layer: int) -> int:
        return self.shared_expert_bytes[layer] if self.shared_expert_bytes else 0

    def moe_layers(self, start: int, end: int) -> int:
        """MoE layers in [start, end)."""
        return sum(1 for i in range(start, end) if self.expert_at(i))

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes


@dataclass(frozen=True)
class _HeaderEntry:
    dtype: str
    nbytes: int  # as stored (data_offsets): packed quantized weights count as what they are
    shape: tuple[int, ...]


def _tensors(path: Path) -> dict[str, _HeaderEntry]:
    """tensor name -> what its header says, from the header alone."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        return {
            name: _HeaderEntry(e["dtype"], e["data_offsets"][1] - e["data_offsets"][0], tuple(e["shape"]))
            for name, e in header.items()
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CorruptModelError(f"{path.name}: unreadable safetensors header ({e})") from e


def _first(config: Mapping[str, Any], *keys: str) -> int | None:
    """The first of `keys` that config.json sets, as an int (a per-layer list: its largest entry)."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            value = max(value)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


# Each figure's names in the config.json of mlx-lm's architectures, the usual one first.
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_transformer_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "model_dim", "dim", "hidden_dim")
_HEADS_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads")
_KV_HEADS_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")


@dataclass
class _Layers:
    """Where the layers of mlx-lm's Model `layers` are, in the tensor names."""

    base: str  # the name up to the layer list's own name: "model.", "language_model.model.", ""
    name: str  # the layer list's name: layers, h, blocks
    main: int  # entries of that list (kv_reuse_layers follow them)

    def index(self, tensor: str) -> tuple[int, str] | None:
        """(layer, the name within the layer) of a layer tensor, else None."""
        m = _LAYER_LIST.search(tensor)
        if m is None or _TOWER.search(tensor[: m.start()] + "."):
            return None
        base = tensor[: m.start() + 1] if m.start() else ""
        if base != self.base:
            return None
        if m.group(1) == self.name:
            return int(m.group(2)), tensor[m.end() :]
        if m.group(1) == _APPENDED_LIST and self.name == "layers":
            return self.main + int(m.group(2)), tensor[m.end() :]
        return None


def _find_layers(names: list[str]) -> _Layers | None:
    """The layer list: the one with the most entries (a multimodal checkpoint's towers set aside)."""
    lists: dict[tuple[str, str], set[int]] = {}
    for tensor in names:
        m = _LAYER_LIST.search(tensor)
        if m is None or m.group(1) == _APPENDED_LIST or _TOWER.search(tensor[: m.start()] + "."):
            continue
        base = tensor[: m.start() + 1] if m.start() else ""
        lists.setdefault((base, m.group(1)), set()).add(int(m.group(2)))
    if not lists:
        return None
    (base, name), indices = max(lists.items(), key=lambda item: (len(item[1]), item[0][1] == "layers"))
    return _Layers(base, name, max(indices) + 1)


def _kv_elements(config: Mapping[str, Any], arch: str, shape: tuple[int, int, int], within: set[str]) -> int:
    """An upper bound of the elements one token's keys and values take in one layer's cache: a full
    attention's (a sliding window's takes no more; a recurrent state is per sequence, not per token).
    `shape` is (heads, kv_heads, head_dim); `within` the names of the layers' tensors, within a layer."""
    heads, kv_heads, head_dim = shape
    rank = _first(config, "kv_lora_rank")
    if rank and any("kv_a_proj_with_mqa" in n for n in within):  # multi-head latent attention
        rope = _first(config, "qk_rope_head_dim") or 0
        if arch in _MLA_DECOMPRESSED:
            key = (_first(config, "qk_nope_head_dim") or head_dim) + rope
            return heads * (key + (_first(config, "v_head_dim") or head_dim))
        # mlx-lm caches the latent and the rope keys; a sparse attention's indexer, its keys besides.
        indexer = _first(config, "index_head_dim") if any("indexer." in n for n in within) else 0
        return rank + rope + 2 * (indexer or 0)
    if arch in _EVERY_HEAD_CACHED:
        kv_heads = max(heads, kv_heads)
    return 2 * kv_heads * head_dim


def _attentions_per_layer(config: Mapping[str, Any], arch: str) -> int:
    if arch.startswith("longcat_flash"):
        return 2  # two attentions a layer, each with its cache
    if arch == "iquestloopcoder":
        return _first(config, "loop_num") or 2  # every loop caches its own keys and values
    return 1


def _split_refusal(
    arch: str, config: Mapping[str, Any], per_layer: list[dict[str, _HeaderEntry]], head_dim: int
) -> str:
    """Why a tensor-parallel group cannot split this model's layers, or "" where it can."""
    if arch in _NO_GROUPS:
        return _NO_GROUPS[arch]
    for tensors in per_layer:
        # A MoE module splits every routed and shared expert by columns and runs its router whole
        # (compute/expert_parallel.py: split_experts_by_columns); its columns are `expert_columns`.
        moes = {m for s in _switches(tensors) if (m := s.rpartition(".")[0])}
        for name, t in sorted(tensors.items()):
            if any(name.startswith(f"{m}.") for m in moes):
                continue
            if not _SPLIT_TENSOR.fullmatch(name):
                module = name.rsplit(".", 1)[0]
                return f"layers hold tensors a tensor-parallel group does not split ({module})"
            if "_norm." in name and t.shape != (head_dim,):  # a norm over all heads cannot be split by head
                return f"{name} normalises {t.shape}, not each head's {head_dim}"
        needs = _SPLIT_NEEDS[:4] if moes else _SPLIT_NEEDS  # attention's; a dense layer's MLP's too
        if missing := [n for n in needs if n not in tensors]:
            return f"layers lack {missing[0].rsplit('.', 1)[0]}, which a tensor-parallel group splits"
    return ""


@dataclass
class _Experts:
    """The mixture of experts of a model's layers, as their tensors' names and shapes say."""

    experts: int = 0
    expert_bytes: list[int] | None = None
    shared_bytes: list[int] | None = None
    why: str = NO_EXPERTS
    columns: int = 0  # the gcd of the routed and shared experts' column counts


def _switches(tensors: Mapping[str, _HeaderEntry]) -> dict[str, int]:
    """The modules of routed experts in one layer's tensors (names within the layer), each with its count."""
    stacked: dict[str, set[int]] = {}
    numbered: dict[str, set[int]] = {}
    for name, t in tensors.items():
        if m := _NUMBERED_EXPERT.match(name):
            numbered.setdefault(m["switch"], set()).add(int(m["expert"]))
            continue
        module = name.rpartition(".")[0]
        for switch in (module, module.rpartition(".")[0]):  # the module itself, or the linear's parent
            shared = switch.rpartition(".")[2].startswith("shared")
            if len(t.shape) >= 3 and _SWITCH.search(switch) and not shared:
                stacked.setdefault(switch, set()).add(t.shape[0])
                break
    # A stacked switch's tensors all have the experts first (a bias too: (experts, out)).
    return {**{s: max(n) + 1 for s, n in numbered.items()}, **{s: max(c) for s, c in stacked.items()}}


def _expert_columns(tensors: Mapping[str, _HeaderEntry]) -> int:
    """The gcd of one layer's routed and shared experts' column counts (0: none), from their first
    products' output rows: what a tensor-parallel group splits."""
    found = 0
    for switch in _switches(tensors):
        moe = switch.rpartition(".")[0]
        for name, t in tensors.items():
            first = _FIRST_PRODUCT.search(name)
            if first is None or not t.shape:
                continue
            if name.startswith(f"{switch}.") and len(t.shape) == 3:
                found = math.gcd(found, t.shape[1])  # (experts, columns, inputs)
            elif name.startswith(f"{switch}.") and _NUMBERED_EXPERT.match(name):
                found = math.gcd(found, t.shape[0])  # one expert's (columns, inputs)
            elif moe and any(name.startswith(f"{moe}.{p}.") for p in _SHARED_EXPERTS):
                found = math.gcd(found, t.shape[0])
    return found


def _layer_experts(tensors: Mapping[str, _HeaderEntry]) -> tuple[int, int, int, str]:
    """(routed experts, their bytes, shared experts' bytes, why an expert group cannot hold them or "") of
    one layer, from its tensors (names within the layer); (0, 0, 0, "") for a dense layer."""
    switches = _switches(tensors)
    if not switches:
        return 0, 0, 0, ""
    counts = set(switches.values())
    routed = sum(t.nbytes for n, t in tensors.items() if any(n.startswith(f"{s}.") for s in switches))
    why = "" if len(counts) == 1 else f"its switch layers hold {sorted(counts)} experts"
    shared = 0
    for switch in switches:
        moe, _, own = switch.rpartition(".")
        if not moe:  # the experts sit in the layer itself: nothing to tell a router from the rest
            continue
        parts = {n[len(moe) + 1 :].split(".")[0] for n in tensors if n.startswith(f"{moe}.")}
        for part in sorted(parts & set(_SHARED_EXPERTS) - {own}):
            where = f"{moe}.{part}"
            held = [n for n in tensors if n.startswith(f"{where}.")]
            shared += sum(tensors[n].nbytes for n in held)
            if not all(any(f".{p}_proj." in n for n in held) for p in ("up", "down")):  # a gate is optional
                why = why or f"its shared experts ({where}) are not up/down projections"
    return max(counts), routed, shared, why


def _experts(arch: str, config: Mapping[str, Any], per_layer: list[dict[str, _HeaderEntry]]) -> _Experts:
    found = [_layer_experts(tensors) for tensors in per_layer]
    counts = {e for e, *_ in found if e}
    if not counts:
        return _Experts()
    stated = _first(config, *_EXPERTS_KEYS)
    why = next((w for *_, w in found if w), "")
    if len(counts) > 1:
        why = f"its MoE layers differ in expert count ({sorted(counts)})"
    elif stated and stated not in counts:  # tensors are what the runner holds: they decide
        why = why or f"config.json says {stated} experts, its tensors hold {min(counts)}"
    why = NO_EXPERT_GROUPS.get(arch, why)
    columns = functools.reduce(math.gcd, (_expert_columns(t) for t in per_layer), 0)
    return _Experts(max(counts), [b for _, b, _, _ in found], [s for _, _, s, _ in found], why, columns)


def footprint_from_dir(model_dir: Path, name: str | None = None) -> ModelFootprint:
    """Footprint of an mlx-lm model directory. Raises CorruptModelError for unusable files."""
    model_dir = Path(model_dir)
    try:
        top = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        # Multimodal and wrapper configs keep the language model's figures in text_config.
        text = top.get("text_config")
        config: dict[str, Any] = {**top, **text} if isinstance(text, dict) else dict(top)
        model_type = str(top.get("model_type") or "")
        hidden = _first(config, *_HIDDEN_KEYS)
        if hidden is None:
            raise KeyError("hidden_size")
        heads = _first(config, *_HEADS_KEYS) or 0
        kv_heads = _first(config, *_KV_HEADS_KEYS) or heads
        head_dim = _first(config, "head_dim", "kv_channels") or (hidden // heads if heads else 0)
        vocab = _first(config, "vocab_size", "padded_vocab_size", "n_vocab", "num_vocab")
        count_key = next((k for k in _LAYER_COUNT_KEYS if _first(config, k)), None)
        stated = _first(config, count_key) if count_key else None
        # Next-token-prediction layers follow the last layer in some checkpoints; mlx-lm drops them.
        predicting = _first(config, "num_nextn_predict_layers") or 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptModelError(f"{model_dir.name}: config.json is unusable ({e})") from e
    files = sorted(model_dir.glob("model*.safetensors"))  # what mlx-lm loads, nothing else
    if not files:
        raise CorruptModelError(f"{model_dir.name}: no model*.safetensors weight file")
    tensors: dict[str, _HeaderEntry] = {}
    for path in files:
        tensors.update(_tensors(path))
    where = _find_layers(sorted(tensors))
    if where is None:
        raise CorruptModelError(f"{model_dir.name}: no layer tensors (model.layers.N. or the like)")
    indexed = {t: where.index(t) for t in tensors}
    found = 1 + max(i[0] for i in indexed.values() if i is not None)
    layers = stated or found
    per_layer: list[dict[str, _HeaderEntry]] = [{} for _ in range(layers)]
    layer_bytes, embed, head, activation_dtypes = [0] * layers, 0, 0, set[str]()
    by_dtype: dict[str, int] = {}
    for tensor, t in tensors.items():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        if (at := indexed[tensor]) is not None:
            i, within = at
            if i >= layers + predicting:
                raise CorruptModelError(f"{model_dir.name}: {tensor} but {count_key} is {layers}")
            if i >= layers:
                continue
            layer_bytes[i] += t.nbytes
            per_layer[i][within] = t
            activation_dtypes.add(t.dtype)
        elif _EMBEDDING.search(tensor) and not _HEAD_MATRIX.search(tensor):
            embed += t.nbytes
            activation_dtypes.add(t.dtype)
        else:  # the final norm, lm_head, and anything unexpected: counted once, on the last stage
            head += t.nbytes
    if vocab is None:  # the embedding's rows
        embedding = [t for n, t in tensors.items() if indexed[n] is None and _EMBEDDING.search(n)]
        rows = [t.shape[0] for t in embedding if t.shape]
        if not rows:
            raise CorruptModelError(f"{model_dir.name}: config.json is unusable (no vocab_size)")
        vocab = max(rows)
    # The KV cache takes the activations' dtype, which MLX promotes to the widest float the embedding and
    # the layers compute with: their float weights, norms, and quantized layers' scales (a quantized layer
    # outputs its scales' dtype, or the input's if wider). Packed integer weights (U32) say nothing: an
    # import with float16 scales and float32 norms computes, and caches, in float32; mlx_lm.convert of a
    # bfloat16 model keeps bfloat16 everywhere.
    floats = [_FLOAT_BYTES[d] for d in activation_dtypes if d in _FLOAT_BYTES]
    kv_dtype = max(floats, default=4)
    arch = mlx_lm_architecture(model_type) or model_type
    within = {n for tensors in per_layer for n in tensors}
    kv = _kv_elements(config, arch, (heads, kv_heads, head_dim), within) * _attentions_per_layer(config, arch)
    head_matrix = any(_HEAD_MATRIX.search(t) for t, at in indexed.items() if at is None)
    moe = _experts(arch, config, per_layer)
    # Unstated: one expert a token (mlx-lm's default where a model has the figure at all).
    active = min(moe.experts, _first(config, *_ACTIVE_KEYS) or 1) if moe.experts else 0
    return ModelFootprint(
        name=name or model_dir.name,
        layers=layers,
        layer_bytes=layer_bytes,
        embed_bytes=embed,
        head_bytes=head,
        # Without an lm_head mlx-lm multiplies by the embedding, whatever the flag says (gemma, cohere).
        tied=bool(config.get("tie_word_embeddings")) or not head_matrix,
        kv_bytes_per_token_per_layer=kv * kv_dtype,
        # As the engine: no stated limit means none, and the KV reservation falls back to its default.
        context_length=_first(config, "max_position_embeddings", "n_positions", "n_ctx", "seq_length")
        or 2**31,
        hidden_size=hidden,
        vocab_size=vocab,
        weight_format=describe_weights(model_dir, top, by_dtype),
        layer_overhead_bytes=LAYER_OVERHEAD_BYTES,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_first(config, "intermediate_size") or 0,
        quant_group=largest_block(top),
        tensor_split=_split_refusal(arch, config, per_layer, head_dim),
        model_type=model_type,
        experts=moe.experts,
        experts_active=active,
        expert_bytes=moe.expert_bytes or [],
        shared_expert_bytes=moe.shared_bytes or [],
        expert_split=moe.why,
        expert_columns=moe.columns,
    )
