"""GGUF import beyond llama: per architecture, a tiny mlx-lm model written as llama.cpp's converter writes
it (testing/tiny_gguf_arch.py), imported, loaded strictly by mlx-lm, and its logits equal to mlx-lm's own
forward on the same weights (as gguf dequantizes them, where stored quantized)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from shardline.compute.gguf_linear import load_model
from shardline.models.errors import UnsupportedModelError
from shardline.models.gguf_archs import SUPPORTED_ARCHITECTURES
from shardline.models.gguf_import import import_gguf
from shardline.testing import arch_zoo
from shardline.testing.tiny_gguf_arch import write_arch_gguf

pytestmark = pytest.mark.timeout(120)

Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _model(mlx_arch: str, tweaks: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    """arch_zoo's tiny model of `mlx_arch` (with `tweaks` to its config), its config and float32 weights,
    norms made random too so that a norm stored wrong shows."""
    config = arch_zoo.tiny_config(mlx_arch) | tweaks
    module = importlib.import_module(f"mlx_lm.models.{mlx_arch}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(1)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value, dtype=np.float32)
        if w.ndim == 1:
            w = w + rng.standard_normal(w.shape).astype(np.float32) * 0.1
        weights[name] = w
    return model, config, weights


def _round_trip(
    tmp_path: Path,
    gguf_arch: str,
    mlx_arch: str,
    tweaks: dict[str, Any] | None = None,
    *,
    qtype: gguf.GGMLQuantizationType | None = None,
    mla_split: bool = True,
    weights_form: str = "affine",
    rtol: float = 1e-4,
) -> dict[str, Any]:
    model, config, weights = _model(mlx_arch, tweaks or {})
    path = tmp_path / f"{gguf_arch}.gguf"
    arch = gguf_arch.split("-")[0]  # a case name: "deepseek2-v3" is a deepseek2 file
    reference = write_arch_gguf(path, arch, weights, config, qtype=qtype, mla_split=mla_split)
    model.load_weights([(k, mx.array(v)) for k, v in reference.items()], strict=True)
    out = import_gguf(path, tmp_path / "imported", progress=False, weights=weights_form)
    imported, _ = load_model(out, strict=True)
    if rtol > 1e-4:  # x rounded to int8 for GGUF blocks: the prompt's logits within it, over the largest
        prompt = mx.array([arch_zoo.PROMPT])
        got, want = np.array(imported(prompt)), np.array(model(prompt))
        assert np.abs(got - want).max() <= rtol * np.abs(want).max()
        return json.loads((out / "config.json").read_text())
    want_tokens, want = arch_zoo.generate(model)
    got_tokens, got = arch_zoo.generate(imported)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    return json.loads((out / "config.json").read_text())


CASES = {
    # gguf arch: (mlx-lm model file, config changes). Mistral 7B / Nemo GGUFs are llama's architecture.
    "llama": ("llama", {"head_dim": 16}),
    "gemma2": ("gemma2", {}),
    # llama.cpp assumes Gemma 3's one global layer in six and its local rope base; the tiny model has them.
    "gemma3": ("gemma3_text", {"sliding_window_pattern": 6, "num_hidden_layers": 6, "rope_theta": 1e6}),
    "phi3": ("phi3", {}),
    # Phi-3's 128k-context models: longrope, its per-frequency factors stored as tensors.
    "phi3-longrope": (
        "phi3",
        {
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 3.25, 8.0],
                "short_factor": [1.0] * 4,
            },
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2moe": ("qwen2_moe", {}),
    "qwen3moe": ("qwen3_moe", {}),
    "deepseek2": ("deepseek_v2", {}),
    # deepseek2 with sigmoid gating (DeepSeek V3, R1, Kimi K2): latent sizes that quantize in groups of 32.
    "deepseek2-v3": ("deepseek_v3", {"kv_lora_rank": 32, "qk_nope_head_dim": 32, "v_head_dim": 32}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "granitemoe": ("granitemoe", {}),
}


@pytest.mark.parametrize("gguf_arch", list(CASES))
def test_round_trip_float(tmp_path: Path, gguf_arch: str) -> None:
    mlx_arch, tweaks = CASES[gguf_arch]
    config = _round_trip(tmp_path, gguf_arch, mlx_arch, tweaks)
    assert config["model_type"] == mlx_arch
    assert "quantization" not in config
    if gguf_arch == "phi3-longrope":
        assert config["rope_scaling"]["long_factor"] == [1.0, 1.5, 3.25, 8.0]


def test_quantized_experts_dequantized_on_request(tmp_path: Path) -> None:
    config = _round_trip(tmp_path, "qwen2moe", "qwen2_moe", qtype=Q8_0, weights_form="float32")
    assert "quantization" not in config


@pytest.mark.parametrize(
    ("gguf_arch", "qtype"),
    [
        ("qwen2moe", Q8_0),
        ("qwen3moe", Q4_0),
        ("deepseek2", Q8_0),
        ("deepseek2-v3", Q4_0),
        ("granitemoe", Q4_0),
        ("gemma3", Q8_0),
    ],
)
def test_round_trip_quantized_experts(
    tmp_path: Path, gguf_arch: str, qtype: gguf.GGMLQuantizationType
) -> None:
    """3-D expert stacks stay quantized, each expert's [out, in] slice as QuantizedSwitchLinear reads it."""
    mlx_arch, tweaks = CASES[gguf_arch]
    config = _round_trip(tmp_path, gguf_arch, mlx_arch, tweaks, qtype=qtype)
    assert config["quantization"]["bits"] == (8 if qtype == Q8_0 else 4)
    weights = mx.load(str(tmp_path / "imported" / "model.safetensors"))
    stacks = [k for k in weights if ".switch_mlp." in k and k.endswith(".scales")]
    assert stacks or gguf_arch == "gemma3"
    for name in stacks:
        assert weights[name].ndim == 3 and weights[name.replace(".scales", ".weight")].dtype == mx.uint32
    if gguf_arch == "deepseek2-v3":  # the latent attention's per-head halves stay quantized too
        assert weights["model.layers.0.self_attn.embed_q.scales"].ndim == 3


