"""Which mlx-lm architectures the engine cannot split into stages, or cannot serve at all, and why.

A stage hands the next one hidden states (1, n, D) and nothing else. Some architectures pass more than
that from one layer to the next: these run on one stage only (`PIPELINE_REFUSED`). Others do not run on
CPU at all (`REFUSED`). tests/test_arch_matrix.py checks both tables against what every
architecture does (testing/arch_matrix.py), so that neither can rot.
"""

from __future__ import annotations

# model_type -> why its layers cannot be split across stages, in one line.
PIPELINE_REFUSED: dict[str, str] = {
    "afm7": "its last layers (kv_reuse_layers) attend with the last full layer's keys and values",
    "deepseek_v41": "its layers pass hyper-connection streams and their pre-mix, not one hidden state",
    "gemma3n": "its layers carry AltUp streams, take inputs from the token ids and share KV",
    "gemma4_text": "its layers take inputs from the token ids and later ones reuse earlier KV",
    "hunyuan": "its layers return the keys and values that the next layers reuse (cross-layer attention)",
    "iquestloopcoder": "it runs every layer twice, the second time with the first time's KV",
    "kimi_k3": "its layers pass the outputs of earlier blocks (attention residuals), not one hidden state",
    "talkie": "each block adds the normalised token embeddings (embed_skip), which a later stage lacks",
    "rwkv7": "its layers pass the first layer's values (v_first) along with the hidden states",
}

# model_type -> why it is not served at all, in one line.
REFUSED: dict[str, str] = {
    "bitnet": "its BitLinear layers run a Metal kernel, which has no CPU back-end",
    "muse_spark": "its fused kernels (mlx_lm.kernels) are Metal kernels without a CPU back-end",
    "olmo": "mlx-lm's olmo needs the ai2-olmo package, which is not installed",
    "phi3small": "mlx-lm's phi3small aborts the process on CPU (heap corruption in native code)",
}


def pipeline_refusal(model_type: str, stages: int) -> str:
    """Why `stages` stages cannot serve `model_type` ("" when they can)."""
    if model_type in REFUSED:
        return REFUSED[model_type]
    if stages > 1 and model_type in PIPELINE_REFUSED:
        return f"{model_type} runs on one stage only: {PIPELINE_REFUSED[model_type]}"
    return ""
