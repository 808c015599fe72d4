"""The cluster with real node daemons on loopback: discovery, master election and failover, placement,
re-placement after a node is SIGKILLed, weight copies, the shared secret. Tiny models; the default model in
test_cluster_default_model.py."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_no_runner_left, random_prompt

from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterClient, ClusterError
from shardline.cluster.placement import PlacementRequest
from shardline.models.store.manifest import read_shard_manifest, record_import
from shardline.testing.cluster import LocalCluster
from shardline.testing.reference import Reference
from shardline.trust.credentials import Credentials

# A `shardline node` whose weight server alters what it sends (a lying source; test-only).
TAMPERING_NODE = Path(__file__).resolve().parent / "tampering_node.py"
SMALL = PlacementRequest(sequences=2, reserve_tokens=512, hop_cost_fraction=0.0)


@pytest.fixture(scope="module")
def reference(models) -> Reference:
    return Reference(models / "tiny-llama")


@pytest.fixture
def make_cluster(tmp_path: Path, models: Path) -> Iterator:
    made: list[LocalCluster] = []

    def make(ids: list[str], **kw: object) -> LocalCluster:
        c = LocalCluster(tmp_path / f"c{len(made)}", ids, kw.pop("models_dir", models), **kw)  # type: ignore[arg-type]
        made.append(c)
        return c.start()

    yield make
    for c in made:
        pids = c.all_pids()
        c.close()
        assert_no_runner_left(pids)
        for node_id, node in c.nodes.items():  # a node's own loops never failed along the way
            text = node.log.read_text(errors="replace") if node.log else ""
            for broken in ("report failed", "node step failed", "controller step failed"):
                assert broken not in text, f"{node_id}: {broken}\n{node.tail(60)}"


def place(client: ClusterClient, stages: int, timeout: float = 60) -> str:
    reply = client.place("tiny-llama", SMALL.model_copy(update={"max_stages": stages}))
    assert reply.instance is not None
    return client.wait_ready(reply.instance.instance, timeout).instance


def wait_nodes(client: ClusterClient, ids: set[str], timeout: float = 30) -> None:
    client.wait(lambda v: {n.node_id for n in v.nodes if n.alive} == ids, timeout, f"nodes {sorted(ids)}")


def kill_mid_stream(
    cluster: LocalCluster, client: ClusterClient, instance: str, reference: Reference, victim: str, seed: int
) -> cm.InstanceRecord:
    """A long greedy request; SIGKILL `victim` after 5 tokens; the answer is exact and one recovery is made.
    Returns the instance as it serves again."""
    prompt = random_prompt(20, seed=seed)
    expected = reference.greedy(prompt, 400)[0]
    stream = client.front(instance).submit(prompt, max_tokens=400).stream(timeout=90)
    got = [next(stream).token for _ in range(5)]
    cluster.nodes[victim].kill(signal.SIGKILL)
    got += [t.token for t in stream]
    assert got == expected
    recovered = lambda v: (r := client.instance(instance)) is not None and r.recoveries > 0  # noqa: E731
    client.wait(recovered, 30, "the recovery")
    after = client.wait_ready(instance, 30)
    view = client.view
    failures = [e.message for e in view.events if e.kind == "failure"] if view else []
    assert after.recoveries == 1, failures
    assert victim not in {s.node_id for s in after.stages}
    return after


@pytest.mark.timeout(180)
def test_three_nodes_find_each_other_and_generate_like_one_process(make_cluster, reference):
    cluster = make_cluster(["n1", "n2", "n3"])
    client = cluster.client("n3")
    wait_nodes(client, {"n1", "n2", "n3"})
    view = client.wait(lambda v: v.master == "n1", 10, "n1 as master")  # the lowest id
    assert view.term >= 1
    prompt = random_prompt(30, seed=11)
    expected = reference.greedy(prompt, 24)[0]
    for stages in (3, 2):
        instance = place(client, stages)
        rec = client.instance(instance)
        assert rec is not None and len(rec.stages) == stages
        layers = [(s.start, s.end) for s in rec.stages]
        assert layers[0][0] == 0 and layers[-1][1] == 6
        assert all(a[1] == b[0] for a, b in itertools.pairwise(layers)), layers
        assert len({s.node_id for s in rec.stages}) == stages
        got = client.front(instance).submit(prompt, max_tokens=24).tokens(timeout=60)
        assert got == expected, f"{stages} stages"
        client.remove(instance)
    client.wait(lambda v: not v.instances, 10, "instances removed")
    nodes = cluster.nodes.values()
    client.wait(lambda v: not any(n.runner_pids() for n in nodes), 15, "runners stopped")


@pytest.mark.timeout(180)
def test_sigkill_of_a_stage_node_mid_generation_replaces_and_completes_exactly(make_cluster, reference):
    cluster = make_cluster(["k1", "k2", "k3"])
    client = cluster.client("k1")
    wait_nodes(client, {"k1", "k2", "k3"})
    instance = place(client, 2)
    rec = client.instance(instance)
    assert rec is not None
    victim = rec.stages[1].node_id
    assert victim != "k1"  # the master and this client's node survive
    after = kill_mid_stream(cluster, client, instance, reference, victim, seed=12)
    assert after.generation > rec.generation
    view = client.view
    assert view is not None and victim not in cluster.alive_ids(view)
    assert any(e.kind == "leave" and e.node == victim for e in view.events)
    failures = [e.message for e in view.events if e.kind == "failure"]
    assert any(victim in message for message in failures), failures


@pytest.mark.timeout(180)
def test_master_without_stage_killed_new_master_in_seconds_runners_untouched(make_cluster, reference):
    cluster = make_cluster(["a0", "b1", "b2"], node_extra={"a0": ["--no-stages"]})
    client = cluster.client("b1")
    wait_nodes(client, {"a0", "b1", "b2"})
    client.wait(lambda v: v.master == "a0", 15, "a0 as master")
    instance = place(client, 2)
    rec = client.instance(instance)
    assert rec is not None and {s.node_id for s in rec.stages} == {"b1", "b2"}
    pids = {n: cluster.nodes[n].runner_pids() for n in ("b1", "b2")}
    prompt = random_prompt(15, seed=13)
    expected = reference.greedy(prompt, 60)[0]
    handle = client.front(instance).submit(prompt, max_tokens=60)
    stream = handle.stream(timeout=60)
    got = [next(stream).token for _ in range(3)]
    term = client.view.term if client.view else 0
    killed = time.monotonic()
    cluster.nodes["a0"].kill(signal.SIGKILL)
    client.wait(lambda v: v.master == "b1" and v.term > term, 10, "b1 as the new master")
    took = time.monotonic() - killed
    got += [t.token for t in stream]
    assert got == expected
    after = client.wait_ready(instance, 10)
    assert after.generation == rec.generation and after.recoveries == 0
    assert {n: cluster.nodes[n].runner_pids() for n in ("b1", "b2")} == pids
    assert took < 5.0, f"new master after {took:.1f}s"  # target 3 s; the bench measures it
    # The new master serves new requests on the adopted generation.
    again = client.front(instance).submit(prompt, max_tokens=10).tokens(timeout=30)
    assert again == expected[:10]


@pytest.mark.timeout(180)
def test_master_holding_a_stage_killed_instance_rebuilt_on_survivors(make_cluster, reference):
    # Two nodes hold the two stages; a spare joins after the placement; equal declared speeds keep the split.
    cluster = make_cluster(["m1", "m2"], extra=["--compute-score", "50"])
    client = cluster.client("m2")
    wait_nodes(client, {"m1", "m2"})
    client.wait(lambda v: v.master == "m1", 15, "m1 as master")
    instance = place(client, 2)
    rec = client.instance(instance)
    assert rec is not None and [s.node_id for s in rec.stages] == ["m1", "m2"]
    survivor = cluster.nodes["m2"].runner_pids()
    cluster.add("m3", "--compute-score", "50")
    wait_nodes(client, {"m1", "m2", "m3"})
    prompt = random_prompt(18, seed=14)
    expected = reference.greedy(prompt, 400)[0]
    stream = client.front(instance).submit(prompt, max_tokens=400).stream(timeout=90)
    got = [next(stream).token for _ in range(3)]
    cluster.nodes["m1"].kill(signal.SIGKILL)
    got += [t.token for t in stream]
    assert got == expected
    client.wait(lambda v: v.master == "m2", 15, "m2 as the new master")
    rebuilt = lambda v: (r := client.instance(instance)) is not None and r.generation > rec.generation  # noqa: E731
    client.wait(rebuilt, 30, "the instance rebuilt")
    after = client.wait_ready(instance, 30)
    assert [s.node_id for s in after.stages] == ["m3", "m2"]
    assert (after.stages[1].start, after.stages[1].end) == (rec.stages[1].start, rec.stages[1].end)
    assert cluster.nodes["m2"].runner_pids() == survivor  # where its layers are, the survivor's pid is kept


@pytest.mark.timeout(120)
def test_model_too_large_is_refused_with_numbers_and_nothing_starts(make_cluster):
    cluster = make_cluster(["t1", "t2"], extra=["--memory-limit", "8M"])
    client = cluster.client("t1")
    wait_nodes(client, {"t1", "t2"})
    with pytest.raises(ClusterError) as err:
        client.place("tiny-llama", PlacementRequest(sequences=64, reserve_tokens=4096))
    message = str(err.value)
    assert "GB" in message and "t1" in message and "t2" in message, message
    with pytest.raises(ClusterError, match="no-such-model"):
        client.place("no-such-model")
    view = client.wait(lambda v: True, 5, "a view")
    assert view.instances == []
    assert not any(n.runner_pids() for n in cluster.nodes.values())


@pytest.mark.timeout(150)
def test_node_without_the_model_gets_its_stage_copied_and_a_corrupt_copy_is_fetched_again(
    make_cluster, reference, tmp_path
):
    empty = tmp_path / "empty-models"
    empty.mkdir()
    cluster = make_cluster(["w1"])
    cluster.add("w2", models_dir=empty)
    client = cluster.client("w1")
    wait_nodes(client, {"w1", "w2"})
    prompt = random_prompt(12, seed=15)
    expected = reference.greedy(prompt, 20)[0]
    instance = place(client, 2)
    rec = client.instance(instance)
    assert rec is not None and [s.node_id for s in rec.stages] == ["w1", "w2"]
    copy = empty / "tiny-llama"
    assert (copy / "shardline_shard.json").is_file()
    assert client.front(instance).submit(prompt, max_tokens=20).tokens(timeout=30) == expected
    # Corrupt the copy on disk, then make w2's stage restart: the copy is checked, fetched again, and right.
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    for pid in cluster.nodes["w2"].runner_pids():
        os.kill(pid, signal.SIGKILL)
    client.wait(
        lambda v: (r := client.instance(instance)) is not None and r.recoveries >= 1, 20, "a recovery"
    )
    client.wait_ready(instance, 60)
    assert client.front(instance).submit(prompt, max_tokens=20).tokens(timeout=30) == expected
    assert "fetching it again" in cluster.nodes["w2"].tail(200)
    client.wait(lambda v: weights_events(client, "w2"), 10, "the rejection of w2's stage copy")
    assert "stage copy of model tiny-llama on node w2 does not match" in weights_events(client, "w2")[0]


ONE_STAGE = SMALL.model_copy(update={"max_stages": 1})


def weights_events(client: ClusterClient, node: str) -> list[str]:
    view = client.view
    return [e.message for e in view.events if e.kind == "weights" and e.node == node] if view else []


@pytest.mark.timeout(150)
def test_a_source_serving_altered_bytes_is_refused_named_and_the_stage_loads_from_an_honest_one(
    make_cluster, reference, tmp_path
):
    # v1 and v2 hold the model (v1 alters every tensor it sends; its files, manifest and digest are honest)
    # and have no room for a stage; v3 has no copy: it tries v1 first (the master's order), then v2.
    empty = tmp_path / "empty-models"
    empty.mkdir()
    no_room = ["--memory-limit", "1K"]
    cluster = make_cluster(
        ["v1", "v2"],
        launchers={"v1": [str(TAMPERING_NODE), "tiny-llama"]},
        node_extra={"v1": no_room, "v2": no_room},
    )
    cluster.add("v3", models_dir=empty)
    client = cluster.client("v3")
    wait_nodes(client, {"v1", "v2", "v3"})
    prompt = random_prompt(12, seed=21)
    expected = reference.greedy(prompt, 20)[0]
    reply = client.place("tiny-llama", ONE_STAGE)
    assert reply.instance is not None and reply.instance.digest
    rec = client.wait_ready(reply.instance.instance, 60)
    assert [s.node_id for s in rec.stages] == ["v3"] and rec.digest == reply.instance.digest
    assert client.front(rec.instance).submit(prompt, max_tokens=20).tokens(timeout=30) == expected
    copy = read_shard_manifest(empty / "tiny-llama")
    assert copy.source is not None and copy.source.node == "v2" and copy.model_digest() == rec.digest
    refused = client.wait(lambda v: weights_events(client, "v1"), 10, "the refusal of v1").events
    [message] = weights_events(client, "v1")
    assert "tiny-llama" in message and "does not match its sha256" in message and "by node v3" in message
    assert not weights_events(client, "v2") and [e.instance for e in refused if e.kind == "weights"] == [
        rec.instance
    ]


@pytest.mark.timeout(150)
def test_a_tampered_local_copy_is_detected_before_load_and_a_good_copy_fetched(
    make_cluster, reference, models, tmp_path
):
    # u1 and u2 imported the same model; u1's file is altered afterwards (same size, same mtime: only its
    # bytes tell). The stage goes to u1 (u2 has no room): u1 must not load its copy.
    mine, theirs = tmp_path / "u1-models", tmp_path / "u2-models"
    for root in (mine, theirs):
        shutil.copytree(models / "tiny-llama", root / "tiny-llama")
    record = record_import(mine / "tiny-llama")
    assert record_import(theirs / "tiny-llama").digest() == record.digest()
    weights = mine / "tiny-llama" / "model.safetensors"
    entry = record.tensors["model.layers.3.self_attn.o_proj.weight"]
    st = weights.stat()
    with weights.open("r+b") as f:
        f.seek(entry.offset + 11)
        f.write(b"\x7f\x7f")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    cluster = make_cluster(["u1"], models_dir=mine)
    cluster.add("u2", "--memory-limit", "1K", models_dir=theirs)
    client = cluster.client("u1")
    wait_nodes(client, {"u1", "u2"})
    prompt = random_prompt(12, seed=22)
    expected = reference.greedy(prompt, 20)[0]
    reply = client.place("tiny-llama", ONE_STAGE)
    assert reply.instance is not None
    rec = client.wait_ready(reply.instance.instance, 60)
    assert [s.node_id for s in rec.stages] == ["u1"]
    assert client.front(rec.instance).submit(prompt, max_tokens=20).tokens(timeout=30) == expected
    client.wait(lambda v: weights_events(client, "u1"), 10, "the rejection of u1's own copy")
    [message] = weights_events(client, "u1")
    assert "local copy of model tiny-llama" in message and "o_proj" in message and "moved aside" in message
    [aside] = list(mine.glob(".tiny-llama.rejected-*"))
    assert (aside / "model.safetensors").read_bytes() != (
        theirs / "tiny-llama" / "model.safetensors"
    ).read_bytes()
    copy = read_shard_manifest(mine / "tiny-llama")  # what loaded: a stage copy from u2, checked
    assert copy.source is not None and copy.source.node == "u2" and copy.model_digest() == record.digest()


@pytest.mark.timeout(120)
def test_node_with_a_wrong_cluster_key_is_never_listed(make_cluster, tmp_path):
    cluster = make_cluster(["s1", "s2"], key="right-secret")
    good = cluster.client("s1")
    wait_nodes(good, {"s1", "s2"})
    intruder = cluster.add("s0", key="wrong-secret")  # the lowest id: would be master if let in
    # It starts and says so; then several views later it is still not listed and s1 is still master.
    deadline = time.monotonic() + 30
    while "listening on" not in intruder.tail() and time.monotonic() < deadline:
        good.wait(lambda v: True, 1, "a view")
    seen = 0
    for _ in range(6):
        before = good.view
        good.wait(lambda v, b=before: v is not b, 5, "a fresh view")
        seen += 1
        assert good.view is not None and "s0" not in {n.node_id for n in good.view.nodes}
        assert good.view.master == "s1"
    assert seen == 6
    bad = cluster.client("s1", Credentials("wrong-secret"))
    with pytest.raises(ClusterError, match=r"no master|not seen"):
        bad.ask(cm.Place(model="tiny-llama"), 3)


@pytest.mark.timeout(180)
def test_survivors_keep_their_process_and_weights_after_a_node_loss(make_cluster, reference):
    # Equal declared speeds: the layer split is then the same over any two nodes, so the survivor's is kept.
    cluster = make_cluster(["r1", "r2", "r3"], extra=["--compute-score", "50"])
    client = cluster.client("r1")
    wait_nodes(client, {"r1", "r2", "r3"})
    instance = place(client, 2)
    rec = client.instance(instance)
    assert rec is not None
    keeper, victim = rec.stages[0].node_id, rec.stages[1].node_id
    survivor = cluster.nodes[keeper].runner_pids()
    assert len(survivor) == 1
    after = kill_mid_stream(cluster, client, instance, reference, victim, seed=17)
    assert after.stages[0].node_id == keeper
    events = [e.message for e in client.view.events if e.kind == "failure"] if client.view else []
    assert (after.stages[0].start, after.stages[0].end) == (rec.stages[0].start, rec.stages[0].end), events
    assert cluster.nodes[keeper].runner_pids() == survivor  # same process, weights kept, new generation
    assert after.stages[0].pid == survivor[0]


@pytest.mark.timeout(240)
def test_tensor_parallel_groups_over_four_nodes_match_and_survive_a_member_node_loss(make_cluster, reference):
    cluster = make_cluster(["t1", "t2", "t3", "t4"])
    client = cluster.client("t1")
    wait_nodes(client, {"t1", "t2", "t3", "t4"})
    # Left to choose, the tiny model stays a pipeline, with the numbers why, over links the nodes measured.
    dry = SMALL.model_copy(update={"max_stages": 2})
    deadline = time.monotonic() + 30
    while "link measured" not in (reply := client.place("tiny-llama", dry, dry_run=True)).layout:
        assert time.monotonic() < deadline, f"links never measured: {reply.layout}"
        time.sleep(0.5)  # the nodes' probe period, bounded by the deadline
    assert reply.layout.startswith("pipeline") and "ms a token" in reply.layout, reply.layout
    assert not any(r.member for r in reply.runners)
    # Asked for: 2 stages, each a group of 2 (4 runners on 4 nodes), the faces first in slot order.
    asked = SMALL.model_copy(update={"max_stages": 2, "tensor_parallel": 2})
    placed = client.place("tiny-llama", asked)
    assert placed.instance is not None
    rec = client.wait_ready(placed.instance.instance, 90)
    assert [(s.ring, s.member) for s in rec.stages] == [(None, 0), (None, 0), (0, 1), (1, 1)], rec.stages
    assert len({s.node_id for s in rec.stages}) == 4 and rec.layout.startswith("groups"), rec.layout
    prompt = random_prompt(30, seed=13)
    expected = reference.greedy(prompt, 24)[0]
    assert client.front(rec.instance).submit(prompt, max_tokens=24).tokens(timeout=60) == expected
    # The node of stage 1's other member dies mid-stream: its face's sum finds the stream broken, and the
    # instance is rebuilt on the three left (too few for 2 x 2: placement decides, and says so).
    victim = rec.stages[3].node_id
    assert victim != "t1"
    after = kill_mid_stream(cluster, client, rec.instance, reference, victim, seed=14)
    assert "not possible" in after.layout, after.layout
