"""Synthetic mixtures of experts: the tensor lists and configs of `shardline models synth --arch qwen3_moe`
and `--arch deepseek_v3`, in the layout mlx-lm's own quantized checkpoints of those families have.

- qwen3_moe: llama-like attention with per-head q/k norms; every layer (but the first `dense_layers`, as
  `mlp_only_layers`) a router `mlp.gate` (E, hidden) and the experts stacked as
  `mlp.switch_mlp.{gate,up,down}_proj` (E, out, in), as mlx-lm's sanitize stacks them. Quantized, the router
  is 8-bit in groups of 64, as the model's own `quant_predicate` leaves it (recorded per path in config.json's
  `quantization`, as mlx_lm.convert records it).
- deepseek_v3: multi-head latent attention (q_a/q_b through the query's rank, kv_a_proj_with_mqa, and the
  per-head `embed_q` (heads, kv_lora_rank, nope) and `unembed_out` (heads, v, kv_lora_rank) that mlx-lm's
  sanitize makes of kv_b_proj and saves), the first `dense_layers` layers a dense MLP, then a float router
  (mlx-lm's MoEGate is never quantized) with its float32 score-correction bias, stacked routed experts and
  `shared_experts` experts' worth of always-on MLP.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.models.synth import PlannedTensor, SynthSpec

MOE_ARCHITECTURES = ("qwen3_moe", "deepseek_v3")
ROUTER_BITS, ROUTER_GROUP = 8, 64  # qwen3_moe's quant_predicate for mlp.gate
# Small shapes that write and run in seconds; every option given on the command line replaces its default.
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3_moe": {
        "layers": 4,
        "hidden": 512,
        "intermediate": 1536,
        "heads": 8,
        "kv_heads": 4,
        "experts": 16,
        "active": 4,
        "moe_intermediate": 256,
    },
    "deepseek_v3": {
        "layers": 4,
        "hidden": 512,
        "intermediate": 1536,
        "heads": 8,
        "kv_heads": 8,
        "experts": 16,
        "active": 4,
        "moe_intermediate": 256,
        "shared_experts": 1,
        "dense_layers": 1,
        "expert_groups": 4,
        "active_groups": 2,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "rope_head_dim": 32,
        "nope_head_dim": 64,
        "v_head_dim": 64,
    },
}
_MOE_FIELDS = ("experts", "active", "moe_intermediate", "shared_experts", "dense_layers")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "rope_head_dim", "nope_head_dim", "v_head_dim")


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_moe(spec: SynthSpec) -> list[tuple[str, int]]:
    """Refuse what the architecture cannot be (ValueError, one line naming the options); the dimensions a
    quantized model's groups must divide, by option name."""
    if spec.arch == "llama":
        given = [f for f in (*_MOE_FIELDS, *_MLA_FIELDS) if getattr(spec, f)]
        if given or spec.expert_groups != 1 or spec.active_groups != 1:
            option = _option(given[0]) if given else "--expert-groups"
            raise ValueError(f"{option} is for a mixture of experts: add --arch qwen3_moe or deepseek_v3")
        return [("hidden", spec.hidden), ("intermediate", spec.intermediate)]
    if spec.arch not in MOE_ARCHITECTURES:
        raise ValueError(f"arch must be llama, {' or '.join(MOE_ARCHITECTURES)}; got {spec.arch!r}")
    if min(spec.experts, spec.active, spec.moe_intermediate) < 1:
        raise ValueError("--experts, --active and --moe-intermediate must be >= 1")
    if spec.active > spec.experts:
        raise ValueError(f"--active {spec.active} is more than the {spec.experts} experts")
    if not 0 <= spec.dense_layers < spec.layers:
        raise ValueError(f"--dense-layers must be 0 to {spec.layers - 1} (one layer at least has experts)")
    if spec.shared_experts < 0:
        raise ValueError("--shared-experts must be >= 0")
    dims = [("hidden", spec.hidden), ("moe-intermediate", spec.moe_intermediate)]
    if spec.dense_layers:
        dims.append(("intermediate", spec.intermediate))
    if spec.arch == "qwen3_moe":
        if spec.shared_experts:
            raise ValueError("qwen3_moe has no shared experts (--shared-experts is deepseek_v3's)")
        if given := [f for f in _MLA_FIELDS if getattr(spec, f)]:
            raise ValueError(f"{_option(given[0])} is deepseek_v3's latent attention, not qwen3_moe's")
        if spec.expert_groups != 1 or spec.active_groups != 1:
            raise ValueError("--expert-groups and --active-groups are deepseek_v3's routing, not qwen3_moe's")
        if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
            raise ValueError(
                f"hidden {spec.hidden} must split into {spec.heads} heads of {spec.kv_heads} groups"
            )
        return dims
    # deepseek_v3
    if spec.tied:
        raise ValueError("deepseek_v3 has its own output head: --tied is llama's and qwen3_moe's")
    if min(spec.kv_lora_rank, spec.rope_head_dim, spec.nope_head_dim, spec.v_head_dim) < 1:
        raise ValueError("--kv-lora-rank, --rope-head-dim, --nope-head-dim and --v-head-dim must be >= 1")
    if spec.q_lora_rank < 0:
        raise ValueError("--q-lora-rank must be >= 0 (0: a full-rank query)")
    if spec.rope_head_dim % 2:
        raise ValueError(f"--rope-head-dim {spec.rope_head_dim} must be even (rotary pairs)")
    groups, chosen = spec.expert_groups, spec.active_groups
    if groups < 1 or spec.experts % groups or not 1 <= chosen <= groups:
        raise ValueError(
            f"--expert-groups {groups} must divide the {spec.experts} experts (--active-groups: 1 to it)"
        )
    if groups > 1 and spec.experts // groups < 2:
        raise ValueError("each expert group needs 2 experts at least (a group scores by its best two)")
    if spec.active > chosen * (spec.experts // groups):
        raise ValueError(f"--active {spec.active} is more than the experts of {chosen} of {groups} groups")
    dims += [("kv-lora-rank", spec.kv_lora_rank), ("nope-head-dim", spec.nope_head_dim)]
    dims.append(("heads x v-head-dim", spec.heads * spec.v_head_dim))
    if spec.q_lora_rank:
        dims.append(("q-lora-rank", spec.q_lora_rank))
    return dims


def _is_moe_layer(spec: SynthSpec, n: int) -> bool:
    return n >= spec.dense_layers


def plan_moe(spec: SynthSpec, std: float, out_std: float) -> list[PlannedTensor]:
    """Every tensor of a mixture-of-experts model, in file order (layer by layer)."""
    from shardline.models.synth import PlannedTensor as T

    h, q = spec.hidden, bool(spec.bits)
    # The router sees the normed residual (unit scale): logits of unit spread route decisively.
    router_std = 1.0 / math.sqrt(h)
    out = [T("model.embed_tokens.weight", (spec.vocab, h), std, q)]
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        out.append(T(p + "input_layernorm.weight", (h,), 0.0, False))
        out += _attention(spec, p + "self_attn.", std, out_std)
        out.append(T(p + "post_attention_layernorm.weight", (h,), 0.0, False))
        if not _is_moe_layer(spec, n):
            out += _mlp(p + "mlp.", spec.intermediate, h, std, out_std, q)
            continue
        e, i = spec.experts, spec.moe_intermediate
        if spec.arch == "qwen3_moe":
            # Quantized as mlx-lm's predicate says where its groups of 64 fit the hidden size, else float.
            router_q = q and h % ROUTER_GROUP == 0
            out.append(T(p + "mlp.gate.weight", (e, h), router_std, router_q, ROUTER_BITS, ROUTER_GROUP))
        else:
            out.append(T(p + "mlp.gate.weight", (e, h), router_std, False))
            out.append(T(p + "mlp.gate.e_score_correction_bias", (e,), 0.01, False, dtype="float32"))
        s = p + "mlp.switch_mlp."
        out += [
            T(s + "gate_proj.weight", (e, i, h), std, q),
            T(s + "up_proj.weight", (e, i, h), std, q),
            T(s + "down_proj.weight", (e, h, i), out_std, q),
        ]
        if spec.arch == "deepseek_v3" and spec.shared_experts:
            out += _mlp(p + "mlp.shared_experts.", i * spec.shared_experts, h, std, out_std, q)
    out.append(T("model.norm.weight", (h,), 0.0, False))
    if not spec.tied:
        out.append(T("lm_head.weight", (spec.vocab, h), std, q))
    return out


def _mlp(p: str, i: int, h: int, std: float, out_std: float, q: bool) -> list[PlannedTensor]:
    from shardline.models.synth import PlannedTensor as T

    return [
        T(p + "gate_proj.weight", (i, h), std, q),
        T(p + "up_proj.weight", (i, h), std, q),
        T(p + "down_proj.weight", (h, i), out_std, q),
    ]


def _attention(spec: SynthSpec, p: str, std: float, out_std: float) -> list[PlannedTensor]:
    from shardline.models.synth import PlannedTensor as T

    h, q, heads = spec.hidden, bool(spec.bits), spec.heads
    if spec.arch == "qwen3_moe":
        d, kv = spec.head_dim, spec.kv_heads * spec.head_dim
        return [
            T(p + "q_proj.weight", (heads * d, h), std, q),
            T(p + "k_proj.weight", (kv, h), std, q),
            T(p + "v_proj.weight", (kv, h), std, q),
            T(p + "o_proj.weight", (h, heads * d), out_std, q),
            T(p + "q_norm.weight", (d,), 0.0, False),
            T(p + "k_norm.weight", (d,), 0.0, False),
        ]
    rank, rope, nope, v = spec.kv_lora_rank, spec.rope_head_dim, spec.nope_head_dim, spec.v_head_dim
    if spec.q_lora_rank:
        query = [
            T(p + "q_a_proj.weight", (spec.q_lora_rank, h), std, q),
            T(p + "q_a_layernorm.weight", (spec.q_lora_rank,), 0.0, False),
            T(p + "q_b_proj.weight", (heads * (nope + rope), spec.q_lora_rank), std, q),
        ]
    else:
        query = [T(p + "q_proj.weight", (heads * (nope + rope), h), std, q)]
    return [
        *query,
        T(p + "kv_a_proj_with_mqa.weight", (rank + rope, h), std, q),
        T(p + "kv_a_layernorm.weight", (rank,), 0.0, False),
        # kv_b_proj as mlx-lm's sanitize splits it (and mlx-lm saves it): per head, keys' and values' halves.
        T(p + "embed_q.weight", (heads, rank, nope), std, q),
        T(p + "unembed_out.weight", (heads, v, rank), std, q),
        T(p + "o_proj.weight", (h, heads * v), out_std, q),
    ]


def config_moe(spec: SynthSpec) -> dict:
    """config.json's architecture part, as mlx-lm's ModelArgs of the family read it."""
    common = {
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_attention_heads": spec.heads,
        "num_experts_per_tok": spec.active,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": spec.tied,
        "attention_bias": False,
        "hidden_act": "silu",
    }
    if spec.arch == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "num_key_value_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "num_experts": spec.experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(spec.dense_layers)),
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **common,
        "num_key_value_heads": spec.heads,  # latent attention: every head reads the one latent
        "n_routed_experts": spec.experts,
        "n_shared_experts": spec.shared_experts or None,
        "routed_scaling_factor": spec.routed_scaling,
        "first_k_dense_replace": spec.dense_layers,
        "moe_layer_freq": 1,
        "n_group": spec.expert_groups,
        "topk_group": spec.active_groups,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_rope_head_dim": spec.rope_head_dim,
        "qk_nope_head_dim": spec.nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "num_nextn_predict_layers": 0,
    }


def inactive_parameters(spec: SynthSpec) -> int:
    """Routed experts' parameters a token does not use: all but `active` of each MoE layer's experts."""
    if spec.arch == "llama":
        return 0
    moe_layers = sum(_is_moe_layer(spec, n) for n in range(spec.layers))
    return moe_layers * (spec.experts - spec.active) * 3 * spec.hidden * spec.moe_intermediate


def describe_arch(spec: SynthSpec) -> str:
    """The architecture in a few words, for the CLI's summary."""
    if spec.arch == "llama":
        return "llama"
    shared = f" + {spec.shared_experts} shared" if spec.shared_experts else ""
    return f"{spec.arch}, {spec.experts} experts ({spec.active} active{shared})"
