"""`shardline bench arch --quick`: every architecture measured on 1 and 2 stages beside mlx-lm, and each
figure written (no timed assertion: the ratios of a tiny model mean little)."""

from __future__ import annotations

import json
import math

import pytest

from shardline.bench.arch import VARIANTS, run


@pytest.mark.timeout(600)
def test_bench_arch_quick_writes_every_figure(tmp_path):
    out = tmp_path / "arch.json"
    run(out, quick=True)
    result = json.loads(out.read_text())
    assert {"cpu", "cores", "blas"} <= set(result["machine"])
    assert result["s2"] == "in-process"
    archs = result["architectures"]
    assert set(archs) == {v.name for v in VARIANTS}
    for name, r in archs.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["path"] in ("fast", "generic") and len(r["paths_s2"]) == 2
        assert r["kind"]
        for key in ("decode_tok_s", "prefill_tok_s"):
            assert set(r[key]) == {"mlx_lm", "s1", "s2"}
            assert all(math.isfinite(v) and v > 0 for v in r[key].values()), (name, key)
        for short in ("decode", "prefill"):
            for s in ("s1", "s2"):
                assert r["ratios"][f"{short}_ratio_{s}_vs_mlx_lm"] > 0, (name, short, s)
        assert set(r["decode_step_profile_ms"]) == {"mlx_lm", "s1", "s2"}
    # The quantized llama takes the fast path; the other kinds the generic one.
    assert archs["llama-q4"]["path"] == "fast"
    assert all(archs[a]["path"] == "generic" for a in ("gemma3_text", "deepseek_v3", "qwen3_next"))
    for path in ("generic", "fast"):
        assert result[f"{path}_decode_ratio_s1_vs_mlx_lm_min"] > 0
