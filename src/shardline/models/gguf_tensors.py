"""GGUF tensor names, dequantization and llama.cpp's Q/K row permutation."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from shardline.models.errors import UnsupportedModelError

# Tensor folded into config.json (Llama 3 rope scaling) instead of the weights.
ROPE_FREQS = "rope_freqs.weight"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """HF/mlx-lm parameter name for a GGUF tensor name (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[parts[0]]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no known HF equivalent; not supported")


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
