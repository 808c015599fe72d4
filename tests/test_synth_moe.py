"""`shardline models synth --arch qwen3_moe|deepseek_v3`: random mixtures of experts in the layout mlx-lm's
own quantized checkpoints have, loaded by mlx-lm and by the engine's stages alike."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from shardline.cli.main import main
from shardline.models import synth
from shardline.models.footprint import footprint_from_dir
from shardline.models.synth import (
    SynthSpec,
    active_parameter_count,
    arch_spec,
    parameter_count,
    weight_sizes,
    write_synth_model,
)
from shardline.testing import arch_matrix

pytestmark = pytest.mark.timeout(300)

_COMMON = {"layers": 3, "hidden": 128, "intermediate": 256, "heads": 4, "vocab": 320}
TINY = {
    "qwen3_moe": {**_COMMON, "kv_heads": 2, "experts": 8, "active": 2, "moe_intermediate": 64},
    "deepseek_v3": {
        **_COMMON,
        "kv_heads": 4,
        "experts": 8,
        "active": 3,
        "moe_intermediate": 64,
        "shared_experts": 1,
        "dense_layers": 1,
        "expert_groups": 2,
        "active_groups": 2,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "rope_head_dim": 16,
        "nope_head_dim": 32,
        "v_head_dim": 32,
    },
}
# (bits, dtype): 4-bit with float16 and float32 scales, float32 and float16. MLX's gather_mm (unquantized
# experts) takes float32 alone on CPU: a float16 stack runs on a GPU only.
WEIGHTS = [(4, "float16"), (4, "float32"), (0, "float32"), (0, "float16")]
# Float16 activations: the stages' caches are not mlx-lm's, and its attention rounds otherwise (2-3e-3 of the
# spread seen after 40 positions); the tokens stay the same.
FLOAT16_TOLERANCE = 1e-2


def _runs_here(bits: int, dtype: str) -> bool:
    return bool(bits) or dtype == "float32" or mx.default_device() != mx.cpu


def _spec(arch: str, bits: int, dtype: str, **more: object) -> SynthSpec:
    return arch_spec(arch, **{**TINY[arch], **more}, bits=bits, group_size=32, dtype=dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, str], Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        (arch, bits, dtype): write_synth_model(root / f"{arch}-{bits}-{dtype}", _spec(arch, bits, dtype))
        for arch in TINY
        for bits, dtype in WEIGHTS
    }


@pytest.mark.parametrize(("bits", "dtype"), WEIGHTS)
@pytest.mark.parametrize("arch", list(TINY))
def test_loads_in_mlx_lm_as_written_and_runs(models, arch, bits, dtype):
    from mlx_lm.utils import load_model

    path = models[arch, bits, dtype]
    spec = _spec(arch, bits, dtype)
    files = mx.load(str(path / "model.safetensors"))
    model, config = load_model(path)  # strict: every parameter from the files, with its shape
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(files)
    assert all(params[k].shape == files[k].shape for k in files)
    assert config["model_type"] == arch
    if _runs_here(bits, dtype):
        logits = model(mx.array([[5, 6, 7, 8, 9]]))
        assert logits.shape == (1, 5, spec.vocab) and bool(mx.isfinite(logits).all())

    e, i, h = spec.experts, spec.moe_intermediate, spec.hidden
    moe = model.model.layers[-1].mlp
    stack = files["model.layers.2.mlp.switch_mlp.down_proj.weight"]
    if bits:
        assert stack.dtype == mx.uint32 and stack.shape == (e, h, i * bits // 32)
        assert files["model.layers.2.mlp.switch_mlp.down_proj.scales"].shape == (e, h, i // 32)
        assert type(moe.switch_mlp.up_proj).__name__ == "QuantizedSwitchLinear"
    else:
        assert stack.dtype == getattr(mx, dtype) and stack.shape == (e, h, i)
    if arch == "qwen3_moe":
        # The router as mlx-lm's quant_predicate leaves it: 8-bit in groups of 64, recorded per path.
        router = config.get("quantization", {}).get("model.layers.0.mlp.gate")
        assert router == ({"group_size": 64, "bits": 8, "mode": "affine"} if bits else None)
        assert type(moe.gate) is (nn.QuantizedLinear if bits else nn.Linear)
    else:
        assert "model.layers.0.mlp.switch_mlp.up_proj.weight" not in files  # first_k_dense_replace
        assert files["model.layers.1.mlp.gate.weight"].dtype == getattr(mx, dtype)  # MoEGate: not quantized
        assert files["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
        assert files["model.layers.1.self_attn.embed_q.weight"].shape[:2] == (spec.heads, spec.kv_lora_rank)
        assert "model.layers.1.mlp.shared_experts.down_proj.weight" in files

    sizes = weight_sizes(path)
    assert sizes["parameters"] == parameter_count(spec)
    assert sizes["stored_bytes"] == sum(v.nbytes for v in files.values())
    assert active_parameter_count(spec) < parameter_count(spec)
    assert synth.footprint(spec, path.name) == footprint_from_dir(path)


@pytest.mark.parametrize(("bits", "dtype"), WEIGHTS)
@pytest.mark.parametrize("arch", list(TINY))
def test_stages_give_mlx_lms_own_greedy_tokens(models, arch, bits, dtype):
    from mlx_lm.utils import load_model

    from shardline.compute.shard import load_shard, split_layers

    if not _runs_here(bits, dtype):
        pytest.skip("MLX's gather_mm takes float32 alone on CPU")
    path = models[arch, bits, dtype]
    model, _ = load_model(path)
    want = arch_matrix.reference(model, arch_matrix.PROMPT)
    assert len(set(want[0])) > 1  # the router and head are decisive: not one token over and over
    for stages in (1, 2):
        shards = [load_shard(path, r) for r in split_layers(len(model.layers), stages)]
        got = arch_matrix.staged(shards, arch_matrix.PROMPT)
        if dtype == "float32":
            assert arch_matrix.compare(got, want) == arch_matrix.OK
        else:
            assert got[0] == want[0]
            spread = mx.max(want[1], axis=-1) - mx.min(want[1], axis=-1)
            gap = mx.max(mx.abs(got[1] - want[1]), axis=-1) / spread
            assert float(mx.max(gap).item()) < FLOAT16_TOLERANCE


def test_experts_drawn_a_few_at_a_time_are_the_same_experts(tmp_path, monkeypatch):
    spec = _spec("qwen3_moe", 4, "float32")
    whole = mx.load(str(write_synth_model(tmp_path / "a", spec) / "model.safetensors"))
    monkeypatch.setattr(synth, "CHUNK_ELEMENTS", 3 * 64 * 128)  # 3 experts a draw: 8 = 3 + 3 + 2
    parts = mx.load(str(write_synth_model(tmp_path / "b", spec) / "model.safetensors"))
    assert all(mx.array_equal(whole[k], parts[k]).item() for k in whole)


def test_cli_summary_names_the_arch_and_its_experts(tmp_path, capsys):
    argv = ["models", "synth", "moe-tiny", "--models-dir", str(tmp_path), "--arch", "qwen3_moe"]
    argv += ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "320"]
    argv += ["--experts", "8", "--active", "2", "--moe-intermediate", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    assert "synthetic qwen3_moe, 8 experts (2 active) (4-bit" in out and "M active per token" in out
    config = json.loads((tmp_path / "moe-tiny" / "config.json").read_text())
    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    assert [config[k] for k in keys] == [8, 2, 64]
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    # deepseek_v3's own small defaults write and say so.
    assert main(["models", "synth", "ds", "--models-dir", str(tmp_path), "--arch", "deepseek_v3"]) == 0
    assert "synthetic deepseek_v3, 16 experts (4 active + 1 shared)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arch", "qwen3_moe", "--experts", "4", "--active", "6"], "--active 6 is more than the 4 experts"),
        (["--arch", "qwen3_moe", "--moe-intermediate", "100"], "moe-intermediate 100 is not a multiple of"),
        (["--experts", "8"], "--experts is for a mixture of experts"),
        (["--arch", "deepseek_v3", "--tied"], "deepseek_v3 has its own output head"),
        (["--arch", "deepseek_v3", "--experts", "6", "--expert-groups", "4"], "must divide the 6 experts"),
    ],
)
def test_cli_refuses_a_bad_combination_in_one_line(tmp_path, capsys, extra, message):
    assert main(["models", "synth", "bad", "--models-dir", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not list(tmp_path.iterdir())  # refused before anything is written
