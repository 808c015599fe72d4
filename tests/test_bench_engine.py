"""`shardline bench engine --quick` end to end on a tiny model: every figure is written, and each is sane."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from shardline.bench.engine import TARGETS, run
from shardline.testing.tiny import make_tiny_model


@pytest.mark.timeout(600)
def test_bench_engine_quick_writes_every_figure(tmp_path, model_dir):
    model = make_tiny_model(tmp_path / "model", "qwen2", vocab=2048)
    # The bench takes token ids; a model directory still needs a tokenizer to be one.
    for f in model_dir.glob("tokenizer*.json"):
        shutil.copy(f, model / f.name)
    out = tmp_path / "bench.json"
    run(str(model), out, quick=True)
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
    # No GGUF behind a tiny model: llama.cpp's side is skipped, and says why.
    assert result["weights_bytes_ratio_vs_gguf"] is None and "GGUF" in result["llama_cpp"]["skipped"]
    assert not any(k.endswith(("llama_cpp_1t", "llama_cpp_2t")) for k in result)
    # Each stage's peak RSS over weights + KV + the measured runtime allowance: of the order of 1.
    assert len(result["peak_rss_ratio_per_stage"]) == 2
    assert all(0.3 < r < 20 for r in result["peak_rss_ratio_per_stage"])
    assert all(m["runtime_allowance_bytes"] > 10e6 for m in result["stage_memory"])
