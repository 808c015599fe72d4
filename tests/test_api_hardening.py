"""The HTTP entrance against hostile callers, over real HTTP to real nodes (in this process, serving no
model): the Host check (DNS rebinding), the body limit for chunked bodies, 500s that say nothing of their
cause, bounded stop sequences, logit_bias, n, tools and schemas on every API (api/limits.py), and /health's
details only for who may see them.

Two nodes serve the module, neither placing anything: `open_node` as a node runs by default (no key, on
loopback), `keyed_node` with an API key and one extra allowed host name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from shardline.api.limits import MAX_CHOICES, MAX_LOGIT_BIAS, MAX_SCHEMA_CHARS, MAX_TOOLS, MAX_TOOLS_CHARS
from shardline.api.middleware.body_limit import MAX_BODY_BYTES
from shardline.api.middleware.hosts import trusted_hosts
from shardline.api.service import ApiSettings
from shardline.api.stops import MAX_STOP_CHARS, MAX_STOPS
from shardline.cli.cluster import api_settings
from shardline.cli.main import build_parser
from shardline.node.daemon import Node, NodeConfig

KEY = "sk-hardening-key"
ALIAS = "proxy.lan"
EVIL = "evil.example"
MODEL = "no-such-model"  # the checks under test come before the model is looked up


def _node(root: Path, name: str, settings: ApiSettings) -> Node:
    config = NodeConfig(
        namespace=f"hardening-{name}",
        data_dir=root / name,
        models_dir=root / "models",
        holds_stages=False,
        compute_score=1.0,
        api=settings,
    )
    return Node(config).start()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    root = tmp_path_factory.mktemp("hardening")
    (root / "models").mkdir()
    started: dict[str, Node] = {}
    try:
        started["open"] = _node(root, "open", ApiSettings(port=0))
        started["keyed"] = _node(root, "keyed", ApiSettings(port=0, api_key=KEY, allowed_hosts=[ALIAS]))
        yield started
    finally:
        for node in started.values():
            node.close()


@pytest.fixture(scope="module")
def open_node(nodes: dict[str, Node]) -> str:
    return nodes["open"].api.url


@pytest.fixture(scope="module")
def keyed_node(nodes: dict[str, Node]) -> str:
    return nodes["keyed"].api.url


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


# ---- the Host check ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_keyless_loopback_node_refuses_requests_addressed_to_a_foreign_host(open_node):
    foreign = {"Host": f"{EVIL}:{_port(open_node)}"}  # what a rebound page's requests carry
    calls = [
        ("POST", "/instances", {"model": MODEL}),
        ("DELETE", "/instances/some-instance", None),
        ("GET", "/state", None),
        ("GET", "/health", None),
        ("GET", "/", None),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/api/generate", {"model": MODEL, "prompt": "x"}),
    ]
    for method, path, body in calls:
        r = httpx.request(method, open_node + path, json=body, headers=foreign, timeout=10)
        assert r.status_code == 403, (path, r.status_code, r.text)
        error = r.json()["error"]
        message = error if isinstance(error, str) else error["message"]  # Ollama's shape, or OpenAI's
        assert EVIL in message and "--allowed-host" in message
    error = httpx.get(open_node + "/state", headers=foreign, timeout=10).json()["error"]
    assert error["type"] == "permission_error" and error["param"] is None and error["code"] is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST", "127.0.0.2"])
def test_loopback_names_and_addresses_get_through_with_any_port(open_node, host):
    for suffix in ("", ":1", f":{_port(open_node)}"):
        r = httpx.get(open_node + "/state", headers={"Host": host + suffix}, timeout=10)
        assert r.status_code == 200, (host + suffix, r.text)


@pytest.mark.timeout(60)
def test_allowed_host_names_get_through_and_turn_the_check_on_even_with_a_key(keyed_node):
    def status(host: str) -> int:
        headers = {"Authorization": f"Bearer {KEY}", "Host": host}
        return httpx.get(keyed_node + "/state", headers=headers, timeout=10).status_code

    assert status(f"{ALIAS}:80") == 200 and status(ALIAS.upper()) == 200 and status("localhost") == 200
    assert status(EVIL) == 403


@pytest.mark.timeout(30)
def test_which_nodes_check_the_host_header():
    assert trusted_hosts("127.0.0.1", None, []) == frozenset()  # loopback names only
    assert trusted_hosts("::1", None, []) == frozenset()
    assert trusted_hosts("localhost", None, ["Proxy.LAN:8080"]) == {"proxy.lan"}
    assert trusted_hosts("127.0.0.1", KEY, []) is None  # a rebound page has no key
    assert trusted_hosts("0.0.0.0", None, []) is None  # open to its network anyway
    assert trusted_hosts("0.0.0.0", KEY, [ALIAS]) == {ALIAS}  # asked for
    assert trusted_hosts("127.0.0.1", None, ["*"]) is None
    args = build_parser().parse_args(["node", "--allowed-host", ALIAS, "--allowed-host", "b.lan"])
    assert api_settings(args).allowed_hosts == [ALIAS, "b.lan"]


# ---- the body limit ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_chunked_body_past_the_limit_is_a_413_and_the_node_still_serves(open_node):
    piece = b"x" * (1 << 20)

    def body() -> Iterator[bytes]:  # a generator: httpx sends it chunked, with no Content-Length
        for _ in range(MAX_BODY_BYTES // len(piece) + 2):
            yield piece

    r = httpx.post(
        open_node + "/v1/chat/completions",
        content=body(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["message"] == f"the request body exceeds {MAX_BODY_BYTES} bytes"
    r = httpx.post(open_node + "/v1/messages", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert httpx.get(open_node + "/v1/models", timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_a_declared_length_past_the_limit_is_still_a_413(open_node):
    r = httpx.post(open_node + "/api/chat", content=b" " * (MAX_BODY_BYTES + 1), timeout=30)
    assert r.request.headers["content-length"] == str(MAX_BODY_BYTES + 1)
    assert r.status_code == 413 and r.json() == {"error": f"the request body exceeds {MAX_BODY_BYTES} bytes"}
    assert httpx.get(open_node + "/api/version", timeout=10).status_code == 200


# ---- internal errors ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_500_says_internal_error_and_a_request_id_that_the_log_has_with_the_traceback(
    nodes, open_node, caplog, monkeypatch
):
    secret = "/srv/secret/path token=abc123"

    def broken() -> list[str]:
        raise RuntimeError(secret)

    monkeypatch.setattr(nodes["open"].api.service, "model_names", broken)
    with caplog.at_level(logging.ERROR, logger="shardline.api"):
        r = httpx.get(open_node + "/v1/models", timeout=10)
        with pytest.raises(openai.InternalServerError) as raised:
            openai.OpenAI(base_url=open_node + "/v1", api_key="-", max_retries=0, timeout=10).models.list()
    assert r.status_code == 500
    assert secret not in r.text and "RuntimeError" not in r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["message"].startswith("internal error")
    rid = r.headers["X-Request-Id"]
    assert rid in error["message"]
    assert secret not in str(raised.value)
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert secret in str(logged[0].exc_info[1])


# ---- stop sequences ----------------------------------------------------------------------------------------

TOO_MANY = [f"s{i}" for i in range(MAX_STOPS + 1)]
TOO_LONG = ["x" * (MAX_STOP_CHARS + 1)]
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stops", [TOO_MANY, TOO_LONG], ids=["too-many", "too-long"])
def test_stop_sequences_are_bounded_on_every_api_with_a_400_naming_the_parameter(open_node, stops):
    oai = openai.OpenAI(base_url=open_node + "/v1", api_key="-", max_retries=0, timeout=10)
    for call in (
        lambda: oai.chat.completions.create(model=MODEL, messages=CHAT, stop=stops),
        lambda: oai.completions.create(model=MODEL, prompt="Hi", stop=stops),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            call()
        assert raised.value.body["param"] == "stop"
    claude = anthropic.Anthropic(base_url=open_node, api_key="-", max_retries=0, timeout=10)
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=4, messages=CHAT, stop_sequences=stops)
    assert "stop_sequences" in bad.value.body["error"]["message"]
    olla = ollama.Client(host=open_node, timeout=10)
    for call in (
        lambda: olla.chat(model=MODEL, messages=CHAT, options={"stop": stops}),
        lambda: olla.generate(model=MODEL, prompt="Hi", options={"stop": stops}),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400 and "options.stop" in refused.value.error


@pytest.mark.timeout(60)
def test_stop_sequences_at_the_bounds_are_accepted(open_node):
    stops = ["x" * MAX_STOP_CHARS] * MAX_STOPS
    body: dict[str, Any] = {"model": MODEL, "messages": CHAT, "stop": stops}
    r = httpx.post(open_node + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # past the stop check


# ---- logit_bias, n, tools and schemas ----------------------------------------------------------------------


def _openai_400(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=10)
    assert r.status_code == 400, r.text
    return r.json()["error"]


CANONICAL_BIAS = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({**CANONICAL_BIAS, str(MAX_LOGIT_BIAS): 1.0}, "at most 300"),
        ({"1": 5.0, "01": -5.0}, "name the same token"),
        ({"01": 5.0}, "canonical"),
        ({"+1": 5.0}, "canonical"),
        ({" 1": 5.0}, "canonical"),
        ({"1_0": 5.0}, "canonical"),
    ],
    ids=["301-tokens", "01-and-1", "leading-zero", "plus", "space", "underscore"],
)
def test_logit_bias_is_bounded_and_canonical_with_a_400_naming_it(open_node, bias, says):
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        error = _openai_400(open_node, path, {**body, "logit_bias": bias})
        assert error["param"] == "logit_bias" and says in error["message"], error


@pytest.mark.timeout(60)
def test_n_is_bounded_with_a_400_naming_it_and_the_largest_settings_pass(open_node):
    error = _openai_400(open_node, "/v1/chat/completions", {"messages": CHAT, "n": MAX_CHOICES + 1})
    assert error["param"] == "n" and str(MAX_CHOICES) in error["message"]
    body = {"model": MODEL, "messages": CHAT, "logit_bias": CANONICAL_BIAS, "n": MAX_CHOICES}
    r = httpx.post(open_node + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # past every bound


def _tool(i: int, description: str = "") -> dict[str, Any]:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    return {"name": f"t{i}", "description": description, "input_schema": schema}


TOO_MANY_TOOLS = [_tool(i) for i in range(MAX_TOOLS + 1)]
TOO_LARGE_TOOLS = [_tool(0, "d" * MAX_TOOLS_CHARS)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tools", [TOO_MANY_TOOLS, TOO_LARGE_TOOLS], ids=["too-many", "too-large"])
def test_tools_are_bounded_on_every_api_with_a_400_naming_them(open_node, tools):
    as_openai = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in tools
    ]
    error = _openai_400(open_node, "/v1/chat/completions", {"messages": CHAT, "tools": as_openai})
    assert error["param"] == "tools"
    body = {"model": MODEL, "max_tokens": 4, "messages": CHAT, "tools": tools}
    r = httpx.post(open_node + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"], r.text
    r = httpx.post(
        open_node + "/api/chat", json={"model": MODEL, "messages": CHAT, "tools": as_openai}, timeout=10
    )
    assert r.status_code == 400 and "tools" in r.json()["error"], r.text


@pytest.mark.timeout(60)
def test_a_schema_past_the_bound_is_a_400_naming_its_parameter(open_node):
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_CHARS // 20)},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    error = _openai_400(open_node, "/v1/chat/completions", {"messages": CHAT, "response_format": fmt})
    assert error["param"] == "response_format"
    r = httpx.post(
        open_node + "/api/chat", json={"model": MODEL, "messages": CHAT, "format": schema}, timeout=10
    )
    assert r.status_code == 400 and "format" in r.json()["error"], r.text


# ---- /health -----------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_health_tells_the_cluster_only_to_callers_with_the_key(keyed_node):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = httpx.get(keyed_node + "/health", headers=headers, timeout=10)
        assert r.status_code == 200 and r.json() == {"ok": True}, r.text
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        detail = httpx.get(keyed_node + "/health", headers=headers, timeout=10).json()
        assert detail["ok"] is True and {"node", "master", "term", "pending"} <= detail.keys()
        assert detail["pending"] == 0


@pytest.mark.timeout(60)
def test_health_on_a_keyless_node_tells_the_cluster_to_callers_on_this_machine(open_node):
    detail = httpx.get(open_node + "/health", timeout=10).json()
    assert {"node", "master", "term", "pending"} <= detail.keys() and detail["pending"] == 0


@pytest.mark.timeout(30)
def test_health_on_a_keyless_node_tells_callers_from_elsewhere_only_the_status():
    from types import SimpleNamespace

    from starlette.requests import Request

    from shardline.api.routes.cluster import may_see_cluster

    def caller(address: str) -> Request:
        scope = {"type": "http", "method": "GET", "path": "/health", "headers": [], "client": (address, 1)}
        return Request(scope)

    keyless: Any = SimpleNamespace(settings=ApiSettings(host="0.0.0.0"))
    assert may_see_cluster(keyless, caller("127.0.0.1")) and may_see_cluster(keyless, caller("::1"))
    assert not may_see_cluster(keyless, caller("192.0.2.7"))


# ---- keep-alive --------------------------------------------------------------------------------------------


def _get_on(sock: Any, host: str) -> bytes:
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, "the node closed the connection instead of answering"
        data += chunk
    return data


@pytest.mark.timeout(60)
def test_an_idle_pooled_connection_outlives_the_clients_pool_expiry(open_node):
    """The client must be the side that closes an idle keep-alive connection: if the node closed it at the
    moment a client reused it, the client would get a reset for a request the node never read."""
    import select
    import socket

    from shardline.api.server import KEEP_ALIVE_S

    httpx_expiry = httpx.Limits().keepalive_expiry or 0.0
    assert 2 * httpx_expiry < KEEP_ALIVE_S
    host = open_node.removeprefix("http://")
    address, port = host.rsplit(":", 1)
    with socket.create_connection((address, int(port)), timeout=10) as sock:
        assert _get_on(sock, host).startswith(b"HTTP/1.1 200")
        # Idle past httpx's expiry: the node must neither close nor send anything.
        readable, _, _ = select.select([sock], [], [], httpx_expiry + 2.0)
        assert not readable, "the node closed an idle connection before the client's pool would"
        assert _get_on(sock, host).startswith(b"HTTP/1.1 200")


# ---- the API key, on every route ---------------------------------------------------------------------------

# Answered without the key: a load balancer's probe carries none, and the dashboard's page and files ask for
# the key themselves (every call they make needs it). Everything else needs the key, new routes included.
PUBLIC = {"/health", "/", "/ui"}


def _calls(nodes: dict[str, Node]) -> list[tuple[str, str]]:
    """(method, path) of every route the node's app serves, path parameters filled in."""
    import re

    from starlette.routing import Mount

    from shardline.api.app import build_app

    routes: list[Any] = build_app(nodes["keyed"].api.service).routes
    try:  # FastAPI 0.165 and later keep included routers lazy: this walks into them
        from fastapi.routing import iter_route_contexts

        routes = list(iter_route_contexts(routes))
    except ImportError:
        pass
    calls = []
    for route in routes:
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        if isinstance(getattr(route, "original_route", route), Mount):
            calls.append(("GET", path + "/index.html"))
            continue
        calls += [(method, path) for method in sorted(getattr(route, "methods", None) or {"GET"})]
    return calls


