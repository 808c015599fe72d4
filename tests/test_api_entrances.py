"""The HTTP entrance of one node, against a real 1-node cluster serving the default model: auto-place done
once for concurrent first requests, slots freed whenever a client leaves, the pending count in /health and
/metrics, max_tokens checked against the context, tokenisation off the event loop, and Ollama's own ways of
calling (curl -d, name:latest, /api/show by name) with foreign web pages refused.

The first requests of the module place the model (the `placed` fixture); every test leaves the instance as it
found it, idle.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import ollama
import openai
import pytest
from conftest import serving_cluster, wait_for

from shardline.testing.cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
CONTEXT = 8192  # the model's
MAX_PENDING = 4
FIRST = 4  # concurrent first requests
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    extra = {"e1": ["--max-pending", str(MAX_PENDING)]}
    with serving_cluster(tmp_path_factory.mktemp("entrances"), ["e1"], model_dir, extra) as c:
        c.client("e1").wait(lambda v: any(n.alive for n in v.nodes), 60, "the node")
        wait_for(lambda: _get(c.nodes["e1"].api, "/health").status_code == 200, 30, "e1's API")
        yield c


def _get(api: str, path: str, **kw: Any) -> httpx.Response:
    try:
        return httpx.get(api + path, timeout=30, **kw)
    except httpx.TransportError:
        return httpx.Response(599)


def _chat(content: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def placed(cluster) -> tuple[str, list[httpx.Response]]:
    """e1's API after FIRST requests naming the unplaced model arrived at once (auto-place)."""
    api = cluster.nodes["e1"].api
    assert _get(api, "/state").json()["instances"] == []
    results: list[httpx.Response] = []
    lock = threading.Lock()
    go = threading.Barrier(FIRST)

    def one(i: int) -> None:
        go.wait(timeout=30)
        r = httpx.post(api + CHAT, json=_chat(f"Say {i}.", 2), timeout=280)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(FIRST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=290)
    return api, results


@pytest.fixture(scope="module")
def api(placed) -> str:
    return placed[0]


def _state(api: str) -> dict[str, Any]:
    r = _get(api, "/state")
    return r.json() if r.status_code == 200 else {}


def _pending(api: str) -> int | None:
    r = _get(api, "/health")
    return r.json().get("pending") if r.status_code == 200 else None


def _idle(api: str) -> bool:
    insts = _state(api).get("instances", [])
    return _pending(api) == 0 and bool(insts) and insts[0]["live"]["leader_requests"] == 0


def _cancelled(api: str) -> float:
    for line in _get(api, "/metrics").text.splitlines():
        if line.startswith('shardline_requests_total{endpoint="chat",outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


# ---- auto-place --------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_concurrent_first_requests_place_exactly_one_instance(placed):
    api, results = placed
    assert len(results) == FIRST
    assert [r.status_code for r in results] == [200] * FIRST, [r.text for r in results]
    instances = _state(api)["instances"]
    assert len(instances) == 1, instances
    assert instances[0]["model"] == MODEL
    placements = [e for e in _state(api)["events"] if e["kind"] == "placed"]
    assert len(placements) == 1, placements  # the master was asked once


# ---- slots, pending, cancellation --------------------------------------------------------------------------


def _drop_before_first_byte(api: str, body: dict[str, Any]) -> None:
    """Send a whole streamed request, then close the connection without reading a byte of the answer."""
    url = urlsplit(api)
    payload = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head + payload)


@pytest.mark.timeout(300)
def test_streams_dropped_before_the_first_byte_free_their_slots_and_cancel(api):
    wait_for(lambda: _idle(api), 60, "the node idle")
    before = _cancelled(api)
    long = _chat("Write a very long story about a lighthouse.", 2000, stream=True, ignore_eos=True)
    for _ in range(MAX_PENDING):
        _drop_before_first_byte(api, long)
    # Each one was admitted and then cancelled (none ran to its 2000 tokens holding a slot)...
    wait_for(lambda: _cancelled(api) >= before + MAX_PENDING, 60, "every dropped request cancelled")
    wait_for(lambda: _idle(api), 30, "no request pending or held by the leader")
    # ... so a full set of new requests is admitted, none refused with 429.
    codes: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: codes.append(httpx.post(api + CHAT, json=_chat("Hi", 2), timeout=120).status_code)
        )
        for _ in range(MAX_PENDING)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert codes == [200] * MAX_PENDING
    wait_for(lambda: _pending(api) == 0, 30, "pending back to 0")


@pytest.mark.timeout(300)
def test_pending_in_health_and_metrics_while_a_stream_runs_and_after_it_is_dropped(api):
    wait_for(lambda: _idle(api), 60, "the node idle")
    body = _chat("Write a very long story about a lighthouse.", 2000, stream=True, ignore_eos=True)
    with httpx.stream("POST", api + CHAT, json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # after the first byte
        assert _pending(api) == 1
        metrics = _get(api, "/metrics").text
        assert "shardline_requests_pending 1.0" in metrics
    wait_for(lambda: _idle(api), 30, "the dropped stream's slot freed and its request cancelled")
    assert "shardline_requests_pending 0.0" in _get(api, "/metrics").text


# ---- max_tokens against the context ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_max_tokens_beyond_the_context_left_is_a_400_naming_max_tokens(api):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Hi"}]
    # Less than the context, but more than the prompt leaves of it: refused, not silently clamped.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=CONTEXT - 2)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "max_tokens" and err.value.body["type"] == "invalid_request_error"
    assert "context" in err.value.body["message"]
    # Ollama's num_predict is the same limit, in Ollama's error shape.
    r = httpx.post(
        api + "/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": CONTEXT}},
        timeout=60,
    )
    assert r.status_code == 400 and set(r.json()) == {"error"}
    # Nothing changed: no slot held, and a request that fits is served.
    assert _pending(api) == 0
    ok = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
    assert ok.usage.completion_tokens >= 1


