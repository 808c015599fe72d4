"""The HTTP APIs against a real 2-node cluster serving the default model, through the official clients.

One cluster serves the whole module: node a1 is open, node a2 requires an API key and lets only a few
requests through at once (the overload tests). Every test leaves the instance as it found it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from conftest import serving_cluster, wait_for

from shardline.testing.cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
KEY = "sk-test-key"
QUESTION = "Name the capital of France."
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    extra = {"a2": ["--api-key", KEY, "--max-pending", "3", "--cors-origin", ORIGIN]}
    with serving_cluster(tmp_path_factory.mktemp("api"), ["a1", "a2"], model_dir, extra) as c:
        client = c.client("a1")
        client.wait(lambda v: sum(n.alive for n in v.nodes) == 2, 60, "2 nodes")
        wait_for(lambda: _get(c.nodes["a1"].api, "/health").status_code == 200, 30, "a1's API")
        yield c


def _get(api: str, path: str, **kw: Any) -> httpx.Response:
    try:
        return httpx.get(api + path, timeout=30, **kw)
    except httpx.TransportError:
        return httpx.Response(599)


@pytest.fixture(scope="module")
def api(cluster) -> str:
    """a1's API, with the model placed by the first request naming it (auto-place)."""
    url = cluster.nodes["a1"].api
    assert _get(url, "/state").json()["instances"] == []
    first = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=300,
    )
    assert first.status_code == 200, first.text
    return url


