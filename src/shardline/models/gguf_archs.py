"""The GGUF architectures shardline imports: for each, the mlx-lm model it becomes and its tensor names.

llama.cpp's converter (convert_hf_to_gguf.py) renames HF tensors to `blk.N.<short>` and, per architecture,
changes some of them on the way; `ArchSpec` says how to undo that:
- `permute_qk`: llama's converter reorders Q/K rows for llama.cpp's interleaved RoPE (llama, granite and
  the models built on them; qwen, gemma, phi3, olmo2 and deepseek2 are stored as in HF);
- `norm_plus_one`: Gemma's converter stores every RMSNorm weight plus one (llama.cpp multiplies by w,
  Gemma by 1 + w); mlx-lm computes 1 + w, so the one is taken off again.
Mixture-of-experts layers are stored as 3-D `ffn_*_exps` [experts, out, in], which is the stacked
`switch_mlp.*` layout mlx-lm's SwitchGLU reads (its sanitize stacks per-expert tensors only when present).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardline.models.errors import UnsupportedModelError

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_DENSE = _NORMS | _ATTENTION | _MLP


def _experts(prefix: str, router: str) -> dict[str, str]:
    return {
        "ffn_gate_inp": router,
        "ffn_gate_exps": f"{prefix}.switch_mlp.gate_proj",
        "ffn_up_exps": f"{prefix}.switch_mlp.up_proj",
        "ffn_down_exps": f"{prefix}.switch_mlp.down_proj",
    }


def _shared(prefix: str) -> dict[str, str]:
    return {f"ffn_{p}_shexp": f"{prefix}.{p}_proj" for p in ("gate", "up", "down")}


# Gemma 2/3 norm around both halves of the layer; llama.cpp's ffn_norm is Gemma's pre-feedforward norm.
_GEMMA = _DENSE | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # mlx-lm's model file
    hf_class: str  # config.json's `architectures`
    layer_names: dict[str, str]  # GGUF `blk.N.<short>` -> mlx-lm name under `model.layers.N.`
    permute_qk: bool = False
    norm_plus_one: bool = False
    default_rope_theta: float = 10000.0  # only when the GGUF omits rope.freq_base
    # DeepSeek's latent attention: newer converters store kv_b_proj as two halves, attn_k_b (transposed)
    # and attn_v_b. "joined": the model reads kv_b_proj (rebuilt from the halves where needed);
    # "halves": the model reads the halves themselves (kv_b_proj only where a file lacks them).
    mla: str = ""


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", _DENSE, permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", _DENSE, default_rope_theta=1e6),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", _DENSE, default_rope_theta=1e6),
    "gemma2": ArchSpec("gemma2", "Gemma2ForCausalLM", _GEMMA, norm_plus_one=True),
    "gemma3": ArchSpec(
        "gemma3_text", "Gemma3ForCausalLM", _GEMMA, norm_plus_one=True, default_rope_theta=1e6
    ),
    "phi3": ArchSpec(
        "phi3",
        "Phi3ForCausalLM",
        # phi3 keeps Q, K, V fused and gate and up fused (gate first), as HF and mlx-lm do.
        _NORMS
        | {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj"}
        | {"ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    ),
    "qwen2moe": ArchSpec(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _DENSE
        | _experts("mlp", "mlp.gate")
        | _shared("mlp.shared_expert")
        | {"ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
        default_rope_theta=1e6,
    ),
    "qwen3moe": ArchSpec(
        "qwen3_moe", "Qwen3MoeForCausalLM", _DENSE | _experts("mlp", "mlp.gate"), default_rope_theta=1e6
    ),
    "deepseek2": ArchSpec(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        _NORMS
        | _MLP
        | _experts("mlp", "mlp.gate")
        | _shared("mlp.shared_experts")
        | {
            "attn_q": "self_attn.q_proj",
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            "attn_kv_b": "self_attn.kv_b_proj",
            "attn_output": "self_attn.o_proj",
        },
        mla="joined",
    ),
    "olmo2": ArchSpec(
        "olmo2",
        "Olmo2ForCausalLM",
        # OLMo 2 normalises after attention and after the MLP, not before; its q/k norms span all heads.
        _ATTENTION
        | _MLP
        | {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    ),
    "granite": ArchSpec("granite", "GraniteForCausalLM", _DENSE, permute_qk=True),
    "granitemoe": ArchSpec(
        "granitemoe",
        "GraniteMoeForCausalLM",
        _NORMS | _ATTENTION | _experts("block_sparse_moe", "block_sparse_moe.router.layer"),
        permute_qk=True,
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHS)
# deepseek2 files with sigmoid expert gating (DeepSeek V3, R1, Kimi K2) are mlx-lm's deepseek_v3, which
# reads the halves of kv_b as its per-head embed_q / unembed_out and has the router's selection bias.
DEEPSEEK_V3 = replace(
    ARCHS["deepseek2"],
    model_type="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    layer_names=ARCHS["deepseek2"].layer_names
    | {
        "attn_k_b": "self_attn.embed_q",
        "attn_v_b": "self_attn.unembed_out",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    },
    mla="halves",
)
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# Expert routers stay float32 even where a file quantized them: some of mlx-lm's routers (deepseek_v2's
# MoEGate) are plain weights that cannot load quantized, and they are a sliver of the bytes.
FLOAT_ONLY = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp"})


def arch_spec(arch: str | None, meta: dict[str, Any] | None = None) -> ArchSpec:
    """The spec of a GGUF `general.architecture` (and, where one architecture is two mlx-lm models, of
    its metadata), or UnsupportedModelError naming the supported ones."""
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if arch == "deepseek2" and (meta or {}).get(f"{arch}.expert_gating_func") == SIGMOID_GATING:
        return DEEPSEEK_V3
    return ARCHS[arch]


def layer_short_name(gguf_name: str) -> str | None:
    """`attn_k_b` for `blk.3.attn_k_b.weight`; None for a tensor outside the layers."""
    parts = gguf_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() else None


def hf_name(gguf_name: str, spec: ArchSpec) -> str:
    """HF/mlx-lm parameter name for a GGUF tensor name (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[parts[0]]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            if (whole := f"{parts[2]}.{kind}") in spec.layer_names:  # a parameter, not a module's
                return f"model.layers.{parts[1]}.{spec.layer_names[whole]}"
            if parts[2] in spec.layer_names:
                return f"model.layers.{parts[1]}.{spec.layer_names[parts[2]]}.{kind}"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no known equivalent in mlx-lm's {spec.model_type}; not supported"
    )


def is_norm(gguf_name: str) -> bool:
    """An RMSNorm weight (the tensors Gemma's converter adds one to)."""
    return gguf_name.endswith("norm.weight")
