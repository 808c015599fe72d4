"""A request streaming through the HTTP API while the node holding one of its stages is SIGKILLed completes
with the fault-free text: the front on the API's node holds the request and resumes it on the rebuilt
instance."""

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


@pytest.fixture
def cluster(tmp_path, model_dir) -> Iterator[LocalCluster]:
    # The API's node holds no stage: the kill never takes the front.
    with serving_cluster(tmp_path, ["k1", "k2", "k3"], model_dir, {"k1": ["--no-worker"]}) as c:
        yield c


def _state(api: str) -> dict:
    try:
        return httpx.get(api + "/state", timeout=10).json()
    except httpx.TransportError:
        return {}


@pytest.mark.timeout(300)
def test_request_in_flight_survives_sigkill_of_a_stage_node(cluster):
    api = cluster.nodes["k1"].api
    wait_for(lambda: sum(n["alive"] for n in _state(api).get("nodes", [])) == 3, 60, "3 nodes")
    placed = httpx.post(api + "/instances", json={"model": MODEL}, timeout=120)
    assert placed.status_code == 201, placed.text
    instance = placed.json()["instance"]

    def ready() -> dict | None:
        rec = next((r for r in _state(api).get("instances", []) if r["instance"] == instance), None)
        return rec if rec and rec["phase"] == "ready" else None

    rec = wait_for(ready, 180, "the instance ready")
    assert {s["node_id"] for s in rec["stages"]} == {"k2", "k3"}
    victim = rec["stages"][-1]["node_id"]

    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=240)
    msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    reference = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48)
    expected = reference.choices[0].message.content
    assert reference.usage.completion_tokens >= 20

    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=48, stream=True
    )
    parts, killed = [], False
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 6 and not killed:
                cluster.nodes[victim].kill(signal.SIGKILL)
                killed = True
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert killed
    assert "".join(parts) == expected
    assert finish == reference.choices[0].finish_reason

    state = _state(api)
    rec = next(r for r in state["instances"] if r["instance"] == instance)
    assert rec["recoveries"] >= 1
    assert any(e["kind"] == "failure" for e in state["events"])
