"""A tied head split between the last stage and the first (compute/shard.py FastShard._head_split): the
last stage sends its normalised hidden states with the upper logits, and the first stage, which holds the
embedding, computes the lower logits as the whole head computes them. Either path's first stage finishes."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from shardline.compute import gguf_linear, quantized


def split_point(embed: Any) -> int:
    """Where a tied head splits (0: it does not): half the vocabulary, for float, affine-quantized and GGUF
    block embeddings. The first and the last stage of a tied model both compute it, whatever their paths."""
    quantized_embed = isinstance(embed, nn.QuantizedEmbedding | quantized.CpuQuantizedEmbedding)
    blocks = type(embed) is gguf_linear.GGUFEmbedding
    if (
        type(embed) is not nn.Embedding
        and not blocks
        and not (quantized_embed and embed.get("biases") is not None)
    ):
        return 0
    return int(embed.weight.shape[0]) // 2


def rows(embed: Any, h: mx.array, start: int, end: int) -> mx.array:
    """Logits [start, end) of a tied head: h (rows, D) times those rows of the embedding."""
    if type(embed) is nn.Embedding:
        return h.astype(embed.weight.dtype) @ embed.weight[start:end].T
    if type(embed) is gguf_linear.GGUFEmbedding:  # whole rows of blocks, or their affine twin's
        if gguf_linear.kernel_runs_here():
            return quantized.native().gguf_matmul(h, embed["weight"][start:end], embed.qtype)
        embed = gguf_linear.twin_of(embed)
    e = embed
    return quantized.quantized_matmul(
        h, e["weight"][start:end], e["scales"][start:end], e["biases"][start:end], e.group_size, e.bits
    )


def input_dtype(embed: Any, first_layer: nn.Module) -> mx.Dtype:
    """The dtype of the last stage's normalised hidden states, known on the first stage too: a float
    embedding's, else the activations' (the widest float of the quantized embedding's output and the
    layers' norms, as MLX promotes them). The packed float32 copy converts back exactly."""
    if type(embed) is nn.Embedding:
        return embed.weight.dtype
    if type(embed) is gguf_linear.GGUFEmbedding:
        return mx.float32  # its rows dequantize to float32
    norms = [v.dtype for k, v in tree_flatten(first_layer.parameters()) if "norm" in k]
    found = {embed["scales"].dtype, *norms}
    floats = [d for d in found if d in (mx.float32, mx.float16, mx.bfloat16)]
    return floats[0] if len(floats) == 1 else mx.float32  # float16 with bfloat16 promotes to float32


def finish(embed: Any, dtype: mx.Dtype, hidden_size: int, packed: mx.array) -> mx.array:
    """The last stage's packed output (hidden states, then the upper logits) -> full logits (..., vocab)."""
    vocab = int(embed["weight"].shape[0])
    split = vocab - (int(packed.shape[-1]) - hidden_size)
    h = packed[..., :hidden_size].astype(dtype)  # as the last stage had it
    lower = rows(embed, h, 0, split)
    return mx.concatenate([lower.astype(mx.float32), packed[..., hidden_size:]], axis=-1)
