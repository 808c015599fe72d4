"""Translate GGUF metadata (`<arch>.*` keys) into an HF-style `config.json` for mlx-lm."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardline.models.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
HF_ARCHITECTURE_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Used only when the GGUF omits rope.freq_base; these are the HF config defaults.
DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}


def check_architecture(arch: str | None) -> str:
    """Return `arch` if shardline can import it, else raise UnsupportedModelError."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _f32(x: float) -> float:
    """GGUF stores float32; print it back the way a human wrote it (1e-05, not 9.9999997e-06)."""
    return float(f"{float(x):.7g}")


def meta_scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A per-model value; some GGUFs store per-layer arrays, which shardline cannot represent."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"GGUF key {key} varies per layer ({value}); not supported")
        value = value[0]
    return value


def _llama3_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors convert_hf_to_gguf stores in `rope_freqs.weight` for Llama 3."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover Llama 3's rope_scaling from the stored factors.

    GGUF keeps only the resulting factors, not the parameters. Every Llama 3.x release
    used low=1, high=4 and an 8192 original context, so assume those and check that
    they reproduce the stored tensor rather than silently running with a wrong RoPE.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(float(rope_freqs.max())),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_factors(head_dim, theta, scaling)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-3):
        raise UnsupportedModelError("GGUF rope_freqs do not match Llama 3 rope scaling; not supported")
    return scaling


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        if orig := meta.get(f"{arch}.rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn are)")


def build_config(
    meta: dict[str, Any],
    *,
    vocab_size: int,
    q_proj_rows: int,
    tied: bool,
    attention_bias: bool,
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    """HF `config.json` for the model; tensor-derived facts are passed in by the importer."""
    arch = check_architecture(meta.get("general.architecture"))
    n_heads = int(meta_scalar(meta, f"{arch}.attention.head_count"))
    # qwen3 (and some llamas) have head_dim != hidden_size / n_heads; the Q weight is authoritative.
    head_dim = q_proj_rows // n_heads
    theta = _f32(meta.get(f"{arch}.rope.freq_base", DEFAULT_ROPE_THETA[arch]))
    context = meta.get(f"{arch}.context_length")
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE_CLASS[arch]],
        "model_type": arch,
        "hidden_size": int(meta[f"{arch}.embedding_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "intermediate_size": int(meta_scalar(meta, f"{arch}.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta_scalar(meta, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": theta,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(context) if context else 4096,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = attention_bias
    scaling = _rope_scaling(meta, arch)
    if rope_freqs is not None:
        scaling = _llama3_rope_scaling(rope_freqs, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for key in ("bos", "eos", "padding"):
        if (idx := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(idx)
    # Chat models end a turn with EOT (or EOM) rather than EOS in some GGUFs; stop on all of them.
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
    if len(stops) > 1:
        config["eos_token_id"] = stops
    return config
