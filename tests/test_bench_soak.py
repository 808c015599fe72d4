"""`shardline bench soak` for a fraction of a minute on a tiny random model and 3 nodes, on loopback and in
network namespaces with link flaps: the report has every field, requests are answered, and no runner process
(nor, in the lab, any namespace or frame on the host's interfaces) outlives or leaks out of the cluster. The
other targets are not asserted: a run this short on a shared machine is noisy."""

from __future__ import annotations

import json

import pytest

from shardline.cli import main
from shardline.testing.netns import LAB_RANGE, LeakMonitor, list_netns, netns_available

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
    "link_flaps",
    "disconnects",
    "netns",
    "machine",
    "targets_met",
}


@pytest.mark.timeout(180)
def test_soak_smoke_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = ["bench", "soak", "--seconds", "25", "--nodes", "3", "--model", "tiny", "--seed", "1"]
    assert main([*argv, "--concurrency", "4", "--no-netns", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= FIELDS, FIELDS - set(result)
    assert result["nodes"] == 3 and result["netns"] is False
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


@pytest.mark.timeout(150)
@pytest.mark.skipif(netns_available() is not None, reason=f"netns: {netns_available()}")
def test_soak_in_network_namespaces_survives_link_flaps(tmp_path):
    out = tmp_path / "soak.json"
    before = set(list_netns())
    argv = ["bench", "soak", "--seconds", "20", "--nodes", "3", "--model", "tiny", "--seed", "2"]
    # Only link flaps, 3.75-7.5 s apart: the first one starts well before the last 5 s, when none starts.
    argv += ["--netns", "--faults", "link_flap", "--fault-interval", "5", "--concurrency", "3"]
    # Every lab lives in 10.77.0.0/16: no frame of it may show on the host's own interfaces.
    with LeakMonitor(str(LAB_RANGE)) as monitor:
        assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= FIELDS, FIELDS - set(result)
    assert result["netns"] is True and result["fault_kinds"] == ["link_flap"]
    flaps = [f for f in result["faults"] if f["kind"] == "link_flap"]
    assert flaps and result["link_flaps"] == len(flaps), result["faults"]
    assert all(f["recovered"] and 1.0 <= f["down_s"] <= 6.0 for f in flaps), flaps
    assert all(f["recovery_s"] + 0.1 >= f["down_s"] for f in flaps), flaps  # down, then ready again
    assert result["requests_ok"] > 0 and result["requests_lost"] == 0, result["lost_examples"]
    assert result["orphan_processes"] == 0, result["orphans"]
    assert monitor.leaks == [], monitor.leaks[:10]
    left = {n for n in set(list_netns()) - before if n.startswith("slsoak")}
    assert not left, f"namespaces left: {left}"


@pytest.mark.timeout(30)
def test_link_flaps_need_network_namespaces(capsys):
    argv = ["bench", "soak", "--seconds", "5", "--model", "tiny", "--no-netns", "--faults", "link_flap"]
    assert main(argv) == 2
    assert "link_flap needs --netns" in capsys.readouterr().err
