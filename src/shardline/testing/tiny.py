"""Tiny random models in mlx-lm's directory format, with logits spread wide enough for exact greedy tests.

Random small models have near-tied logits; scaling the output embedding keeps the top-1 margin far above
float noise so that a different (but equally correct) summation order cannot flip a greedy token.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ARCHS: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True, "head_dim": 16},
}


def tiny_config(arch: str, layers: int = 6, hidden: int = 64, vocab: int = 512, context: int = 4096) -> dict:
    return {
        **ARCHS[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
    }


def make_tiny_model(path: Path, arch: str, seed: int = 0, **overrides: int) -> Path:
    from mlx_lm.utils import _get_classes

    config = tiny_config(arch, **overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:
        # Stronger layers make the output depend on the prompt (else one token repeats forever) ...
        if ".layers." in name and name.endswith("proj.weight"):
            weights[name] = weights[name] * 3.0
    # ... and a sharper head keeps the greedy margin far above float noise.
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head] = weights[head] * 4.0
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_tiny_quantized_model(
    path: Path, arch: str, bits: int = 4, group_size: int = 32, seed: int = 0, **overrides: int
) -> Path:
    """A tiny model quantized in MLX's affine layout (every linear layer and the embedding), saved with
    the `quantization` config entry that makes mlx-lm build nn.QuantizedLinear / nn.QuantizedEmbedding."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    source = make_tiny_model(path.with_name(path.name + "-float"), arch, seed=seed, **overrides)
    model, config = load_model(source)
    nn.quantize(model, group_size=group_size, bits=bits)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