@pytest.fixture(scope="module")
def oai(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(cluster, api, tokenizer) -> Callable[[str, int], list[int]]:
    """The instance's greedy tokens for a chat question, through the Python API (the reference)."""
    client = cluster.client("a1")
    instance = _get(api, "/state").json()["instances"][0]["instance"]
    client.wait_ready(instance, 60)
    front = client.front(instance)

    def run(question: str, max_tokens: int) -> list[int]:
        ids = _chat_ids(tokenizer, question)
        handle = front.submit(ids, max_tokens=max_tokens, stop_tokens=list(tokenizer.eos_token_ids))
        return handle.tokens(timeout=120)

    return run


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _instance(api: str) -> dict[str, Any]:
    return _get(api, "/state").json()["instances"][0]


# ---- the official clients ----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_auto_placed_instance_spans_both_nodes(api):
    rec = _instance(api)
    assert rec["model"] == MODEL and rec["phase"] == "ready"
    stages = rec["stages"]
    assert {s["node_id"] for s in stages} == {"a1", "a2"}
    assert stages[0]["start"] == 0 and all(a["end"] == b["start"] for a, b in itertools.pairwise(stages))


@pytest.mark.timeout(300)
def test_openai_chat_whole_and_streamed_match_the_engine_and_the_tokenizer(oai, greedy, tokenizer):
    tokens = greedy(QUESTION, 32)
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert "Paris" in expected
    msgs = [{"role": "user", "content": QUESTION}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=32)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == ("stop" if len(tokens) < 32 else "length")
    assert r.usage.prompt_tokens == len(_chat_ids(tokenizer, QUESTION))
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The prefix cache's share of the prompt (test_api_prefix_cache.py checks the figure itself).
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens

    stream = oai.chat.completions.create(
        model=MODEL,
        messages=msgs,
        temperature=0,
        max_completion_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert isinstance(chunks[-1].usage.prompt_tokens_details.cached_tokens, int)


@pytest.mark.timeout(300)
def test_openai_max_tokens_seed_and_logprobs(oai, tokenizer):
    msgs = [{"role": "user", "content": "Tell me a story about a dragon."}]
    r = oai.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=7, logprobs=True, top_logprobs=2
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    content = r.choices[0].logprobs.content
    assert len(content) == 7 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content

    def sampled(seed: int) -> str:
        out = oai.chat.completions.create(
            model=MODEL, messages=msgs, temperature=1.0, seed=seed, max_tokens=16
        )
        return out.choices[0].message.content

    assert sampled(11) == sampled(11)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1  # sampling does sample


@pytest.mark.timeout(300)
def test_openai_completions_with_stop_and_max_tokens(oai, tokenizer):
    whole = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    text = whole.choices[0].text
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    stop = text.strip()[2:5]
    cut = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop, "zzz"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    streamed = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.timeout(300)
def test_stop_string_spanning_two_tokens_is_honoured_and_not_sent(oai, greedy, tokenizer):
    question = "Write a short poem about the sea."
    tokens = greedy(question, 40)
    pieces = [tokenizer.decode([t]) for t in tokens]
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    msgs = [{"role": "user", "content": question}]
    for stream in (False, True):
        r = oai.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=40, stop=stop, stream=stream
        )
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == full[: full.find(stop)] and stop not in text
        assert finish == "stop"


@pytest.mark.timeout(300)
def test_multibyte_characters_stream_exactly_as_the_whole_answer(oai, api):
    body = {"model": MODEL, "prompt": "日本の首都は東京です。大阪は", "max_tokens": 24, "temperature": 0}
    whole = httpx.post(api + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert any(ord(ch) > 0x2FFF for ch in whole), whole  # the answer really holds multi-byte characters
    chunks = []
    with httpx.stream("POST", api + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(chunks) == whole
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.timeout(300)
def test_anthropic_client_streamed_and_whole(api, greedy, tokenizer):
    expected = tokenizer.decode(greedy(QUESTION, 24), skip_special_tokens=True)
    client = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": QUESTION}]
    # The client no longer has sampling arguments; the server still takes them.
    greedy_body = {"temperature": 0}
    m = client.messages.create(model=MODEL, max_tokens=24, messages=msgs, extra_body=greedy_body)
    assert m.content[0].text == expected
    # As Anthropic counts, what the prefix cache held is apart from input_tokens.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(_chat_ids(tokenizer, QUESTION))
    assert m.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=MODEL, max_tokens=24, messages=msgs, extra_body=greedy_body) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == expected and final.usage.output_tokens == m.usage.output_tokens
    cut = client.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=msgs,
        extra_body=greedy_body,
        stop_sequences=["Paris"],
        system="Be brief.",
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    assert "Paris" not in cut.content[0].text


@pytest.mark.timeout(300)
def test_ollama_client_chat_generate_list_show(api, greedy, tokenizer):
    expected = tokenizer.decode(greedy(QUESTION, 24), skip_special_tokens=True)
    client = ollama.Client(host=api, timeout=120)
    opts = {"temperature": 0, "num_predict": 24, "repeat_penalty": 1.0}
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=opts)
    assert r.message.content == expected and r.done and r.eval_count > 0
    parts = list(
        client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=opts, stream=True)
    )
    assert "".join(p.message.content for p in parts) == expected and parts[-1].done
    g = "".join(p.response for p in client.generate(model=MODEL, prompt=QUESTION, options=opts, stream=True))
    assert g == expected
    assert [m.model for m in client.list().models] == [MODEL]
    shown = client.show(MODEL)
    assert shown.modelinfo["llama.context_length"] == 8192
    version = httpx.get(api + "/api/version", timeout=10).json()["version"]
    assert version


# ---- streaming, cancellation, overload ---------------------------------------------------------------------


def _three_streams(oai) -> dict[str, dict[int, float]]:
    """Three streaming chats started at once, each left (the request cancelled) once all three have sent text:
    when each was called and sent its first text, and when each that ended by itself ended."""
    called: dict[int, float] = {}
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}
    all_going = threading.Event()
    lock = threading.Lock()
    start = threading.Barrier(3)

    def one(i: int) -> None:
        start.wait(timeout=30)
        called[i] = time.monotonic()
        s = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 400}."}],
            temperature=0,
            max_tokens=LONG_STREAM,
            stream=True,
            extra_body={"ignore_eos": True},  # none ends early by itself: each lasts LONG_STREAM steps
        )
        with s:
            for c in s:
                if c.choices and c.choices[0].delta.content and i not in firsts:
                    with lock:
                        firsts[i] = time.monotonic()
                        if len(firsts) == 3:
                            all_going.set()
                if all_going.is_set():
                    return  # leaving closes the stream: the request is cancelled, the test goes on
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    assert not any(t.is_alive() for t in threads)
    return {"called": called, "first": firsts, "end": ends}


