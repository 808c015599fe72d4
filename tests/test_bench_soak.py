"""`shardline bench soak` for a fraction of a minute on a tiny random model and 3 loopback nodes: the report
has every field, requests are answered, and no runner process outlives the cluster. The other targets are
not asserted: a run this short on a shared machine is noisy."""

from __future__ import annotations

import json

import pytest

from shardline.cli import main

FIELDS = {
    "minutes",
    "nodes",
    "requests_ok",
    "requests_lost",
    "refused",
    "unreachable",
    "http_5xx",
    "leaked_slots",
    "rss_growth_ratio",
    "orphan_processes",
    "masters_per_term_max",
    "ttft_p50_s",
    "ttft_p99_s",
    "kills",
    "stops",
    "disconnects",
    "machine",
    "targets_met",
}


@pytest.mark.timeout(180)
def test_soak_smoke_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = ["bench", "soak", "--seconds", "25", "--nodes", "3", "--model", "tiny", "--seed", "1"]
    assert main([*argv, "--concurrency", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= FIELDS, FIELDS - set(result)
    assert result["nodes"] == 3
    assert result["requests_ok"] > 0, result
    assert result["orphan_processes"] == 0, result["orphans"]
    assert set(result["targets_met"]) == {
        "requests_lost",
        "http_5xx",
        "leaked_slots",
        "orphan_processes",
        "masters_per_term_max",
        "rss_growth_ratio",
    }
    assert set(result["rss_growth_ratio"]) == {"n0", "n1", "n2"}
    assert "bench soak:" in capsys.readouterr().err
