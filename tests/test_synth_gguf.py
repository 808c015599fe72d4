"""`shardline models synth --gguf`: synthetic GGUFs in a real model's shape that our importer takes (written
by gguf-py here: no llama.cpp build needed; by llama-quantize too where it is built), and `shardline bench
products --quick`."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from tokenizers import Tokenizer

from shardline.bench.llama_cpp import BUILD_HINT, binary
from shardline.cli.main import main
from shardline.models import synth_gguf
from shardline.models.gguf_import import import_gguf
from shardline.models.registry import resolve_model
from shardline.models.synth_gguf import SHAPES, shape_of
from shardline.models.synth_gguf import synth_gguf as write
from shardline.testing.tokenizer_fixtures import llama_tokenize

pytestmark = pytest.mark.timeout(300)

TEXT = "the weather in Zürich is <|im_end|> 12345 ünïcode ✓\n\tthere"


def _meta(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_shapes_are_the_real_models(tmp_path):
    q = SHAPES["qwen2-1.5b"]
    assert (q.arch, q.layers, q.hidden, q.intermediate, q.heads, q.kv_heads, q.vocab) == (
        "qwen2",
        28,
        1536,
        8960,
        12,
        2,
        151936,
    )
    assert q.qkv_bias and not q.tied and q.rope_theta == 1e6 and q.rms_eps == 1e-6
    l8 = SHAPES["llama-8b"]
    assert (l8.arch, l8.layers, l8.hidden, l8.intermediate, l8.heads, l8.kv_heads, l8.vocab) == (
        "llama",
        32,
        4096,
        14336,
        32,
        8,
        128256,
    )
    assert 1.7e9 < synth_gguf.parameter_count(q) < 1.8e9  # 1.54B and the untied head's 0.23B
    assert 7.9e9 < synth_gguf.parameter_count(l8) < 8.1e9
    with pytest.raises(ValueError, match="heads"):
        shape_of("qwen2-tiny", heads=3)
    with pytest.raises(ValueError, match="vocab"):
        shape_of("qwen2-tiny", vocab=100)


def test_q8_0_written_by_gguf_py_imports_and_its_tokenizer_round_trips(tmp_path):
    shape = shape_of("qwen2-tiny")
    path = write(tmp_path / "tiny.gguf", shape, "Q8_0", quantizer="gguf-py", name="tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no F16 file, no temporary
    reader = GGUFReader(path)
    meta = _meta(reader)
    assert meta["general.architecture"] == "qwen2"
    assert "synthetic random weights" in meta["general.description"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == shape.vocab
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["output.weight"] == types["blk.1.ffn_down.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_q.bias"] == GGMLQuantizationType.F32
    assert len(reader.tensors) == 2 + 1 + shape.layers * 12

    out = import_gguf(path, tmp_path / "imported", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids, skip_special_tokens=False) == TEXT
    assert ids.count(meta["tokenizer.ggml.eos_token_id"]) == 1  # "<|im_end|>" is one special token
    assert any(i >= 256 for i in ids if i != meta["tokenizer.ggml.eos_token_id"])  # a merge was used

    from shardline.compute.gguf_linear import load_model

    model, _ = load_model(out)  # the GGUF blocks as stored, as a stage loads them
    logits = model(mx.array([ids]))
    assert mx.isfinite(logits).all().item() and 0 < float(logits.std()) < 10


def test_cli_imports_a_name_and_writes_a_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))
    argv = ["models", "synth", "--gguf", "--shape", "qwen2-tiny", "--quant", "Q8_0", "--quantizer", "gguf-py"]
    assert main([*argv, "syn-gguf"]) == 0
    out = capsys.readouterr().out
    assert "qwen2-tiny" in out and "benchmarks only" in out
    assert (tmp_path / "gguf" / "syn-gguf.gguf").is_file()
    model = resolve_model("syn-gguf")
    assert model.name == "syn-gguf"
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"
    assert main([*argv, "syn-gguf"]) == 2  # exists: --force replaces it
    assert "--force" in capsys.readouterr().err

    # llama-8b cut to a few MB, F16 to a path: llama's layout, BOS added, no biases.
    gguf = tmp_path / "out" / "l8.gguf"
    small = ["--layers", "1", "--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2"]
    llama = ["models", "synth", "--gguf", "--shape", "llama-8b", "--quant", "F16", *small, "--vocab", "400"]
    assert main([*llama, str(gguf)]) == 0
    reader = GGUFReader(gguf)
    meta = _meta(reader)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 1
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.pre"] == "llama-bpe"
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.0.attn_q.bias" not in tensors
    embed = tensors["token_embd.weight"]
    assert embed.tensor_type == GGMLQuantizationType.F16 and tuple(embed.shape) == (256, 400)
    w = np.asarray(tensors["blk.0.ffn_gate.weight"].data, dtype=np.float32)
    assert math.isclose(float(w.std()), 0.02, rel_tol=0.05)  # llama's init spread
    assert np.all(tensors["blk.0.ffn_norm.weight"].data == 1)


def test_a_k_quant_without_llama_quantize_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path))  # no llama.cpp built under it
    assert main(["models", "synth", "--gguf", "--shape", "qwen2-tiny", str(tmp_path / "k.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Q4_K_M" in err and "shardline bench llama-cpp --build" in err
    assert not list(tmp_path.glob("*.gguf"))
    with pytest.raises(ValueError, match="gguf-py"):
        write(tmp_path / "k.gguf", shape_of("qwen2-tiny"), "Q4_K", quantizer="gguf-py")


def test_bench_products_quick_reports_every_figure(tmp_path):
    out = tmp_path / "products.json"
    assert main(["bench", "products", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] and result["rounds"] == 1 and result["rows"] == [1, 8]
    threads = [str(t) for t in result["threads"]]
    assert threads[0] == "1" and set(result["read_bandwidth_gbps"]) == set(threads)
    assert all(g > 0 for g in result["read_bandwidth_gbps"].values())
    (shape,) = result["shapes"]
    assert shape["gguf_type"] == "Q4_K" and shape["gguf_bytes"] == shape["out"] * shape["in"] // 256 * 144
    for t in threads:
        per = shape["threads"][t]
        kernels = ("gguf", "affine") if result["gguf_native"] else ("affine",)
        for kernel in kernels:
            for rows in ("1", "8"):
                figures = per[kernel]["rows"][rows]
                assert figures["ms"] > 0 and figures["gbps"] > 0 and figures["bandwidth_share"] > 0
                assert figures["ms_range"][0] <= figures["ms"] <= figures["ms_range"][1]
            assert per[kernel]["rows8_over_1"] > 0
        if result["gguf_native"]:
            assert set(per["speedup_gguf_vs_affine"]) == {"1", "8"}
            assert max(per["relative_difference"].values()) < 0.05  # the same blocks, x rounded to int8


@pytest.mark.skipif(
    binary("llama-quantize") is None or binary("llama-tokenize") is None,
    reason=f"llama.cpp's llama-quantize is not built here (`{BUILD_HINT}`)",
)
def test_q4_k_m_by_llama_quantize_imports_and_tokenizes_as_llama_cpp(tmp_path):
    exe = binary("llama-quantize")
    path = write(tmp_path / "tiny.gguf", shape_of("qwen2-tiny"), "Q4_K_M", quantize_exe=exe)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # the F16 file removed
    types = {GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K", "F32"} <= types
    out = import_gguf(path, tmp_path / "imported", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenize = binary("llama-tokenize")
    assert tokenize is not None
    assert llama_tokenize(tokenize, path, TEXT) == tok.encode(TEXT).ids