# Long enough that a stream outlasts any skew between three requests started at once (their first texts came
# up to 1.2 s apart on a busy machine, while a 24-token answer, or one the model ended after 15, lasted 1-1.5
# s: the flake this test had), and short enough to end in a bounded time where requests do not interleave.
LONG_STREAM = 1000


@pytest.mark.timeout(600)
def test_concurrent_requests_run_interleaved(oai, api):
    wait_for(lambda: _instance(api)["live"]["leader_requests"] == 0, 30, "earlier requests to finish")
    timeline = _three_streams(oai)
    # Every stream sent text before any ended by itself (a schedule that runs requests one after another
    # ends the first before the next starts).
    assert len(timeline["first"]) == 3, timeline
    assert all(end > max(timeline["first"].values()) for end in timeline["end"].values()), timeline
    wait_for(lambda: _instance(api)["live"]["leader_requests"] == 0, 30, "the streams left to be cancelled")


@pytest.mark.timeout(300)
def test_client_disconnect_cancels_the_request_in_the_pipeline(api):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", api + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 4:
                break
        held = wait_for(lambda: _instance(api)["live"]["leader_requests"] >= 1, 10, "the leader holding it")
        assert held
    # The connection is closed: within a few steps the leader holds nothing.
    wait_for(lambda: _instance(api)["live"]["leader_requests"] == 0, 15, "the leader dropping it")
    metrics = httpx.get(api + "/metrics", timeout=10).text
    assert 'shardline_requests_total{endpoint="chat",outcome="cancelled"}' in metrics


