"""The tiny sizes that testing/arch_zoo.py fills into every mlx-lm architecture's ModelArgs.

One place for every size: COMMON by field name (applied wherever a ModelArgs has that field, so large
defaults shrink too), FILL_BY_TYPE for required fields COMMON does not name, and OVERRIDES per model_type
for what an architecture needs beyond that.
"""

from __future__ import annotations

from typing import Any

VOCAB = 512  # the byte-level tokenizer of models/synth.py needs at least 259
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
LAYERS = 4
EXPERTS = 4
ACTIVE_EXPERTS = 2
WINDOW = 8  # below the survey's 24 tokens, so that sliding-window caches rotate

COMMON: dict[str, Any] = {
    # dense transformer
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "num_transformer_layers": LAYERS,
    "intermediate_size": 2 * HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "model_max_length": 256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "partial_rotary_factor": 0.5,
    "rotary_dim": HEAD_DIM // 2,
    "rope_scaling": None,
    # gpt2-style names
    "n_embd": HIDDEN,
    "n_head": HEADS,
    "n_layer": LAYERS,
    "n_inner": 2 * HIDDEN,
    "d_model": HIDDEN,
    "n_heads": HEADS,
    "n_kv_heads": KV_HEADS,
    "n_layers": LAYERS,
    "num_heads": HEADS,
    "model_dim": HIDDEN,
    "hidden_dim": 2 * HIDDEN,
    "ffn_hidden_size": 2 * HIDDEN,
    # sliding window
    "sliding_window": WINDOW,
    "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW,
    "window_size": WINDOW,
    # mixture of experts
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": ACTIVE_EXPERTS,
    "moe_topk": ACTIVE_EXPERTS,
    "moe_top_k": ACTIVE_EXPERTS,
    "moe_intermediate_size": HIDDEN // 2,
    "expert_ffn_hidden_size": HIDDEN // 2,
    "shared_expert_intermediate_size": HIDDEN // 2,
    "moe_shared_expert_intermediate_size": HIDDEN // 2,
    "shared_intermediate_size": HIDDEN // 2,
    "share_expert_dim": HIDDEN // 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # latent attention (MLA) and its sparse indexer
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": HEAD_DIM,
    "index_head_dim": HEAD_DIM,
    "index_n_heads": 2,
    "index_topk": 8,
    # recurrent and state-space layers
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_chunk_size": 8,
    "mamba_d_ssm": 2 * HIDDEN,
    "mamba_d_head": 16,
    "mamba_n_heads": 8,
    "mamba_n_groups": 1,
    "conv_kernel": 4,
    "conv_L_cache": 3,
    "n_groups": 1,
    "time_step_rank": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "linear_conv_kernel_dim": 4,
    # large per-layer-input tables (gemma3n) and other big defaults
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "global_head_dim": HEAD_DIM,
    "query_pre_attn_scalar": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "hidden_size_per_head": HEAD_DIM,
    "num_vocab": VOCAB,
    "candidate_topk_blocks": 8,
}

# Required fields COMMON does not name: a small value of the annotated kind.
FILL_BY_TYPE: dict[str, Any] = {
    "int": 2,
    "float": 1.0,
    "bool": False,
    "str": "",
    "list": [],
    "tuple": (0.0, float("inf")),
    "dict": {},
}

# Vision-language wrappers whose text model has its own file: the sibling is surveyed, the wrapper is not.
WRAPPERS: dict[str, str] = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "kimi_k25": "deepseek_v3",
    "kimi_vl": "deepseek_v3",
    "lfm2-vl": "lfm2",
    "llama4": "llama4_text",
    "mistral3": "ministral3",
    "pixtral": "llama",
    "qwen2_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
}

# What an architecture needs beyond COMMON (its ModelArgs filters out keys it does not have): the layer
# patterns, rope parameters and routing choices its published configs always set.
_FULL, _SLIDING = "full_attention", "sliding_attention"
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256}
_LLAMA4_SCALING = {
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 256,
    "rope_theta": 10000.0,
}
_LINEAR_ATTN = {
    "kda_layers": [1, 3],
    "full_attn_layers": [2, 4],
    "num_heads": HEADS,
    "head_dim": HEAD_DIM,
    "short_conv_kernel_size": 4,
}
_ROPE = {"rope_theta": 10000.0}
_LONGCAT = {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"}
_NAS_BLOCK = {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}}

