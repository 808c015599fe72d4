"""`shardline bench tp --quick`: every figure the issue asks for is produced, and the group computes what
one runner computes, through member faults too (the speed figures themselves belong to the full run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline.bench import tp


@pytest.mark.timeout(600)
def test_bench_tp_quick_reports_every_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path / "cache"))  # its model, never the user's cache
    out = tmp_path / "tp.json"
    result = tp.run(out, quick=True)
    assert json.loads(out.read_text()) == result
    for key in (*tp.TARGETS, "allreduce_us_p50", "allreduce_us_p99"):
        assert key in result, key
    assert result["tp_outputs_mismatched"] == 0
    assert result["tp_logits_max_rel_diff"] < 1e-3
    assert 0 < result["allreduce_us_p50"] <= result["allreduce_us_p99"]
    assert [(f["signal"], f["phase"]) for f in result["member_faults"]] == [
        ("SIGSTOP", "decode"),
        ("SIGKILL", "decode"),
        ("SIGSTOP", "prefill"),
        ("SIGKILL", "prefill"),
    ]
    for f in result["member_faults"]:
        assert f["text_exact"] == 1, f
        assert 0 <= f["detected_s"] <= f["serving_again_s"], f
    assert not (tmp_path / "cache" / "models").exists()  # bench models live beside the model cache
