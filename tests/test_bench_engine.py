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
        if key != "batched_outputs_mismatched":
            assert math.isfinite(result[key]) and result[key] > 0, key
    assert 0 <= result["batched_outputs_mismatched"] <= 8
    assert result["pairs"] == 1 and len(result["rounds"]) == 1
    assert result["raw"]["s2_serial_prefill_tps"] > 0
    assert set(result["decode_token_profile_ms"]) == {"single_process", "s1", "s2"}
