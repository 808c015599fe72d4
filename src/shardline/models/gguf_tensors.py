"""GGUF tensor shapes, dequantization, and the layouts llama.cpp's converter changes (Q/K rows, kv_b)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from shardline.models.errors import UnsupportedModelError

# Tensors folded into config.json (Llama 3 and Phi-3 rope scaling) instead of the weights.
ROPE_FREQS = "rope_freqs.weight"
CONFIG_TENSORS = frozenset({ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF's `ne` lists dimensions innermost first; reversed it is the numpy/HF shape,
    which for a linear layer is [out_features, in_features]."""
    return tuple(int(n) for n in reversed(tensor.shape))


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as a float32 array of shape `hf_shape(tensor)`."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        data = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} uses unsupported type {qtype.name}") from e
    return np.ascontiguousarray(data.reshape(hf_shape(tensor)), dtype=np.float32)


def unpermute_llama_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `LlamaModel.permute` on a Q or K weight/bias.

    llama.cpp rotates interleaved pairs (GPT-J style RoPE) while HF llama rotates the two
    halves of each head, so the converter reorders each head's rows from
    [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...]. Forward it is
    reshape(n_head, 2, d/2) -> swap -> flatten; the inverse reads the rows as
    (n_head, d/2, 2) and swaps back. `n_head` is the KV head count for K.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def float_tensor(name: str, array: np.ndarray) -> ReaderTensor:
    """A float32 array computed at import (not read from the file) in the reader's form, so that it
    goes through the importer like any float GGUF tensor."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return ReaderTensor(
        name=name,
        tensor_type=GGMLQuantizationType.F32,
        shape=np.array(list(reversed(array.shape)), dtype=np.uint64),
        n_elements=int(array.size),
        n_bytes=int(array.nbytes),
        data_offset=0,
        data=array,
        field=None,  # type: ignore[arg-type]
    )


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek MLA's kv_b_proj [heads * (nope + v), kv_lora] from the halves newer converters store.

    convert_hf_to_gguf views kv_b_proj as [heads, nope + v, kv_lora], splits it into K's [heads, nope,
    kv_lora] (stored transposed, [heads, kv_lora, nope], for llama.cpp's absorbed attention) and V's
    [heads, v, kv_lora]; this undoes both steps."""
    heads, lora, _ = k_b.shape
    if v_b.shape[0] != heads or v_b.shape[2] != lora:
        raise UnsupportedModelError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair up")
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, lora)
