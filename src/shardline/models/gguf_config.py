"""Translate GGUF metadata (`<arch>.*` keys) into an HF-style `config.json` for mlx-lm."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardline.models.errors import UnsupportedModelError
from shardline.models.gguf_archs import SUPPORTED_ARCHITECTURES, arch_spec
from shardline.models.gguf_tensors import ROPE_FREQS

__all__ = ["SUPPORTED_ARCHITECTURES", "build_config", "check_architecture", "meta_scalar"]


def check_architecture(arch: str | None) -> str:
    """Return `arch` if shardline can import it, else raise UnsupportedModelError."""
    arch_spec(arch)
    return str(arch)


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


def _count(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = meta_scalar(meta, f"{arch}.{key}", default)
    return int(value) if value is not None else None


def _experts(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """llama.cpp's expert counts under the names qwen2_moe / qwen3_moe / deepseek_v2 read."""
    return {
        "num_experts": _count(meta, arch, "expert_count"),
        "num_experts_per_tok": _count(meta, arch, "expert_used_count"),
        "moe_intermediate_size": _count(meta, arch, "expert_feed_forward_length"),
    }


def _query_pre_attn_scalar(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> float:
    """Gemma scales queries by 1/sqrt(this). GGUF keeps it only as `attention.scale` in newer files;
    llama.cpp otherwise assumes head_dim, except for the 27B models (hidden / heads), known by depth."""
    if scale := meta.get(f"{arch}.attention.scale"):
        return _f32(1.0 / float(scale) ** 2)
    big = {"gemma2": 46, "gemma3": 62}[arch]
    if config["num_hidden_layers"] == big:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _swa_pattern(meta: dict[str, Any], arch: str) -> int:
    """Gemma 3's period of sliding-window layers (every Nth layer is global); llama.cpp assumes 6."""
    value = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not isinstance(value, list):
        return int(value)
    # Per layer, true where the layer slides: a period p has exactly every p-th layer global.
    for p in range(1, len(value) + 1):
        if all(bool(v) == (i % p != p - 1) for i, v in enumerate(value)):
            return p
    raise UnsupportedModelError(f"GGUF sliding-window layers {value} have no period; not supported")


def _arch_config(
    arch: str, meta: dict[str, Any], config: dict[str, Any], extras: dict[str, np.ndarray]
) -> None:
    """What each architecture adds to the common config (in place)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if arch in ("gemma2", "gemma3"):
        config["query_pre_attn_scalar"] = _query_pre_attn_scalar(meta, arch, config)
        config["hidden_act"] = "gelu_pytorch_tanh"
        if window := meta.get(f"{arch}.attention.sliding_window"):
            config["sliding_window"] = int(window)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (value := meta.get(f"{arch}.{key}")) is not None:
                config[key] = _f32(value)
    if arch == "gemma3":
        config["sliding_window_pattern"] = _swa_pattern(meta, arch)
        config["rope_local_base_freq"] = _f32(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
    if arch == "phi3":
        config["head_dim"] = hidden // heads
        rope_dims = int(meta.get(f"{arch}.rope.dimension_count", config["head_dim"]))
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        config["original_max_position_embeddings"] = int(original or config["max_position_embeddings"])
        config.pop("rope_scaling", None)  # phi3 reads only longrope, from the factor tensors
        if "rope_factors_long.weight" in extras:
            config["rope_scaling"] = {
                "type": "longrope",
                "long_factor": [float(x) for x in extras["rope_factors_long.weight"]],
                "short_factor": [float(x) for x in extras["rope_factors_short.weight"]],
            }
    if arch in ("qwen2moe", "qwen3moe"):
        config |= _experts(meta, arch)
        config.setdefault("intermediate_size", config["moe_intermediate_size"])
    if arch == "qwen2moe":
        shared = _count(meta, arch, "expert_shared_feed_forward_length", config["moe_intermediate_size"])
        config["shared_expert_intermediate_size"] = shared
    if arch == "qwen3moe":
        config |= {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "deepseek2":
        _deepseek2(meta, config)
    if arch in ("granite", "granitemoe"):
        for key, name in (
            ("attention.scale", "attention_multiplier"),
            ("embedding_scale", "embedding_multiplier"),
            ("residual_scale", "residual_multiplier"),
            ("logit_scale", "logits_scaling"),
        ):
            config[name] = _f32(meta.get(f"{arch}.{key}", 1.0))
        config["mlp_bias"] = False
    if arch == "granitemoe":
        experts = _experts(meta, arch)
        config["num_local_experts"] = experts["num_experts"]
        config["num_experts_per_tok"] = experts["num_experts_per_tok"]
        # granitemoe's experts are as wide as its intermediate_size says.
        config["intermediate_size"] = experts["moe_intermediate_size"] or config["intermediate_size"]


def _deepseek2(meta: dict[str, Any], config: dict[str, Any]) -> None:
    """DeepSeek V2's latent attention and experts. Files written for llama.cpp's absorbed MLA store K/V
    lengths as `*_mla` and one KV head; the head sizes of HF's config are those."""
    arch = "deepseek2"
    rope = int(meta[f"{arch}.rope.dimension_count"])
    key_len = int(meta.get(f"{arch}.attention.key_length_mla", meta[f"{arch}.attention.key_length"]))
    value_len = int(meta.get(f"{arch}.attention.value_length_mla", meta[f"{arch}.attention.value_length"]))
    groups = int(meta.get(f"{arch}.expert_group_count", 1) or 1)
    experts = _experts(meta, arch)
    config |= {
        "num_key_value_heads": config["num_attention_heads"],
        "kv_lora_rank": int(meta[f"{arch}.attention.kv_lora_rank"]),
        "q_lora_rank": int(meta.get(f"{arch}.attention.q_lora_rank", 0)) or None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_len - rope,
        "v_head_dim": value_len,
        "n_routed_experts": experts["num_experts"],
        "num_experts_per_tok": experts["num_experts_per_tok"],
        "moe_intermediate_size": experts["moe_intermediate_size"],
        "n_shared_experts": _count(meta, arch, "expert_shared_count"),
        "first_k_dense_replace": int(meta.get(f"{arch}.leading_dense_block_count", 0)),
        "routed_scaling_factor": _f32(meta.get(f"{arch}.expert_weights_scale", 1.0)),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups,
        "topk_group": int(meta.get(f"{arch}.expert_group_used_count", groups) or groups),
    }
    config.pop("head_dim", None)
    if config["model_type"] == "deepseek_v3":  # sigmoid gating, the selection bias picking experts
        config |= {
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
        }
    if config["model_type"] == "deepseek_v3" and "rope_scaling" not in config:
        return
    # deepseek_v2 always builds its YaRN rope from rope_scaling; factor 1 is plain RoPE.
    scaling = config.get("rope_scaling") or {"type": "yarn", "factor": 1.0}
    scaling.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if log_mul := meta.get(f"{arch}.rope.scaling.yarn_log_multiplier"):
        scaling["mscale_all_dim"] = scaling["mscale"] = _f32(float(log_mul) / 0.1)
    config["rope_scaling"] = scaling


def build_config(
    meta: dict[str, Any], *, shapes: dict[str, tuple[int, ...]], extras: dict[str, np.ndarray]
) -> dict[str, Any]:
    """HF `config.json` for the model. `shapes`: the HF shape of every weight the import writes (sizes the
    metadata leaves implicit are read off them); `extras`: rope tensors that belong in the config."""
    arch = check_architecture(meta.get("general.architecture"))
    spec = arch_spec(arch, meta)
    n_heads = int(meta_scalar(meta, f"{arch}.attention.head_count"))
    hidden = int(meta[f"{arch}.embedding_length"])
    # qwen3 (and some llamas) have head_dim != hidden_size / n_heads; the Q weight is authoritative.
    q_rows = shapes.get("model.layers.0.self_attn.q_proj.weight", (None,))[0]
    key_length = meta_scalar(meta, f"{arch}.attention.key_length")
    head_dim = q_rows // n_heads if q_rows else int(key_length or hidden // n_heads)
    theta = _f32(meta.get(f"{arch}.rope.freq_base", spec.default_rope_theta))
    context = meta.get(f"{arch}.context_length")
    ffn = meta_scalar(meta, f"{arch}.feed_forward_length")
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta_scalar(meta, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": theta,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "max_position_embeddings": int(context) if context else 4096,
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if ffn:
        config["intermediate_size"] = int(ffn)
    if arch in ("llama", "olmo2", "granite", "granitemoe"):
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in shapes
    scaling = _rope_scaling(meta, arch)
    if (rope_freqs := extras.get(ROPE_FREQS)) is not None:
        scaling = _llama3_rope_scaling(rope_freqs, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    _arch_config(arch, meta, config, extras)
    for key in ("bos", "eos", "padding"):
        if (idx := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(idx)
    # Chat models end a turn with EOT (or EOM) rather than EOS in some GGUFs; stop on all of them.
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
    if len(stops) > 1:
        config["eos_token_id"] = stops
    return config
