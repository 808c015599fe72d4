"""The default model on a real cluster: the same greedy text on one, two and three nodes; `shardline up`."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from conftest import assert_no_runner_left

from shardline.cluster.placement import PlacementRequest
from shardline.testing.cluster import MODEL_RUNNERS, LocalCluster, free_port

pytestmark = pytest.mark.slow
QUESTION = "Name the capital of France."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("dm"), ["d1", "d2", "d3"], model_dir.parent)
    c.runners = dict(MODEL_RUNNERS)
    c.extra = ["--prefill-step", "64"]
    c.start()
    yield c
    pids = c.all_pids()
    c.close()
    assert_no_runner_left(pids)


@pytest.mark.timeout(300)
def test_default_model_gives_the_same_greedy_text_on_one_two_and_three_nodes(cluster, model_dir, tokenizer):
    client = cluster.client("d1")
    client.wait(lambda v: sum(n.alive for n in v.nodes) == 3, 60, "3 nodes")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    answers = {}
    for stages in (1, 2, 3):
        request = PlacementRequest(sequences=2, reserve_tokens=1024, hop_cost_fraction=0.0, max_stages=stages)
        reply = client.place(model_dir.name, request)
        assert reply.instance is not None
        rec = client.wait_ready(reply.instance.instance, 180)
        assert len(rec.stages) == stages and len({s.node_id for s in rec.stages}) == stages
        handle = client.front(rec.instance).submit(
            prompt, max_tokens=24, stop_tokens=list(tokenizer.eos_token_ids)
        )
        answers[stages] = handle.tokens(timeout=120)
        client.remove(rec.instance)
    assert answers[2] == answers[1] and answers[3] == answers[1], answers
    assert "Paris" in tokenizer.decode(answers[1])


def _lines(stream) -> queue.Queue[str]:  # type: ignore[no-untyped-def]
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_line(q: queue.Queue[str], needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r} within {timeout:.0f}s; got: {''.join(seen)[-2000:]}")


@pytest.mark.timeout(300)
def test_up_serves_the_default_model_and_stops_cleanly_on_ctrl_c(tmp_path):
    port, api_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "shardline", "up", "--nodes", "2", "--port", str(port)]
    argv += ["--api-port", str(api_port), "--data-dir", str(tmp_path / "up")]
    err = tmp_path / "up.err"
    with open(err, "w") as err_file:
        up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
    try:
        lines = _lines(up.stdout)
        ready = _wait_line(lines, "ready on 2 nodes", 240)
        assert f"http://127.0.0.1:{api_port}" in ready
        # The line printed for pasting, pasted into a shell: it streams an answer.
        curl = _wait_line(lines, "curl ", 10).strip()
        pasted = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=180)
        assert pasted.returncode == 0, pasted.stderr
        events = [ln[len("data: ") :] for ln in pasted.stdout.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        chunks = [json.loads(e) for e in events[:-1]]
        answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert "Paris" in answer
        family = [p.pid for p in psutil.Process(up.pid).children(recursive=True)]
        assert len(family) >= 4  # two nodes and their runners
        out = subprocess.run(
            [sys.executable, "-m", "shardline", "generate", "--cluster", f"tcp/127.0.0.1:{port}", QUESTION],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert_no_runner_left(family)
        # One master from the start: a joining node that campaigned alone (its settle window used up by
        # its own start) made a second master of term 1, whose view killed the first generation.
        said = err.read_text()
        assert "not in the view" not in said and "killed by SIGKILL" not in said, said[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
