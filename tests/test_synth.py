"""`shardline models synth`: random llama models in mlx-lm's quantized layout, loadable, served by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from shardline.cli.main import main
from shardline.models import synth
from shardline.models.footprint import footprint_from_dir
from shardline.models.registry import resolve_model
from shardline.models.store.manifest import local_models
from shardline.models.synth import SynthSpec, weight_sizes, write_synth_model
from shardline.models.validate import validate_model_dir

pytestmark = pytest.mark.timeout(300)

TINY = {"layers": 3, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 320}


def _load(path: Path) -> tuple[nn.Module, object]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return model, load_tokenizer(path)


def test_quantized_model_loads_and_its_tensors_agree_with_its_config(tmp_path):
    spec = SynthSpec(**TINY, bits=4, group_size=32, dtype="float16")
    path = write_synth_model(tmp_path / "m", spec)
    config = validate_model_dir(path)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config["shardline_synthetic"]["purpose"] == synth.PURPOSE
    assert json.loads((path / synth.SYNTH_INFO_FILE).read_text())["synthetic"] is True

    files = mx.load(str(path / "model.safetensors"))
    q = files["model.layers.0.mlp.up_proj.weight"]
    assert q.dtype == mx.uint32 and q.shape == (128, 64 * 4 // 32)
    assert files["model.layers.0.mlp.up_proj.scales"].shape == (128, 64 // 32)
    assert files["model.layers.0.mlp.up_proj.scales"].dtype == mx.float16
    assert files["model.layers.0.mlp.down_proj.biases"].shape == (64, 128 // 32)
    assert files["model.embed_tokens.weight"].shape == (320, 8) and "lm_head.scales" in files

    model, tok = _load(path)
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    # The model's parameters are exactly the files' tensors, shapes included (nothing random-initialised).
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(files)
    assert all(params[k].shape == files[k].shape for k in files)
    ids = tok.encode("Hello, wörld!", add_special_tokens=False)
    assert max(ids) < spec.vocab and tok.decode(ids) == "Hello, wörld!"
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), spec.vocab) and bool(mx.isfinite(logits).all())

    sizes = weight_sizes(path)
    assert sizes["parameters"] == synth.parameter_count(spec)
    assert sizes["stored_bytes"] == sum(v.nbytes for v in files.values())
    assert sizes["float32_bytes"] == 4 * sizes["parameters"] > sizes["stored_bytes"]


def test_float32_model_is_plain_and_deterministic(tmp_path):
    spec = SynthSpec(**TINY, bits=0, dtype="float32", seed=3)
    a = mx.load(str(write_synth_model(tmp_path / "a", spec) / "model.safetensors"))
    b = mx.load(str(write_synth_model(tmp_path / "b", spec) / "model.safetensors"))
    assert not json.loads((tmp_path / "a" / "config.json").read_text()).get("quantization")
    assert all(v.dtype == mx.float32 for v in a.values())
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    sizes = weight_sizes(tmp_path / "a")
    assert sizes["stored_bytes"] == sizes["float32_bytes"]
    # The projections have the configured spread (what keeps a deep stack's activations finite).
    assert math.isclose(float(a["model.layers.0.self_attn.q_proj.weight"].std()), 0.02, rel_tol=0.1)
    model, _ = _load(tmp_path / "a")
    assert bool(mx.isfinite(model(mx.array([[5, 6, 7]]))).all())


def test_large_models_are_split_into_files_mlx_lm_and_placement_read(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "MAX_FILE_BYTES", 40_000)
    spec = SynthSpec(**TINY, bits=4, dtype="float32")
    path = write_synth_model(tmp_path / "m", spec)
    files = sorted(path.glob("model-*.safetensors"))
    assert len(files) > 1 and not (path / "model.safetensors").exists()
    fp = footprint_from_dir(path)
    assert fp.weight_bytes == weight_sizes(path)["stored_bytes"]
    assert fp.layers == 3 and not fp.tied
    model, _ = _load(path)
    assert bool(mx.isfinite(model(mx.array([[1, 2, 3]]))).all())


def test_refuses_bad_shapes_and_an_existing_model(tmp_path):
    with pytest.raises(ValueError, match="group size"):
        SynthSpec(**{**TINY, "hidden": 48, "heads": 4}, bits=4, group_size=32).check()
    with pytest.raises(ValueError, match="vocab"):
        SynthSpec(**{**TINY, "vocab": 100}).check()
    write_synth_model(tmp_path / "m", SynthSpec(**TINY))
    with pytest.raises(FileExistsError):
        write_synth_model(tmp_path / "m", SynthSpec(**TINY))


def test_cli_writes_into_the_cache_where_nodes_and_the_cli_find_it_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    argv = ["models", "synth", "syn-tiny", "--layers", "2", "--hidden", "64", "--intermediate", "128"]
    argv += ["--heads", "4", "--kv-heads", "2", "--vocab", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "syn-tiny" in out and "as float32" in out and "benchmarks only" in out
    models = tmp_path / "models"
    assert resolve_model("syn-tiny") == (models / "syn-tiny").resolve()
    listed = local_models(models)
    assert listed["syn-tiny"].full and listed["syn-tiny"].digest  # recorded: a master may place it
    assert main(["models", "list"]) == 0
    assert "syn-tiny\tsynthetic" in capsys.readouterr().out
    assert main(argv) == 2  # exists: --force to replace
    assert main([*argv, "--force"]) == 0
