"""`shardline bench soak`: its fault plans and report in-process (a partition's sides, the abusive client's
bodies against the API's own validators, what counts as met), then for a fraction of a minute on a tiny
random model and 3 nodes, on loopback and in network namespaces with link flaps: the report has every field,
requests are answered, and no runner process (nor, in the lab, any namespace or frame on the host's
interfaces) outlives or leaks out of the cluster. The other targets are not asserted on the short runs: a run
this short on a shared machine is noisy."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from shardline.api.errors import ApiError
from shardline.api.limits import check_choices
from shardline.api.response_format import check_bias_tokens, checked, constraint_of, logit_bias_of
from shardline.api.routes.openai import ChatRequest
from shardline.api.stops import checked_stops
from shardline.bench.chaos import (
    ABUSIVE_EXPECTED,
    ABUSIVE_PLAN,
    abusive_body,
    abusive_outcome,
    api_limits,
    largest_schema,
    partition_sides,
)
from shardline.bench.soak import _targets
from shardline.bench.soak_cluster import SoakCluster
from shardline.bench.soak_faults import Chaos, FaultRecord, fault_kinds
from shardline.bench.soak_load import Abuse
from shardline.cli.main import main
from shardline.testing.cluster import LabCluster
from shardline.testing.leak_monitor import LeakMonitor
from shardline.testing.namespaces import list_netns
from shardline.testing.netns import LAB_RANGE, Host, netns_skip_reason

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
    "partitions",
    "cut_by_partition",
    "instance_failures",
    "abusive_client",
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
        "instance_failures",
        "abusive_client",
        "abusive_as_expected",
        "rss_growth_ratio",
    }
    # The abusive client ran by default (no lab needed): each answer served, a 400, or a counted failure.
    abuse = result["abusive_client"]
    assert result["fault_kinds"] == ["node_kill", "node_stop", "runner_stop", "abusive_client"]
    assert abuse["sent"] > 0 and abuse["limits"]["n_max"] >= 1, abuse
    ends = abuse["served"] + abuse["refused_400"] + abuse["failures"]
    assert ends + abuse["cut_by_node_kill"] + abuse["cut_by_partition"] == abuse["sent"], abuse
    assert set(result["rss_growth_ratio"]) == {"n0", "n1", "n2"}
    assert "bench soak:" in capsys.readouterr().err


@pytest.mark.timeout(150)
@pytest.mark.skipif(netns_skip_reason() is not None, reason=f"netns: {netns_skip_reason()}")
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


# ---- the fault plans and the report, in-process ------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nodes", [3, 4, 5, 6, 7])
def test_a_partition_cuts_the_master_and_one_node_off_from_a_majority(nodes):
    ids = [f"n{i}" for i in range(nodes)]
    for seed in range(20):
        master = ids[seed % nodes]
        minority, majority = partition_sides(ids, master, random.Random(seed))
        assert minority[0] == master and len(minority) == (2 if nodes >= 5 else 1), minority
        assert sorted(minority + majority) == sorted(ids) and 2 * len(majority) > nodes, (minority, majority)


@pytest.mark.timeout(30)
def test_a_partition_needs_a_known_master_and_three_nodes():
    with pytest.raises(ValueError, match="at least 3 nodes"):
        partition_sides(["n0", "n1"], "n0", random.Random(0))
    with pytest.raises(ValueError, match="not one of"):
        partition_sides(["n0", "n1", "n2"], "n9", random.Random(0))


def _api_verdict(body: dict[str, Any], vocab: int) -> int:
    """200 or 400, as the chat API's own validators judge the body (the parts a body's size can break)."""
    try:
        req = ChatRequest.model_validate(body)
        check_choices(req.n or 1)
        check_bias_tokens(logit_bias_of(req.logit_bias), vocab)
        checked_stops(req.stop if isinstance(req.stop, list) else [req.stop], "stop")
        checked(constraint_of(req.response_format))
    except ValidationError:
        return 400  # the app answers a body that fails its model with a 400
    except ApiError as exc:
        return exc.status
    return 200


@pytest.mark.timeout(60)
def test_the_abusive_bodies_are_the_largest_the_api_accepts_and_one_past_each_cap():
    vocab = 4096
    limits = api_limits(vocab)
    assert limits.vocab == vocab and limits.logit_bias_max <= 300 and limits.n_max >= 1, limits
    bodies = {v: abusive_body(v, limits, "m", 8, seed=3) for v in ABUSIVE_EXPECTED}
    assert set(ABUSIVE_PLAN) == set(ABUSIVE_EXPECTED) and ABUSIVE_PLAN[::2] == ("largest_accepted",) * 6

    big = bodies["largest_accepted"]
    assert big["n"] == limits.n_max and len(big["logit_bias"]) == limits.logit_bias_max
    assert len({int(k) for k in big["logit_bias"]}) == limits.logit_bias_max  # distinct ids
    assert len(big["stop"]) == limits.stops_max and {len(s) for s in big["stop"]} == {limits.stop_chars_max}
    schema = big["response_format"]["json_schema"]["schema"]
    assert len(json.dumps(schema)) == limits.schema_chars_max
    assert _api_verdict(big, vocab) == 200

    # Every parameter one past its cap, the rest as large as allowed: the API's own validators refuse these.
    assert bodies["n_over_cap"]["n"] == limits.n_max + 1 and _api_verdict(bodies["n_over_cap"], vocab) == 400
    assert len(bodies["stops_over_cap"]["stop"]) == limits.stops_max + 1
    assert _api_verdict(bodies["stops_over_cap"], vocab) == 400
    over = bodies["schema_over_cap"]["response_format"]["json_schema"]["schema"]
    assert len(json.dumps(over)) == limits.schema_chars_max + 1
    assert _api_verdict(bodies["schema_over_cap"], vocab) == 400
    # A full-vocabulary bias, one past the cap, or two keys for one token.
    assert sorted(int(k) for k in bodies["full_vocab_bias"]["logit_bias"]) == list(range(vocab))
    assert len({int(k) for k in bodies["bias_over_cap"]["logit_bias"]}) == limits.logit_bias_max + 1
    dup = bodies["duplicate_bias"]["logit_bias"]
    assert len(dup) == 2 * (limits.logit_bias_max // 2) and len({int(k) for k in dup}) == len(dup) // 2
    for variant in ("full_vocab_bias", "bias_over_cap", "duplicate_bias"):
        assert _api_verdict(bodies[variant], vocab) == 400, variant
    assert all(abs(v) <= 100 for b in bodies.values() for v in b["logit_bias"].values())
    # Seeded: the same bodies every time.
    assert abusive_body("largest_accepted", limits, "m", 8, seed=3) == big


@pytest.mark.timeout(30)
def test_largest_schema_is_exact_or_refused():
    assert len(json.dumps(largest_schema(5000))) == 5000
    with pytest.raises(ValueError, match="longer than"):
        largest_schema(100)
    with pytest.raises(ValueError, match="unknown abusive variant"):
        abusive_body("huge", api_limits(100), "m", 8, 0)


@pytest.mark.timeout(30)
def test_abusive_answers_are_served_a_400_or_a_counted_failure():
    assert [abusive_outcome(c) for c in (200, 400, 429, 500, 503, 413)] == [
        "served",
        "refused_400",
        "failure",
        "failure",
        "failure",
        "failure",
    ]
    a = Abuse()
    a.record("largest_accepted", "served", 200)
    a.record("full_vocab_bias", "refused_400", 400)
    a.record("full_vocab_bias", "served", 200)  # the cap missing: served, not as expected
    a.record("largest_accepted", "refused_400", 400, "n too large")  # refused, not as expected
    a.record("n_over_cap", "failure", 503, "n0 HTTP 503")
    a.record("largest_accepted", "cut_by_partition", None)
    a.add(unreachable=2, skipped_ticks=1)
    r = a.report(None, {"largest_accepted": 10}, 60.0)
    assert (r["sent"], r["served"], r["refused_400"], r["failures"], r["unexpected"]) == (6, 2, 2, 1, 2), r
    assert r["cut_by_partition"] == 1 and r["unreachable"] == 2 and r["skipped_ticks"] == 1
    assert r["rate_per_s"] == 0.1
    assert r["by_variant"]["full_vocab_bias"] == {
        "http_200": 1,
        "http_400": 1,
        "refused_400": 1,
        "served": 1,
        "unexpected": 1,
    }
    assert r["failure_examples"] == ["n_over_cap: n0 HTTP 503"] and len(r["unexpected_examples"]) == 2
    base = {
        "requests_lost": 0,
        "http_5xx": 0,
        "leaked_slots": 0,
        "orphan_processes": 0,
        "masters_per_term_max": 1,
        "instance_failures": 0,
        "rss_growth_ratio": {"n0": 1.0},
        "abusive_client": r,
    }
    met = _targets(base)
    assert met["abusive_client"] is False and met["abusive_as_expected"] is False and met["requests_lost"]
    assert _targets({**base, "instance_failures": 1})["instance_failures"] is False
    assert _targets({**base, "abusive_client": None})["abusive_client"] is None
    clean = Abuse()
    clean.record("largest_accepted", "served", 200)
    clean.record("n_over_cap", "refused_400", 400)
    assert _targets({**base, "abusive_client": clean.report(None, {}, 1.0)})["abusive_client"] is True


@pytest.mark.timeout(30)
def test_a_request_is_cut_by_a_partition_only_while_its_node_is_on_the_minority_side():
    faults = FaultRecord()  # the classification alone: no cluster
    t = time.monotonic()  # a healed cut from t-100 to t-80; one holding since t-10
    faults.partitions = [(t - 100, t - 80, frozenset({"n1", "n2"})), (t - 10, None, frozenset({"n0"}))]
    assert faults.partitioned_during("n1", t - 110) and faults.partitioned_during("n2", t - 81)
    assert not faults.partitioned_during("n1", t - 79)  # sent after the heal
    assert not faults.partitioned_during("n3", t - 90)  # on the majority side
    assert faults.partitioned_during("n0", t - 200)  # in flight when the cut still holding began
    stale = type("RemoteProtocolError", (Exception,), {})("Server disconnected without sending a response.")
    assert faults.stale_after_cut("n1", t - 70, stale) and not faults.stale_after_cut(
        "n1", t - 70, OSError("x")
    )
    assert not faults.stale_after_cut("n3", t - 70, stale)


@pytest.mark.timeout(30)
def test_fault_kinds_for_the_mode_and_the_nodes():
    assert fault_kinds(None, netns=True, nodes=5) == (
        "node_kill",
        "node_stop",
        "runner_stop",
        "abusive_client",
        "link_flap",
        "partition",
    )
    assert "partition" not in fault_kinds(None, netns=True, nodes=2)  # neither side would hold a majority
    assert fault_kinds(["abusive_client"], netns=False) == ("abusive_client",)
    with pytest.raises(ValueError, match="partition needs --netns"):
        fault_kinds(["partition"], netns=False)
    with pytest.raises(ValueError, match="link_flap and partition need --netns"):
        fault_kinds(["link_flap", "partition"], netns=False)
    with pytest.raises(ValueError, match="--nodes >= 3"):
        fault_kinds(["partition"], netns=True, nodes=2)


@pytest.mark.timeout(30)
def test_a_partition_without_namespaces_is_a_usage_error(capsys):
    argv = ["bench", "soak", "--seconds", "5", "--model", "tiny", "--no-netns", "--faults", "partition"]
    assert main(argv) == 2
    assert "partition needs --netns" in capsys.readouterr().err


class _FakeLab:
    """What a partition does to the switch, recorded: split groups, then the heal."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    @contextlib.contextmanager
    def partitioned(self, groups: list[list[Host]]) -> Iterator[None]:
        self.calls.append(("split", [[h.name for h in g] for g in groups]))
        try:
            yield
        finally:
            self.calls.append(("heal",))