@pytest.mark.parametrize("case", ["deepseek2", "deepseek2-v3"])
def test_deepseek2_with_kv_b_as_one_tensor(tmp_path: Path, case: str) -> None:
    """Files from before llama.cpp's absorbed MLA store kv_b whole and the per-head K/V sizes plainly.
    (Its latent rank of 16 keeps kv_b float: deepseek_v3's loader requantizes a quantized kv_b per head,
    which would differ from the reference by its own rounding.)"""
    _round_trip(tmp_path, case, CASES[case][0], qtype=Q8_0, mla_split=False)


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'falcon' is not supported") as err:
        import_gguf(path, tmp_path / "out", progress=False)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("gguf_arch", "qtype"),
    [
        ("llama", Q4_0),
        ("gemma2", Q8_0),
        ("gemma3", Q8_0),
        ("phi3", Q4_0),
        ("qwen3moe", Q4_0),
        ("olmo2", Q8_0),
    ],
)
def test_round_trip_blocks(tmp_path: Path, gguf_arch: str, qtype: gguf.GGMLQuantizationType) -> None:
    """The default form, GGUF blocks as stored, for each architecture's matrices (expert stacks stay affine):
    the model's own forward on the kernel's products is the float model's within x's int8 rounding (up to 13%
    of the largest logit on these random tiny models; a wrong layout is off by all of it)."""
    mlx_arch, tweaks = CASES[gguf_arch]
    config = _round_trip(
        tmp_path, gguf_arch, mlx_arch, tweaks, qtype=qtype, weights_form="quantized", rtol=0.15
    )
    assert config["gguf_quantization"]
    assert all(v == qtype.name for v in config["gguf_quantization"].values())