# ---- tokenisation off the event loop -----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_tokenising_a_huge_prompt_does_not_stall_other_requests(api):
    wait_for(lambda: _idle(api), 60, "the node idle")
    prompt = "hello world, this is a test of the tokenizer. " * 80_000  # 3.7 MB: seconds to tokenise
    done = threading.Event()
    took: list[float] = []

    def huge() -> None:
        t = time.monotonic()
        r = httpx.post(
            api + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=240
        )
        took.append(time.monotonic() - t)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # far past the context
        done.set()

    worker = threading.Thread(target=huge)
    worker.start()
    latencies = []
    while not done.is_set():  # /health all the while the prompt is tokenised
        t = time.monotonic()
        assert _get(api, "/health").status_code == 200
        latencies.append(time.monotonic() - t)
    worker.join(timeout=240)
    assert took and took[0] > 0.5, took  # long enough that a blocked loop shows
    # On the event loop, one /health would wait for the whole tokenisation.
    assert max(latencies) < took[0] / 2, (max(latencies), took[0])


# ---- Ollama's ways -----------------------------------------------------------------------------------------


def _curl_d(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST as Ollama's documentation does: `curl URL -d '{...}'` (form-encoded, by curl's default)."""
    data = json.dumps(body)
    if shutil.which("curl"):
        out = subprocess.run(
            ["curl", "-sS", "-w", "\n%{http_code}", url, "-d", data],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        text, code = out.rsplit("\n", 1)
        return int(code), json.loads(text)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(url, content=data, headers=form, timeout=120)
    return r.status_code, r.json()


@pytest.mark.timeout(300)
def test_ollama_accepts_curl_d_bodies_without_a_json_content_type(api):
    body = {"model": MODEL, "prompt": "Why is the sky blue?", "stream": False, "options": {"num_predict": 4}}
    status, answer = _curl_d(api + "/api/generate", body)
    assert status == 200, answer
    assert answer["done"] and answer["eval_count"] >= 1 and isinstance(answer["response"], str)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    status, answer = _curl_d(api + "/api/chat", {**chat, "options": {"num_predict": 2}})
    assert status == 200 and answer["message"]["role"] == "assistant", answer
    plain = httpx.post(api + "/api/show", content=json.dumps({"model": MODEL}), timeout=60)  # no Content-Type
    assert plain.status_code == 200 and plain.json()["details"]["family"]
    # A body that is not JSON is still a 400 in Ollama's shape.
    bad = httpx.post(
        api + "/api/chat", content=b"model=x", headers={"Content-Type": "text/plain"}, timeout=30
    )
    assert bad.status_code == 400 and set(bad.json()) == {"error"}


@pytest.mark.timeout(300)
def test_ollama_refuses_web_pages_of_other_origins(api):
    body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}
    wait_for(lambda: _idle(api), 60, "the node idle")
    before = _cancelled(api)
    for origin in ("http://evil.example", "null", "https://127.0.0.1.evil.example"):
        form = {"Origin": origin, "Content-Type": "application/x-www-form-urlencoded"}
        r = httpx.post(api + "/api/generate", content=json.dumps(body), headers=form, timeout=30)
        assert r.status_code == 403, (origin, r.text)
        assert set(r.json()) == {"error"} and "origin" in r.json()["error"]
        assert httpx.get(api + "/api/tags", headers={"Origin": origin}, timeout=30).status_code == 403
    assert _pending(api) == 0 and _cancelled(api) == before  # refused before anything ran
    # Pages of this server and of localhost are welcome.
    own = f"http://{urlsplit(api).netloc}"
    for origin in (own, "http://localhost:3000"):
        r = httpx.post(api + "/api/generate", json=body, headers={"Origin": origin}, timeout=120)
        assert r.status_code == 200, (origin, r.text)


@pytest.mark.timeout(300)
def test_ollama_name_latest_and_show_by_name(api):
    client = ollama.Client(host=api, timeout=120)
    opts = {"temperature": 0, "num_predict": 3}
    r = client.chat(model=f"{MODEL}:latest", messages=[{"role": "user", "content": "Hi"}], options=opts)
    assert r.done and r.eval_count >= 1
    g = client.generate(model=f"{MODEL}:latest", prompt="Hi", options=opts)
    assert g.done and g.eval_count >= 1
    shown = client.show(f"{MODEL}:latest")
    assert shown.modelinfo["llama.context_length"] == CONTEXT
    by_name = httpx.post(api + "/api/show", json={"name": MODEL}, timeout=60)
    assert by_name.status_code == 200 and by_name.json()["model_info"]["llama.context_length"] == CONTEXT
    missing = httpx.post(api + "/api/show", json={}, timeout=60)
    assert missing.status_code == 400 and set(missing.json()) == {"error"}
    other = httpx.post(api + "/api/show", json={"name": "nope:latest"}, timeout=60)
    assert other.status_code == 404
    assert len(_state(api)["instances"]) == 1  # :latest named the placed model, it placed nothing new
