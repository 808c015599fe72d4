"""`shardline bench moe --quick`: every figure the issue asks for is produced, the expert group computes what
one runner computes, and its member faults resume exactly (the speed figures belong to the full run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline.bench import moe


@pytest.mark.timeout(900)
def test_bench_moe_quick_reports_every_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_CACHE_DIR", str(tmp_path / "cache"))  # its model, never the user's cache
    out = tmp_path / "moe.json"
    result = moe.run(out, quick=True)
    assert json.loads(out.read_text()) == result
    for key in (*moe.TARGETS, "throughput_ratio_8streams_ep2_vs_single", "decode_ratio_ep2_routed_vs_ep2"):
        assert result[key] >= 0, key
    assert result["moe_outputs_mismatched"] == 0
    assert result["moe_logits_max_rel_diff"] < 1e-2
    # Each member holds half of every layer's experts, whole.
    assert result["expert_bytes_per_member_vs_half"] == 1.0
    assert len(result["expert_bytes_per_member"]) == 2
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