def _status(method: str, url: str, headers: dict[str, str]) -> tuple[int, Any]:
    """The answer's status, and its body when it is a refusal, without reading a body that may stream for
    ever (/events)."""
    with httpx.stream(method, url, headers=headers, timeout=10) as r:
        refused = r.status_code == 401 and method != "HEAD"
        return r.status_code, json.loads(r.read()) if refused else None


@pytest.mark.timeout(120)
def test_every_route_but_the_public_ones_needs_the_key(nodes, keyed_node):
    from shardline.api.errors import flavor_of

    calls = _calls(nodes)
    # Those the review found untested, so that an empty walk cannot pass.
    named = {("GET", "/metrics"), ("GET", "/events"), ("DELETE", "/instances/x"), ("GET", "/openapi.json")}
    assert named <= set(calls)
    for method, path in calls:
        public = path in PUBLIC or path.startswith("/ui/")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            status, body = _status(method, keyed_node + path, headers)
            if public:
                assert status != 401, (method, path)
                continue
            assert status == 401, (method, path, headers, status)
            if body is None:
                continue  # HEAD: no body
            if flavor_of(path) == "anthropic":
                assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
            elif flavor_of(path) == "ollama":
                assert set(body) == {"error"} and body["error"]
            else:
                assert body["error"]["type"] == "authentication_error", (path, body)
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            assert _status(method, keyed_node + path, headers)[0] != 401, (method, path)


