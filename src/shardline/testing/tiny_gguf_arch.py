"""A tiny mlx-lm model (testing/arch_zoo.py) written as a GGUF the way llama.cpp's convert_hf_to_gguf does.

Names come from gguf-py's own HF -> GGUF table (`gguf.get_tensor_name_map`), stacked experts as the
converter stacks them, and the converter's per-architecture changes are made here independently of the
importer: llama's Q/K row permutation, Gemma's norms stored plus one, DeepSeek's kv_b split into a
transposed K half and a V half. Metadata is what the converter's set_gguf_parameters writes from the
model's config. For the import round trip of tests/test_gguf_architectures.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shardline.testing.tiny_gguf import TINY_SPECIALS, TINY_TEMPLATE, bytes_to_unicode, llama_cpp_permute

# mlx-lm's module names that gguf-py's table knows under the converter's (pre-stacking) names.
_RENAMES = (
    (".switch_mlp.", ".experts."),
    ("block_sparse_moe.experts.gate_proj", "block_sparse_moe.gate_exps"),
    ("block_sparse_moe.experts.up_proj", "block_sparse_moe.up_exps"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear"),
)
_GRANITE_EXPERTS = {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps"}
PERMUTED = ("llama", "granite", "granitemoe")


def gguf_name(hf: str, arch: str, n_layers: int) -> str:
    """The GGUF name convert_hf_to_gguf gives an HF (mlx-lm) parameter of `arch`."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_arch_enum(arch)], n_layers)
    stem, kind = hf.rsplit(".", 1)
    for old, new in _RENAMES:
        stem = stem.replace(old, new)
    if stem.rsplit(".", 1)[-1] in _GRANITE_EXPERTS:  # the converter splits granitemoe's input_linear itself
        layer = stem.split(".")[2]
        return f"blk.{layer}.{_GRANITE_EXPERTS[stem.rsplit('.', 1)[-1]]}.{kind}"
    name = table.get_name(stem)
    if name is None:
        raise KeyError(f"gguf-py has no GGUF name for {hf} in {arch}")
    return f"{name}.{kind}"


def _arch_enum(arch: str) -> str:
    return {"granitemoe": "GRANITE_MOE"}.get(arch, arch.upper())


def _tokenizer(writer: gguf.GGUFWriter) -> None:
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", *TINY_SPECIALS]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TINY_TEMPLATE)


