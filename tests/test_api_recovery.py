"""A request streaming through the HTTP API while the node holding one of its stages is SIGKILLed completes
with the fault-free text: the front on the API's node holds the request and resumes it on the rebuilt
instance; the same on a keyed cluster whose third node copies its stage's weights over keyed links."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import openai
import pytest
from conftest import api_state, place_and_wait_ready, serving_cluster

from shardline.testing.cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture
def cluster(tmp_path, model_dir) -> Iterator[LocalCluster]:
    # The API's node holds no stage: the kill never takes the front.
    with serving_cluster(tmp_path, ["k1", "k2", "k3"], model_dir, {"k1": ["--no-worker"]}) as c:
        yield c


KEY = "a-keyed-cluster-0451"


@pytest.fixture
def keyed(tmp_path, model_dir) -> Iterator[LocalCluster]:
    """The same with a cluster key, and k3 holding no model: its stage's weights come over keyed links."""
    with serving_cluster(tmp_path, ["k1", "k2"], model_dir, {"k1": ["--no-worker"]}, key=KEY) as c:
        empty = tmp_path / "empty-models"
        empty.mkdir()
        c.add("k3", models_dir=empty)
        yield c


@pytest.mark.timeout(300)
def test_request_in_flight_survives_sigkill_of_a_stage_node(cluster):
    _survives_a_stage_node_kill(cluster)


@pytest.mark.timeout(360)
def test_keyed_cluster_copies_weights_serves_and_survives_a_node_kill_with_exact_text(keyed):
    _survives_a_stage_node_kill(keyed)
    assert any((keyed.root / "empty-models" / MODEL).iterdir())  # k3's copy landed beside its models


def _survives_a_stage_node_kill(cluster: LocalCluster) -> None:
    """Through k1's HTTP API (it holds no stage): the node of the last stage is SIGKILLed mid-stream, and
    the stream goes on to the exact fault-free text."""
    api = cluster.nodes["k1"].api
    rec = place_and_wait_ready(api, MODEL, 3, 240)
    instance = rec["instance"]
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

    state = api_state(api)
    rec = next(r for r in state["instances"] if r["instance"] == instance)
    assert rec["recoveries"] >= 1
    assert any(e["kind"] == "failure" for e in state["events"])