# ---- bodies that are not labelled JSON ---------------------------------------------------------------------

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "/v1/chat/completions": ("openai", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "/v1/completions": ("openai", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
    "/v1/messages": ("anthropic", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "/instances": ("openai", {"model": MODEL}),
    "/api/chat": ("ollama", {"model": MODEL, "messages": CHAT, "stream": False}),
    "/api/generate": ("ollama", {"model": MODEL, "prompt": "x", "stream": False}),
}


def _error_message(flavor: str, r: httpx.Response) -> str:
    body = r.json()
    if flavor == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    if flavor == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        return body["error"]
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_without_a_json_content_type_gets_the_apis_own_error_or_is_read_as_json(
    open_node, path, content_type
):
    flavor, ok = BODIES[path]
    headers = {"Content-Type": content_type} if content_type else {}
    for content in (json.dumps(ok).encode(), b"{not json"):
        r = httpx.post(open_node + path, content=content, headers=headers, timeout=10)
        message = _error_message(flavor, r)
        if flavor == "ollama":  # read as JSON whatever the label, as Ollama does (curl -d)
            assert r.status_code == (404 if content.startswith(b'{"') else 400), r.text
            continue
        # OpenAI's and Anthropic's APIs take JSON only: the error says what to send.
        assert r.status_code == 400, r.text
        assert "Content-Type: application/json" in message and (content_type or "no Content-Type") in message