OVERRIDES: dict[str, dict[str, Any]] = {
    "afmoe": {"layer_types": [_SLIDING, _FULL, _SLIDING, _FULL]},
    "dbrx": {
        "ffn_config": {
            "ffn_hidden_size": HIDDEN // 2,
            "moe_num_experts": EXPERTS,
            "moe_top_k": ACTIVE_EXPERTS,
        },
        "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "deepseek_v2": {"rope_scaling": _YARN},
    "exaone4": {"sliding_window_pattern": "LLLG"},
    "exaone_moe": {
        "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL],
        "is_moe_layer": [False, True, True, True],
    },
    "gear": {"layer_types": [_SLIDING, _FULL, _SLIDING, _FULL]},
    "gemma3_text": {"sliding_window_pattern": 2},
    "glm_moe_dsa": {"rope_parameters": _ROPE, "topk_method": "noaux_tc"},
    "gemma3n": {
        "text_config": {
            "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL],
            "num_kv_shared_layers": 2,
            "activation_sparsity_pattern": [0.0] * LAYERS,
            "altup_num_inputs": 2,
            "altup_active_idx": 0,
            "laurel_rank": 8,
            "final_logit_softcapping": 30.0,
        }
    },
    "gemma4_text": {"num_kv_shared_layers": 2, "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL]},
    # Its published scales, not the 1.0 a float field gets: a path that skips one would still agree.
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625,
        "logits_scaling": 8.0,
    },
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    "kimi_k3": {"text_config": {"linear_attn_config": _LINEAR_ATTN, "num_experts_per_token": ACTIVE_EXPERTS}},
    "kimi_linear": {"linear_attn_config": _LINEAR_ATTN},
    "lfm2": {"full_attn_idxs": [1, 3], "block_dim": HIDDEN, "block_multiple_of": 16},
    "lfm2_moe": {"full_attn_idxs": [1, 3], "num_dense_layers": 1},
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0]},
    "mellum": {
        "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL],
        "rope_parameters": {_FULL: {"rope_theta": 10000.0}, _SLIDING: {"rope_theta": 10000.0}},
    },
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "swa_num_attention_heads": HEADS,
        "swa_num_key_value_heads": KV_HEADS,
        "swa_head_dim": HEAD_DIM,
        "swa_v_head_dim": HEAD_DIM,
        "v_head_dim": HEAD_DIM,
        "swa_rope_theta": 10000.0,
        "topk_method": "noaux_tc",
    },
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": _LONGCAT,
    "muse_spark": {
        "text_config": {
            "num_shared_experts": 0,
            "rope_parameters": _ROPE,
            "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL],
            "layer_rope_theta": [10000.0] * LAYERS,
            "final_logit_softcapping": 30.0,
        }
    },
    "nemotron-nas": {"block_configs": [_NAS_BLOCK] * LAYERS},
    "nemotron_h": {"layers_block_type": ["mamba", "attention", "mlp", "moe"]},
    "spark2_5": {"rope_parameters": {_FULL: _ROPE, _SLIDING: _ROPE}},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 256}},
    "ministral3": {"rope_parameters": _LLAMA4_SCALING},
    "mistral4": {"rope_parameters": _LLAMA4_SCALING},
    "openelm": {
        "num_query_heads": [HEADS] * LAYERS,
        "num_kv_heads": [KV_HEADS] * LAYERS,
        "ffn_multipliers": [2.0] * LAYERS,
        "ffn_dim_divisor": 16,
    },
    "phi3small": {
        "ff_intermediate_size": 2 * HIDDEN,
        "gegelu_limit": 20.0,
        "blocksparse_block_size": 32,
        "blocksparse_num_local_blocks": 2,
        "blocksparse_vert_stride": 2,
    },
    "plamo": {"n_shared_head": 2},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": HIDDEN, "conv1d_width": 4},
    "phixtral": {"rotary_dim": HEAD_DIM // 2},
}

# Kinds the caches and modules tell wrongly: these state caches hold an n-gram embedding's context
# (longcat_flash_ngram) or a short convolution over the keys (baichuan_m1), not a recurrence.
KINDS: dict[str, str] = {"longcat_flash_ngram": "MLA+MoE", "baichuan_m1": "dense"}
