"""One download per cluster, with real node daemons and the real huggingface_hub client against a stand-in
hub on loopback: a 3-node cluster asked for a model none holds has exactly one node contact the hub; the
other two copy their stages from it, verified; all three serve the same digests and mlx-lm's tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterError
from shardline.cluster.placement import PlacementRequest
from shardline.models.hub import CHUNK_BYTES
from shardline.models.store.manifest import local_models
from shardline.testing import arch_zoo
from shardline.testing.cluster import LocalCluster
from shardline.testing.fake_hub import FakeHub, mlx_repo_files
from shardline.testing.reference import Reference
from tests.conftest import assert_no_runner_left, random_prompt, wait_for

IDS = ["d1", "d2", "d3"]
REPO = "org/tiny-llama"
THREE = PlacementRequest(sequences=2, reserve_tokens=512, hop_cost_fraction=0.0, max_stages=3)


def origins(hub: FakeHub) -> set[str]:
    """The nodes that sent the hub a request (each node's client says its name: HF_HUB_USER_AGENT_ORIGIN)."""
    return {n for r in hub.requests for n in IDS if f"node-{n}" in r.user_agent}


SIZES = {"num_hidden_layers": 6}
HELD_BYTES = 1_100_000  # the hub holds the download that is resumed here: one chunk (1 MiB) is on disk


@pytest.fixture
def hub_cluster(tmp_path: Path):
    with FakeHub() as hub:
        hub.add_repo(REPO, mlx_repo_files("llama", seed=3, sizes=SIZES))
        c = LocalCluster(tmp_path / "c", IDS, tmp_path / "unused", api=True)
        for n in IDS:
            c.node_models[n] = tmp_path / n / "models"
            c.node_models[n].mkdir(parents=True)
            c.node_env_extra[n] = {
                "HF_ENDPOINT": hub.url,
                "HF_HOME": str(tmp_path / n / "hf"),
                "HF_HUB_USER_AGENT_ORIGIN": f"node-{n}",
                "HF_HUB_DISABLE_TELEMETRY": "1",
            }
        c.start()
        try:
            yield hub, c
        finally:
            pids = c.all_pids()
            c.close()
            assert_no_runner_left(pids)


@pytest.mark.timeout(300)
def test_a_model_no_node_holds_is_downloaded_once_and_the_others_copy_it(hub_cluster, tmp_path):
    hub, cluster = hub_cluster
    client = cluster.client("d1")
    client.wait(lambda v: {n.node_id for n in v.nodes if n.alive} == set(IDS), 60, "three nodes")
    seen: list[tuple[str, str]] = []

    def on_download(d: cm.Download, p: cm.DownloadProgress | None) -> None:
        seen.append((d.node_id, p.phase if p is not None else ""))

    from shardline.cluster.downloads import named

    name, source = named(REPO)
    assert source == REPO and "/" not in name
    # A request naming the hub model starts its download through the node it reached, and is answered at
    # once: 503, in the API's error shape, with when to retry.
    api = cluster.nodes["d2"].api
    body = {"model": REPO, "prompt": [1, 2, 3], "max_tokens": 4}
    early = httpx.post(api + "/v1/completions", json=body, timeout=60)
    assert early.status_code == 503 and "Retry-After" in early.headers, early.text
    assert "being downloaded" in early.json()["error"]["message"]
    reply = client.place(name, THREE, source=source, on_download=on_download)
    assert reply.instance is not None
    rec = client.wait_ready(reply.instance.instance, 120)
    downloader = "d2"  # the node the request reached, which may hold stages
    assert {n for n, _ in seen} <= {downloader}  # what the place waited on (if the download was still on)

    # Exactly one node contacted the hub; the others copied their stages from it.
    assert origins(hub) == {downloader}, hub.counts()
    requests = len(hub.requests)
    assert requests > 0
    print(f"hub requests, all from {downloader}: {requests}: {hub.counts()['by_path']}")
    assert sorted(s.node_id for s in rec.stages) == IDS
    held = {n: local_models(cluster.node_models[n]).get(name) for n in IDS}
    assert held[downloader] is not None and held[downloader].full
    assert all(h is not None and not h.full for n, h in held.items() if n != downloader)
    assert {h.digest for h in held.values() if h is not None} == {rec.digest}  # one version everywhere

    prompt = random_prompt(12, seed=21)
    original = arch_zoo.write("llama", tmp_path / "original", seed=3, sizes=SIZES)
    expected = Reference(original).greedy(prompt, 12)[0]
    assert client.front(rec.instance).submit(prompt, max_tokens=12).tokens(timeout=60) == expected
    late = httpx.post(api + "/v1/completions", json=body | {"prompt": prompt, "max_tokens": 12}, timeout=60)
    assert late.status_code == 200, late.text  # the same reference, now served by its instance
    # Placing it again (another instance) asks the hub nothing: it is held.
    again = client.place(name, THREE, source=source)
    assert again.download is None and again.instance is not None
    assert len(hub.requests) == requests

    # A model the hub does not have: the node asked says why, and the place fails in that one line.
    with pytest.raises(ClusterError) as err:
        client.place("org--absent", THREE, source="org/absent")
    message = str(err.value)
    assert "downloading org/absent on node" in message and "\n" not in message, message

    # The downloader dies mid-file: back, it finds the download in the view and resumes the partial file
    # (a range request from where it stopped); still no other node asks the hub.
    other = "org/tiny-two"
    hub.add_repo(other, mlx_repo_files("llama", seed=4, sizes=SIZES))
    weights = hub.files(other)["model.safetensors"]
    reached = hub.hold_after(other, "model.safetensors", HELD_BYTES)
    api3 = cluster.nodes["d3"].api
    early = httpx.post(api3 + "/v1/completions", json=body | {"model": other}, timeout=60)
    assert early.status_code == 503, early.text
    assert reached.wait(60), "the download reached the hub"
    blobs = tmp_path / "d3" / "hf" / "hub" / "models--org--tiny-two" / "blobs"
    partial = blobs / f"{weights.sha256}.incomplete"
    wait_for(lambda: partial.is_file() and partial.stat().st_size >= CHUNK_BYTES, 30, "the partial file")
    cluster.nodes["d3"].kill()
    have = partial.stat().st_size
    hub.release(other, "model.safetensors")
    client.wait(lambda v: "d3" not in cluster.alive_ids(v), 30, "d3 gone")
    cluster.nodes["d3"].start()
    client.wait(lambda v: "d3" in cluster.alive_ids(v), 60, "d3 back")
    name2, _ = named(other)
    placed = client.place(name2, THREE, source=other).instance
    assert placed is not None
    rec2 = client.wait_ready(placed.instance, 120)
    asked = [r for r in hub.requests if other in r.path]
    assert {n for r in asked for n in IDS if f"node-{n}" in r.user_agent} == {"d3"}
    gets = [r for r in asked if r.path.endswith("/model.safetensors") and "_cdn" in r.path]
    assert len(gets) == 2 and gets[1].range == f"bytes={have}-", [(r.path, r.range) for r in gets]
    assert sorted(s.node_id for s in rec2.stages) == IDS
