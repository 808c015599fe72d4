"""Tiny random GGUF files written the way llama.cpp lays them out: for import tests and a stand-in hub."""

from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (independent of the code under test)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, applied to HF Q/K rows when writing a GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY_SPECIALS = ["<|im_start|>", "<|im_end|>"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    pre: str = "gpt2",
    head_dim: int = 4,
    rope_theta: float = 10000.0,
    rope_freqs: np.ndarray | None = None,
    seed: int = 0,
    hidden: int = 8,
    ffn: int = 16,
    layers: int = 1,
    qtype: gguf.GGMLQuantizationType | None = None,
    split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """Write a random model (1 layer unless told) as GGUF (the way llama.cpp lays it out); return HF weights.

    With `qtype`, every matrix whose rows divide into its blocks is stored as `qtype` (quantized by gguf-py,
    or random blocks for the types it cannot quantize), and the weights returned are gguf's dequantization
    of what was written."""
    rng = np.random.default_rng(seed)
    n_head, n_kv = 2, 1
    tokens = [*bytes_to_unicode().values(), "Ġt", "he", *TINY_SPECIALS]
    types = [1] * (len(tokens) - 2) + [3, 3]
    vocab = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    hf = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        at = f"model.layers.{i}"
        hf |= {
            f"{at}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{at}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
            f"{at}.self_attn.q_proj.weight": rand(n_head * head_dim, hidden),
            f"{at}.self_attn.k_proj.weight": rand(n_kv * head_dim, hidden),
            f"{at}.self_attn.v_proj.weight": rand(n_kv * head_dim, hidden),
            f"{at}.self_attn.o_proj.weight": rand(hidden, n_head * head_dim),
            f"{at}.mlp.gate_proj.weight": rand(ffn, hidden),
            f"{at}.mlp.up_proj.weight": rand(ffn, hidden),
            f"{at}.mlp.down_proj.weight": rand(hidden, ffn),
        }
        if arch == "qwen2":
            for p in "qkv":
                rows = hf[f"{at}.self_attn.{p}_proj.weight"].shape[0]
                hf[f"{at}.self_attn.{p}_proj.bias"] = rand(rows)
        if arch == "qwen3":
            hf[f"{at}.self_attn.q_norm.weight"] = rand(head_dim) + 1
            hf[f"{at}.self_attn.k_norm.weight"] = rand(head_dim) + 1

    names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] = {}
    if qtype is not None:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        for name, array in hf.items():
            if array.ndim == 2 and array.shape[1] % block == 0:
                try:
                    data = gguf.quants.quantize(array, qtype)
                except NotImplementedError:
                    data = random_blocks(rng, qtype, array.shape)
                # Quantized rows stay whole, so llama's row permutation (below) commutes with this.
                hf[name] = gguf.quants.dequantize(data, qtype).reshape(array.shape)
                raw[name] = (data, qtype)

    # split_max_tensors > 0: parts NAME-00001-of-0000N.gguf beside `path`, as gguf-split writes them.
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TINY_TEMPLATE)
    for hf_name, array in hf.items():
        stem, kind = hf_name.rsplit(".", 1)
        if m := re.match(r"model\.layers\.(\d+)\.(.*)", stem):
            name = f"blk.{m[1]}.{names[m[2]]}.{kind}"
        else:
            name = f"{names[stem]}.{kind}"
        data, raw_dtype = raw.get(hf_name, (array, None))
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = llama_cpp_permute(data, n_head if ".attn_q." in name else n_kv)
        # numpy [out, in] is written with GGUF ne = [in, out], as llama.cpp does.
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def random_blocks(
    rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """Random raw blocks of a K-quant type (which gguf-py cannot quantize): random quants and sub-block
    scales, with small finite float16 super-block scales (d and dmin: bytes 0-3; Q6_K's d: bytes 208-209)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = math.prod(shape) // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    at, count = (208, 1) if qtype == gguf.GGMLQuantizationType.Q6_K else (0, 2)
    d = (np.abs(rng.standard_normal((n, count))) * 3e-4).astype("<f2")
    blocks[:, at : at + 2 * count] = d.view(np.uint8)
    return blocks.reshape(shape[0], -1)
