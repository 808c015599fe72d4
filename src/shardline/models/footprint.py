"""What a model needs, per part, read from its directory: the figures placement and the KV budget start from.

`footprint_from_dir` reads only config.json and the JSON headers of the safetensors files, never a tensor.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.models.errors import CorruptModelError
from shardline.models.store.formats import describe_weights

# A layer's ops besides its matmuls, as bytes of matmul work: measured on the default model with quantized
# weights (2.2 MB a layer), a layer took 0.40 ms and the tied 35 MB head 4.0 ms, so a layer costs what ~1.3 MB
# of head costs. Negligible for big layers; for small ones it keeps the head's stage from getting too many.
LAYER_OVERHEAD_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # a safetensors header beyond this is garbage, not a model
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


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

    @model_validator(mode="after")
    def _one_size_per_layer(self) -> ModelFootprint:
        if len(self.layer_bytes) != self.layers or min(self.layer_bytes) < 0:
            raise ValueError(f"layer_bytes needs {self.layers} sizes >= 0, got {len(self.layer_bytes)}")
        return self

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes


def _tensor_sizes(path: Path) -> dict[str, tuple[str, int]]:
    """tensor name -> (dtype, bytes), from the header alone."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        return {name: (e["dtype"], e["data_offsets"][1] - e["data_offsets"][0]) for name, e in header.items()}
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CorruptModelError(f"{path.name}: unreadable safetensors header ({e})") from e


def footprint_from_dir(model_dir: Path, name: str | None = None) -> ModelFootprint:
    """Footprint of an mlx-lm model directory. Raises CorruptModelError for unusable files."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        vocab = int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise CorruptModelError(f"{model_dir.name}: config.json is unusable ({e})") from e
    files = sorted(model_dir.glob("model*.safetensors"))  # what mlx-lm loads, nothing else
    if not files:
        raise CorruptModelError(f"{model_dir.name}: no model*.safetensors weight file")
    # Sizes are the stored bytes (data_offsets): packed quantized weights count as what they are.
    layer_bytes, embed, head, activation_dtypes = [0] * layers, 0, 0, set[str]()
    tensors: set[str] = set()
    by_dtype: dict[str, int] = {}
    for path in files:
        for tensor, (dtype, size) in _tensor_sizes(path).items():
            tensors.add(tensor)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
            if m := _LAYER_TENSOR.match(tensor):
                if (i := int(m.group(1))) >= layers:
                    raise CorruptModelError(f"{path.name}: {tensor} but num_hidden_layers is {layers}")
                layer_bytes[i] += size
                activation_dtypes.add(dtype)
            elif tensor.startswith("model.embed_tokens."):
                embed += size
                activation_dtypes.add(dtype)
            else:  # model.norm.*, lm_head.*, and anything unexpected: counted once, on the last stage
                head += size
    # The KV cache takes the activations' dtype, which MLX promotes to the widest float the embedding and
    # the layers compute with: their float weights, norms, and quantized layers' scales (a quantized layer
    # outputs its scales' dtype, or the input's if wider). Packed integer weights (U32) say nothing: an
    # import with float16 scales and float32 norms computes, and caches, in float32; mlx_lm.convert of a
    # bfloat16 model keeps bfloat16 everywhere.
    floats = [_FLOAT_BYTES[d] for d in activation_dtypes if d in _FLOAT_BYTES]
    kv_dtype = max(floats, default=4)
    return ModelFootprint(
        name=name or model_dir.name,
        layers=layers,
        layer_bytes=layer_bytes,
        embed_bytes=embed,
        head_bytes=head,
        # mlx-lm ties by default (and drops lm_head) for llama/qwen2, so a missing flag means "no lm_head".
        tied=bool(config.get("tie_word_embeddings", "lm_head.weight" not in tensors)),
        kv_bytes_per_token_per_layer=2 * kv_heads * head_dim * kv_dtype,
        # As the engine: no stated limit means none, and the KV reservation falls back to its default.
        context_length=int(config.get("max_position_embeddings") or 2**31),
        hidden_size=hidden,
        vocab_size=vocab,
        weight_format=describe_weights(model_dir, config, by_dtype),
        layer_overhead_bytes=LAYER_OVERHEAD_BYTES,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(config.get("intermediate_size") or 0),
        quant_group=int((config.get("quantization") or {}).get("group_size") or 0),
    )
