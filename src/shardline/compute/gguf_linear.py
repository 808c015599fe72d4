"""Layers whose weights are GGUF blocks as stored, and the loader that puts them in a model.

A GGUF import keeps the matrices of the kernel's block types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) as their
GGUF bytes: a uint8 (rows, row bytes) weight, each row its blocks exactly as the file holds them, listed in
config.json's `gguf_quantization` ({module path: type name}; models/gguf_import.py). `load_model` is mlx-lm's
loader with those modules built as `GGUFLinear` / `GGUFEmbedding` before the weights are read, so a model's
weights cost the GGUF's bytes, and the native kernel (csrc/qmm/gguf_*) multiplies them as stored.

Where that kernel does not run (a GPU device, or a build without the module), `to_affine_layers` turns the
layers a stage holds into MLX's affine `QuantizedLinear` / `QuantizedEmbedding`, once, at load: exact for
every type but Q6_K, which becomes 8 bits in groups of 32 (models/gguf_quant.py says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model

from shardline.compute import quantized
from shardline.models.gguf_quant import BLOCK_TYPES, to_affine

CONFIG_KEY = "gguf_quantization"


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def row_bytes(qtype: int, columns: int) -> int:
    elements, size = block_shape(qtype)
    if columns % elements:
        raise ValueError(
            f"{columns} columns are not whole {GGMLQuantizationType(qtype).name} blocks of {elements}"
        )
    return columns // elements * size


def qtype_of(name: str) -> int:
    """A type name of `gguf_quantization` ("Q4_K") as its GGML value; ValueError for one the kernel lacks."""
    try:
        qtype = GGMLQuantizationType[name]
    except KeyError:
        qtype = None
    if qtype not in BLOCK_TYPES:
        known = ", ".join(sorted(t.name for t in BLOCK_TYPES))
        raise ValueError(f"GGUF block type {name!r} is not one the kernel reads ({known})")
    return int(qtype)


def _ops() -> Any:
    ops = quantized.native()
    if ops is None or not hasattr(ops, "gguf_matmul"):
        raise RuntimeError("GGUF block layers need shardline's CPU kernel (reinstall shardline to build it)")
    return ops


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias), W as GGUF blocks: `weight` uint8 (out, in / block * block bytes)."""

    def __init__(self, input_dims: int, output_dims: int, qtype: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((output_dims, row_bytes(qtype, input_dims)), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.qtype = qtype
        self.input_dims = input_dims

    def __call__(self, x: mx.array) -> mx.array:
        if not kernel_runs_here():
            return twin_of(self)(x)
        y = _ops().gguf_matmul(x, self["weight"], self.qtype)
        return y + self["bias"] if "bias" in self else y


class GGUFEmbedding(nn.Module):
    """A table of GGUF block rows: lookups dequantize the rows asked for; `as_linear` is a tied head."""

    def __init__(self, num_embeddings: int, dims: int, qtype: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_embeddings, row_bytes(qtype, dims)), dtype=mx.uint8)
        self.qtype = qtype
        self.input_dims = dims

    def __call__(self, x: mx.array) -> mx.array:
        if not kernel_runs_here():
            return twin_of(self)(x)
        return _ops().gguf_rows(self["weight"], x.astype(mx.int32), self.qtype)

    def as_linear(self, x: mx.array) -> mx.array:
        if not kernel_runs_here():
            return twin_of(self).as_linear(x)
        return _ops().gguf_matmul(x, self["weight"], self.qtype)


def twin_of(m: nn.Module) -> Any:
    """m's affine twin, made at its first call and kept: for a layer load_shard did not convert (an
    embedding or head outside the stage's blocks) where the kernel does not run."""
    twin = m.__dict__.get("_affine_twin")
    if twin is None:
        twin = affine_twin(m)
        object.__setattr__(m, "_affine_twin", twin)
    return twin


GGUF_LAYERS = (GGUFLinear, GGUFEmbedding)


def is_gguf(m: Any) -> bool:
    return type(m) in GGUF_LAYERS


def _module_at(model: nn.Module, path: str) -> tuple[nn.Module, str | int, Any] | None:
    """(parent, key, module) at a dotted path of the model's tree, or None."""
    parent: Any = None
    key: str | int = ""
    node: Any = model
    for part in path.split("."):
        parent, key = node, int(part) if part.isdigit() and isinstance(node, list) else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return parent, key, node


def install(model: nn.Module, blocks: dict[str, str]) -> None:
    """Replace each module named in `blocks` (a Linear or an Embedding) with its GGUF-block layer."""
    for path, name in blocks.items():
        qtype = qtype_of(name)
        found = _module_at(model, path) or _module_at(model, f"language_model.{path}")
        if found is None:
            raise ValueError(f"config.json's {CONFIG_KEY} names {path!r}, which the model does not have")
        parent, key, m = found
        if isinstance(m, nn.Embedding):
            rows, dims = m.weight.shape
            parent[key] = GGUFEmbedding(int(rows), int(dims), qtype)
        elif isinstance(m, nn.Linear):
            out, inp = m.weight.shape
            parent[key] = GGUFLinear(int(inp), int(out), qtype, bias="bias" in m)
        else:
            raise ValueError(f"{path!r} is a {type(m).__name__}, not a Linear or an Embedding")


def load_model(model_path: Path, lazy: bool = False, strict: bool = True) -> tuple[nn.Module, dict]:
    """mlx-lm's `load_model`, with the modules of config.json's `gguf_quantization` as GGUF block layers."""

    def classes(config: dict) -> tuple[Any, Any]:
        model_class, args_class = _get_classes(config)
        blocks = config.get(CONFIG_KEY)
        if not blocks:
            return model_class, args_class

        def build(args: Any) -> nn.Module:
            model = model_class(args)
            install(model, blocks)
            return model

        return build, args_class

    return mlx_lm_load_model(Path(model_path), lazy=lazy, strict=strict, get_model_classes=classes)


def affine_twin(m: nn.Module) -> nn.Module:
    """The MLX affine layer of a GGUF block layer's weights (read now), else m itself."""
    if not is_gguf(m):
        return m
    raw = np.asarray(m["weight"])
    rows, cols = int(raw.shape[0]), int(m.input_dims)
    affine = to_affine(raw.reshape(-1), GGMLQuantizationType(m.qtype), (rows, cols))
    bits = affine.bits
    if type(m) is GGUFEmbedding:
        twin: nn.Module = nn.QuantizedEmbedding(rows, cols, group_size=32, bits=bits)
    else:
        twin = nn.QuantizedLinear(cols, rows, bias="bias" in m, group_size=32, bits=bits)
        if "bias" in m:
            twin.bias = m["bias"]
    twin.weight = mx.array(affine.weight)
    twin.scales = mx.array(affine.scales)
    twin.biases = mx.array(affine.biases)
    return twin


def to_affine_layers(module: nn.Module) -> None:
    """Every GGUF block layer under module as its MLX affine twin (weights read and converted now)."""
    leaves = tree_map_with_path(
        lambda _p, m: affine_twin(m), module.leaf_modules(), is_leaf=nn.Module.is_module
    )
    module.update_modules(leaves)


def kernel_runs_here() -> bool:
    """Whether GGUF block layers run as they are: the CPU device, and the kernel's GGUF products built."""
    ops = quantized.native()
    return mx.default_device() == mx.cpu and ops is not None and hasattr(ops, "gguf_matmul")
