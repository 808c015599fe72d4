"""A keyed cluster with the default model: weights copied to a node that lacks them, served through the
official `openai` client, and a node kill mid-stream costing a pause, never the exact text."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import serving_cluster, wait_for

from shardline.testing.cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
KEY = "a-keyed-cluster-0451"


@pytest.fixture
def cluster(tmp_path, model_dir) -> Iterator[LocalCluster]:
    # k1 serves HTTP and holds no stage (the kill never takes the front); k3 holds no model at all.
    with serving_cluster(tmp_path, ["k1", "k2"], model_dir, {"k1": ["--no-worker"]}, key=KEY) as c:
        empty = tmp_path / "empty-models"
        empty.mkdir()
        c.add("k3", models_dir=empty)
        yield c


def _state(api: str) -> dict:
    try:
        return httpx.get(api + "/state", timeout=10).json()
    except httpx.TransportError:
        return {}


@pytest.mark.timeout(360)
def test_keyed_cluster_copies_weights_serves_and_survives_a_node_kill_with_exact_text(cluster):
    api = cluster.nodes["k1"].api
    wait_for(lambda: sum(n["alive"] for n in _state(api).get("nodes", [])) == 3, 60, "3 nodes")
    placed = httpx.post(api + "/instances", json={"model": MODEL}, timeout=120)
    assert placed.status_code == 201, placed.text
    instance = placed.json()["instance"]

    def ready() -> dict | None:
        rec = next((r for r in _state(api).get("instances", []) if r["instance"] == instance), None)
        return rec if rec and rec["phase"] == "ready" else None

    rec = wait_for(ready, 240, "the instance ready")
    assert {s["node_id"] for s in rec["stages"]} == {"k2", "k3"}  # k3 copied its stage over keyed links
    assert any((cluster.root / "empty-models" / MODEL).iterdir())  # the copy landed beside k3's models
    victim = rec["stages"][-1]["node_id"]

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=240)
    msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    reference = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40)
    expected = reference.choices[0].message.content
    assert reference.usage.completion_tokens >= 20

    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=40, stream=True
    )
    parts, killed = [], False
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 6 and not killed:
                cluster.nodes[victim].kill(signal.SIGKILL)
                killed = True
    assert killed
    assert "".join(parts) == expected
    rec = next(r for r in _state(api)["instances"] if r["instance"] == instance)
    assert rec["recoveries"] >= 1