@pytest.mark.timeout(30)
def test_a_partition_keeps_the_clients_with_the_majority_watches_it_elect_and_always_heals():
    ids = ["n0", "n1", "n2", "n3", "n4"]
    hosts = {nid: Host(f"lab-{i}", f"10.0.0.{i + 1}", "lab0", i, f"p{i}") for i, nid in enumerate(ids)}
    client = Host("lab-5", "10.0.0.6", "lab0", 5, "p5")
    nodes = SoakCluster.__new__(SoakCluster)  # the fault alone, against a fake switch and fake /state answers
    nodes.lab = lab = _FakeLab()  # type: ignore[assignment]
    nodes.cluster = cluster = LabCluster.__new__(LabCluster)
    cluster.hosts = hosts
    nodes.client_host, nodes.ids, nodes.stop = client, ids, threading.Event()
    chaos = Chaos(nodes, FaultRecord(), seed=1, seconds=60, interval_s=5, recover_s=5)
    asked: list[str | None] = []

    def state(node_id: str | None = None) -> dict[str, Any]:
        asked.append(node_id)
        if node_id is None:
            return {"master": "n2", "term": 4}  # before the cut
        nodes.stop.set()  # the run ends here: the hold ends early, and the switch must still heal
        return {"master": "n0", "term": 5} if node_id != "n2" else {}

    nodes.state = state  # type: ignore[method-assign]
    nodes.state_in = lambda nid, timeout=2.0: {"master": "n2", "term": 4}  # type: ignore[method-assign]
    entry: dict[str, Any] = {}
    chaos.partition(random.Random(1), entry)

    minority, majority = entry["minority"], entry["majority"]
    assert minority[0] == "n2" and len(minority) == 2 and entry["clients_with"] == "majority", entry
    split = lab.calls[0][1]
    assert split[0] == [hosts[n].name for n in majority] + [client.name], split  # clients on br0 with them
    assert split[1] == [hosts[n].name for n in minority] and lab.calls[1] == ("heal",), lab.calls
    assert (entry["new_master"], entry["new_term"], entry["term"]) == ("n0", 5, 4), entry
    assert entry["minority_views"] == {n: {"term": 4, "master": "n2"} for n in minority}
    ((down, up, cut),) = chaos.record.partitions
    assert (
        up is not None and down <= up and cut == frozenset(minority) and chaos.record.done["partitions"] == 1
    )
    assert all(a is None or a in majority for a in asked), (
        asked
    )  # only the majority is asked from the clients