@pytest.mark.timeout(300)
def test_overload_gets_429_with_retry_after_and_loses_no_accepted_request(cluster, greedy, tokenizer):
    api2 = cluster.nodes["a2"].api
    expected = tokenizer.decode(greedy(QUESTION, 16), skip_special_tokens=True)
    proc = psutil.Process(cluster.nodes["a2"].pid)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16,
            "temperature": 0,
        }
        r = httpx.post(
            api2 + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=240
        )
        with lock:
            results.append(r)

    one()  # warm: the node loads its tokenizer (and the libraries behind it) once
    assert results.pop().status_code == 200
    rss_before = proc.memory_info().rss
    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=280)
    assert len(results) == 12
    refused = [r for r in results if r.status_code == 429]
    served = [r for r in results if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 12, [r.status_code for r in results]
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    for r in served:
        assert r.json()["choices"][0]["message"]["content"] == expected
    assert proc.memory_info().rss - rss_before < 64 << 20  # refused requests hold nothing


# ---- errors, keys, the spec --------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_MSG = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_OLLAMA = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
ERROR_CASES = [
    ("openai", CHAT, b"{not json", 400),
    ("openai", CHAT, {**OK_CHAT, "messages": "hi"}, 400),
    ("openai", CHAT, {**OK_CHAT, "model": "no-such-model"}, 404),
    ("openai", CHAT, {**OK_CHAT, "max_tokens": -3}, 400),
    ("openai", CHAT, {**OK_CHAT, "max_tokens": 10**9}, 400),
    ("openai", CHAT, {**OK_CHAT, "n": 0}, 400),
    ("openai", CHAT, {**OK_CHAT, "n": 129}, 400),
    ("openai", CHAT, {**OK_CHAT, "response_format": {"type": "yaml"}}, 400),
    ("openai", CHAT, {**OK_CHAT, "logit_bias": {"not-a-token": 1}}, 400),
    ("openai", CHAT, {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400),
    ("openai", CHAT, {**OK_CHAT, "tool_choice": "required"}, 400),
    ("openai", "/v1/completions", {"model": MODEL, "prompt": [1] * 9000, "max_tokens": 2}, 400),
    ("anthropic", "/v1/messages", b"[1,", 400),
    ("anthropic", "/v1/messages", {**OK_MSG, "max_tokens": "many"}, 400),
    ("anthropic", "/v1/messages", {**OK_MSG, "model": "nope"}, 404),
    ("anthropic", "/v1/messages", {**OK_MSG, "max_tokens": 0}, 400),
    ("ollama", "/api/chat", b"{", 400),
    ("ollama", "/api/chat", {**OK_OLLAMA, "model": "nope"}, 404),
    ("ollama", "/api/chat", {**OK_OLLAMA, "options": {"temperature": "hot"}}, 400),
    ("ollama", "/api/generate", {"model": MODEL, "prompt": "hi", "format": "yaml", "stream": False}, 400),
    ("anthropic", "/v1/messages", {**OK_MSG, "tool_choice": {"type": "any"}}, 400),
]


def assert_shape(flavor: str, r: httpx.Response) -> None:
    body = r.json()
    if flavor == "openai":
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
        assert body["error"]["message"]
    elif flavor == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    else:
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("flavor", "path", "body", "status"), ERROR_CASES)
def test_bad_requests_get_the_apis_own_error_shape_and_change_nothing(api, flavor, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(api + path, timeout=60, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    assert_shape(flavor, r)
    ok = httpx.post(api + CHAT, json=OK_CHAT, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.timeout(300)
def test_api_key_is_required_where_set(cluster, api):
    api2 = cluster.nodes["a2"].api
    assert httpx.get(api2 + "/health", timeout=10).status_code == 200
    for flavor, path, body in (
        ("openai", CHAT, OK_CHAT),
        ("anthropic", "/v1/messages", OK_MSG),
        ("ollama", "/api/chat", OK_OLLAMA),
    ):
        r = httpx.post(api2 + path, json=body, timeout=30)
        assert r.status_code == 401
        assert_shape(flavor, r)
        wrong = httpx.post(api2 + path, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
    assert httpx.get(api2 + "/state", timeout=10).status_code == 401
    assert httpx.post(api2 + "/instances", json={"model": MODEL}, timeout=10).status_code == 401
    c = openai.OpenAI(base_url=api2 + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = c.chat.completions.create(model=MODEL, messages=OK_CHAT["messages"], max_tokens=2)
    assert r.usage.completion_tokens >= 1
    a = anthropic.Anthropic(base_url=api2, api_key=KEY, max_retries=0, timeout=120)
    assert a.messages.create(model=MODEL, max_tokens=2, messages=OK_MSG["messages"]).usage.output_tokens >= 1
    assert httpx.get(api + "/state", timeout=10).status_code == 200  # a1 has no key


@pytest.mark.timeout(60)
def test_cors_is_off_by_default_and_allows_only_configured_origins(cluster, api):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    off = httpx.options(api + CHAT, headers=preflight, timeout=10)
    assert "access-control-allow-origin" not in off.headers
    api2 = cluster.nodes["a2"].api
    on = httpx.options(api2 + CHAT, headers=preflight, timeout=10)
    assert on.status_code == 200 and on.headers["access-control-allow-origin"] == ORIGIN
    elsewhere = "http://elsewhere.example"
    other = httpx.options(api2 + CHAT, headers={**preflight, "Origin": elsewhere}, timeout=10)
    assert other.headers.get("access-control-allow-origin") != elsewhere


@pytest.mark.timeout(600)
def test_schemathesis_finds_no_5xx_and_every_error_in_its_documented_shape(api):
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    spec = httpx.get(api + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(spec)
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    tried = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path == "/events":
            continue  # an endless stream: /events has its own test
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            check = _fuzz(op, mode == GenerationMode.POSITIVE, api, checks)
            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                continue
            tried += 1
    assert tried >= 20
    ok = httpx.post(api + CHAT, json=OK_CHAT, timeout=120)  # still serving
    assert ok.status_code == 200


def _fuzz(op: Any, positive: bool, api: str, checks: list[Any]) -> Callable[[], None]:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    mode = GenerationMode.POSITIVE if positive else GenerationMode.NEGATIVE

    @settings(
        max_examples=12,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        _cap_generation(case, name_the_model=positive)
        response = case.call(base_url=api, timeout=60)
        case.validate_response(response, checks=checks)

    return check


def _cap_generation(case: Any, name_the_model: bool) -> None:
    """Valid requests name the served model (else all are 404s), and stay short: the test is about shapes,
    not long answers."""
    body = case.body
    if not isinstance(body, dict):
        return
    if name_the_model and "model" in body and case.path != "/instances":
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 4:
            body[key] = 4
    unbounded = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if case.path in ("/v1/chat/completions", "/v1/completions") and unbounded:
        body["max_tokens"] = 4  # absent or null: up to the whole context
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4
    if case.path in ("/api/chat", "/api/generate"):
        opts = body.get("options")
        if opts is None:
            body["options"] = opts = {}
        if isinstance(opts, dict):
            n = opts.get("num_predict")
            if not (isinstance(n, int | float) and not isinstance(n, bool) and 0 < n <= 4):
                opts["num_predict"] = 4  # absent, negative or null: unbounded


# ---- cluster routes and metrics ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_state_preview_place_remove_and_events(api):
    state = _get(api, "/state").json()
    assert {n["node_id"] for n in state["nodes"] if n["alive"]} == {"a1", "a2"}
    assert state["master"] in ("a1", "a2") and state["term"] >= 1
    assert all(n["api"].startswith("http://127.0.0.1:") for n in state["nodes"])
    preview = _get(api, f"/instances/preview?model={MODEL}").json()
    assert preview["fits"] and preview["placement"]["stages"]
    huge = _get(api, f"/instances/preview?model={MODEL}&sequences=4096&reserve_tokens=1000000").json()
    assert not huge["fits"] and any(ch.isdigit() for ch in huge["reason"]), huge  # it says why in numbers
    r = httpx.post(
        api + "/instances", json={"model": MODEL, "sequences": 4096, "reserve_tokens": 1000000}, timeout=60
    )
    assert r.status_code == 409 and r.json()["error"]["message"]
    assert httpx.post(api + "/instances", json={"model": "nope"}, timeout=60).status_code == 404
    assert httpx.delete(api + "/instances/nope", timeout=60).status_code == 404
    assert len(_get(api, "/state").json()["instances"]) == 1  # nothing changed
    with httpx.stream("GET", api + "/events", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: state"
        first = json.loads(next(lines)[len("data: ") :])
        assert first["instances"][0]["model"] == MODEL


@pytest.mark.timeout(300)
def test_metrics_in_prometheus_format(api, oai):
    oai.chat.completions.create(model=MODEL, messages=OK_CHAT["messages"], max_tokens=3)
    text = httpx.get(api + "/metrics", timeout=10).text
    for name in (
        'shardline_requests_total{endpoint="chat",outcome="ok"}',
        "shardline_prompt_tokens_total",
        "shardline_generated_tokens_total",
        "shardline_time_to_first_token_seconds_bucket",
        "shardline_inter_token_latency_seconds_bucket",
        "shardline_queue_depth",
        "shardline_running_requests",
        "shardline_stage_step_seconds_bucket",
        "shardline_cluster_events_total{kind=",  # which kinds depends on what this shared cluster saw
        "shardline_prefix_cache_queries_total{instance=",
        "shardline_prefix_cache_hits_total{instance=",
        "shardline_prefix_cache_blocks{instance=",
    ):
        assert name in text, name
    for name, kind in (
        ("shardline_prefix_cache_queries_total", "counter"),
        ("shardline_prefix_cache_hits_total", "counter"),
        ("shardline_prefix_cache_blocks", "gauge"),
    ):
        assert f"# TYPE {name} {kind}" in text, name
