"""`shardline bench engine --quick` end to end on a tiny GGUF: every figure is written, and each is sane;
the llama.cpp side finds the model's own GGUF, or says why there is none."""

from __future__ import annotations

import json
import math

import gguf as gguf_py
import pytest

from shardline.bench.engine import LLAMA_TARGETS, TARGETS, run
from shardline.testing.tiny import make_tiny_model


@pytest.mark.timeout(600)
def test_bench_engine_quick_writes_every_figure(tmp_path, monkeypatch):
    from shardline.bench import llama_cpp
    from shardline.models import registry
    from shardline.testing.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    # Not built in CI; where it is, a model this small is not one llama-bench would be asked to run.
    monkeypatch.setattr(llama_cpp, "binary", lambda name: None)
    src = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(src, layers=2, hidden=64, ffn=128, head_dim=32, qtype=gguf_py.GGMLQuantizationType.Q8_0)
    out = tmp_path / "bench.json"
    run(str(src), out, quick=True)
    result = json.loads(out.read_text())
    assert set(TARGETS) <= set(result)
    for key in TARGETS:
        if not key.endswith("_mismatched"):
            assert math.isfinite(result[key]) and result[key] > 0, key
    assert 0 <= result["batched_outputs_mismatched"] <= 8
    # The prefix cache changes no output (exact by construction), and its figures are there.
    assert result["prefix_outputs_mismatched"] == 0
    assert result["raw"]["prefix_turn5_prompt_tokens"] > 0 and "turn 5" in result["prefix_setup"]
    assert result["pairs"] == 1 and len(result["rounds"]) == 1
    assert result["raw"]["s2_serial_prefill_tps"] > 0
    assert set(result["decode_token_profile_ms"]) == {"single_process", "s1", "s2"}
    assert result["decode_tps_s1"] > 0 and result["raw"]["s1_prefill_tps"] > 0
    assert 0 < result["mask_ms_p50"] <= result["mask_ms_p99"]
    # The weights one stage holds over the GGUF's bytes: the blocks as stored, and the ratio's range.
    lo, hi = result["ranges"]["weights_bytes_ratio_vs_gguf"]
    assert 0.3 < lo <= result["weights_bytes_ratio_vs_gguf"] <= hi < 3
    assert result["weights_bytes"]["gguf"] == src.stat().st_size
    # One stage on every core, and the read bandwidth of the cores each stage ran on, measured here.
    assert result["raw"]["node_decode_tps"] > 0 and result["decode_bandwidth_share_node"] > 0
    assert result["raw"]["read_gbps_s1"] > 0 and result["raw"]["read_gbps_node"] > 0
    # One decode token, op kind by op kind, down from the token's time as the stream saw it.
    ops = result["decode_token_ops_ms"]
    assert ops["path"] == "fast" and ops["token"] > 0 and ops["forward"] > 0
    assert math.isclose(ops["token"], ops["step"] + ops["transport_and_leader"], abs_tol=0.01)
    kinds = {"attn_qkv", "attn_o", "mlp_gate_up_silu", "mlp_down", "attention", "norms", "head"}
    assert kinds <= set(ops["ops"])
    # llama.cpp not built: its ratios are absent, and the reason says how to build it.
    assert llama_cpp.BUILD_HINT in result["llama_cpp"]["skipped"]
    assert not set(LLAMA_TARGETS) & set(result)
    # Each stage's peak RSS over weights + KV + the measured runtime allowance: of the order of 1.
    assert len(result["peak_rss_ratio_per_stage"]) == 2
    assert all(0.3 < r < 20 for r in result["peak_rss_ratio_per_stage"])
    assert all(m["runtime_allowance_bytes"] > 10e6 for m in result["stage_memory"])


@pytest.mark.timeout(120)
def test_the_llama_cpp_side_runs_on_the_models_own_gguf(tmp_path, monkeypatch, model_dir):
    """Any model reference finds the GGUF it was imported from, or says why there is none."""
    from shardline.bench import llama_cpp
    from shardline.bench.engine_references import llama_reference, model_gguf
    from shardline.models import registry
    from shardline.models.registry import gguf_source, resolve_model
    from shardline.testing.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "ggufs" / "Tiny.Q8_0.gguf"
    src.parent.mkdir()
    write_tiny_gguf(src, layers=2)
    imported = resolve_model(str(src), progress=False)
    assert model_gguf(str(src), imported) == (src, "")  # the path given
    assert model_gguf(imported.name, imported) == (src.resolve(), "")  # by name: the import's origin
    assert model_gguf(str(imported), imported) == (src.resolve(), "")  # by directory
    assert model_gguf(None, model_dir)[0] == gguf_source(registry.DEFAULT_MODEL)  # a known model's wheel
    plain = make_tiny_model(tmp_path / "plain", "qwen2", vocab=2048)
    gguf, why = model_gguf(str(plain), plain)
    assert gguf is None and "no GGUF source" in why
    # The file moved away since: no reference to run llama.cpp on, and the reason.
    src.rename(tmp_path / "moved.gguf")
    gguf, why = model_gguf(imported.name, imported)
    assert gguf is None and "no longer there" in why
    llama, found, why = llama_reference(imported.name, imported, quick=True)
    assert llama is None and found is None and "skipped" in why
    # llama.cpp not built: the GGUF is still known (the weights ratio), the ratios skipped with the hint.
    monkeypatch.setattr(llama_cpp, "binary", lambda name: None)
    llama, found, why = llama_reference(None, model_dir, quick=True)
    assert llama is None and found == gguf_source(registry.DEFAULT_MODEL) and llama_cpp.BUILD_HINT in why