def _metadata(writer: gguf.GGUFWriter, arch: str, c: dict[str, Any], mla_split: bool) -> None:
    """set_gguf_parameters of the converter, for the fields these tiny configs use."""

    def put(key: str, value: Any) -> None:
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        else:
            writer.add_float32(full, float(value))

    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    put("block_count", c["num_hidden_layers"])
    put("context_length", c.get("max_position_embeddings", 256))
    put("embedding_length", c["hidden_size"])
    put("feed_forward_length", c["intermediate_size"])
    put("attention.head_count", heads)
    put("attention.head_count_kv", c.get("num_key_value_heads", heads))
    put("attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    put("rope.freq_base", c.get("rope_theta", 10000.0))
    if arch not in ("deepseek2", "phi3"):
        put("attention.key_length", head_dim)
        put("attention.value_length", head_dim)
    if arch == "gemma2":
        put("attn_logit_softcapping", c.get("attn_logit_softcapping", 50.0))
        put("final_logit_softcapping", c.get("final_logit_softcapping", 30.0))
    if arch in ("gemma2", "gemma3") and c.get("sliding_window"):
        put("attention.sliding_window", c["sliding_window"])
    if arch == "phi3":
        put("rope.dimension_count", int(head_dim * c.get("partial_rotary_factor", 1.0)))
        if c.get("rope_scaling"):  # longrope: its factors are tensors (written with the weights)
            put("rope.scaling.original_context_length", c["original_max_position_embeddings"])
    experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if experts:
        put("expert_count", experts)
        put("expert_used_count", c["num_experts_per_tok"])
        put("expert_feed_forward_length", c.get("moe_intermediate_size") or c["intermediate_size"])
    if arch == "qwen2moe":
        put("expert_shared_feed_forward_length", c["shared_expert_intermediate_size"])
    if arch in ("granite", "granitemoe"):
        put("attention.scale", c["attention_multiplier"])
        put("embedding_scale", c["embedding_multiplier"])
        put("residual_scale", c["residual_multiplier"])
        put("logit_scale", c["logits_scaling"])
    if arch == "deepseek2":
        rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        put("leading_dense_block_count", c["first_k_dense_replace"])
        put("attention.q_lora_rank", c["q_lora_rank"])
        put("attention.kv_lora_rank", c["kv_lora_rank"])
        put("rope.dimension_count", rope)
        put("expert_shared_count", c["n_shared_experts"])
        put("expert_weights_scale", c["routed_scaling_factor"])
        v3 = c.get("model_type") == "deepseek_v3"
        put("expert_gating_func", 2 if v3 else 1)  # sigmoid (DeepSeek V3) or softmax
        if v3:
            put("expert_weights_norm", bool(c.get("norm_topk_prob", True)))
        if mla_split:  # as the converter for llama.cpp's absorbed MLA writes it: one latent KV head
            put("attention.head_count_kv", 1)
            put("attention.key_length", c["kv_lora_rank"] + rope)
            put("attention.value_length", c["kv_lora_rank"])
            put("attention.key_length_mla", nope + rope)
            put("attention.value_length_mla", v)
        else:
            put("attention.key_length", nope + rope)
            put("attention.value_length", v)


def _hf_tensors(
    weights: dict[str, np.ndarray], arch: str, c: dict[str, Any], mla_split: bool
) -> dict[str, np.ndarray]:
    """The converter's per-architecture changes, on HF names (experts stay stacked, 3-D)."""
    out: dict[str, np.ndarray] = {}
    weights = dict(weights)
    for name in [n for n in weights if n.endswith("embed_q.weight")]:
        # deepseek_v3 holds kv_b_proj as per-head halves; HF (and so the converter) has it whole.
        wk = weights.pop(name)  # [heads, kv_lora, nope]
        wv = weights.pop(name.replace("embed_q", "unembed_out"))  # [heads, v, kv_lora]
        kv_b = np.concatenate([wk.transpose(0, 2, 1), wv], axis=1).reshape(-1, wk.shape[1])
        weights[name.replace("embed_q", "kv_b_proj")] = kv_b
    for name, w in weights.items():
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converter
        if arch == "deepseek2" and mla_split and name.endswith("kv_b_proj.weight"):
            heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
            kv_b = w.reshape(heads, nope + v, w.shape[-1])
            k_b = kv_b[:, :nope].transpose(0, 2, 1)  # stored transposed for llama.cpp's absorbed attention
            out[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(k_b)
            out[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(kv_b[:, nope:])
            continue
        out[name] = w
    return out


def write_arch_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    config: dict[str, Any],
    *,
    qtype: gguf.GGMLQuantizationType | None = None,
    mla_split: bool = True,
    keep_float: Callable[[str], bool] = lambda name: False,
) -> dict[str, np.ndarray]:
    """Write mlx-lm `weights` (float32, mlx-lm names) of GGUF architecture `arch` as a GGUF at `path`.

    With `qtype`, every 2-D or 3-D matrix whose rows divide into its blocks (and not `keep_float`) is
    stored quantized; the weights returned are the input with those replaced by gguf's dequantization of
    what was written (the weights an exact import must reproduce)."""
    n_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, config, mla_split)
    _tokenizer(writer)
    reference = dict(weights)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    scaling = config.get("rope_scaling") or {}
    if arch == "phi3" and scaling.get("type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(scaling[f"{kind}_factor"], np.float32))
    for name, w in _hf_tensors(weights, arch, config, mla_split).items():
        data, raw_dtype = np.ascontiguousarray(w, dtype=np.float32), None
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if qtype is not None and w.ndim in (2, 3) and w.shape[-1] % block == 0 and not keep_float(name):
            data, raw_dtype = gguf.quants.quantize(data, qtype), qtype
            mlx_name = name.replace("k_b_proj", "embed_q").replace("v_b_proj", "unembed_out")
            if mlx_name in reference:  # (deepseek_v3's halves are kv_b's, stored as they are)
                reference[mlx_name] = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if arch in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, heads if ".q_proj." in name else kv_heads)
        writer.add_tensor(gguf_name(name, arch, n_layers), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
