"""Structured output end to end: response_format through the official `openai` client against a real
3-node cluster serving the default model (k1 serves HTTP and holds no stage; the stages are on k2 and k3),
streamed and whole, on chat and completions; n choices; logit_bias; and a constrained stream that survives
a SIGKILL of its sampling stage's node (the last test: it changes the cluster)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import api_state, place_and_wait_ready, serving_cluster

from shardline.testing.cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "favourite": {"enum": ["red", "green", "blue", "yellow"]},
        },
        "required": ["colors", "favourite"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "boolean"}]},
            "unit": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        },
        "required": ["answer", "unit"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "title": {"type": "string", "maxLength": 15},
                        "done": {"type": "boolean"},
                    },
                    "required": ["title", "done"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
QUESTION = "Answer in JSON: describe something from everyday life."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("structured")
    with serving_cluster(root, ["k1", "k2", "k3"], model_dir, {"k1": ["--no-worker"]}) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster) -> str:
    api = cluster.nodes["k1"].api
    rec = place_and_wait_ready(api, MODEL, 3, 240)
    assert {s["node_id"] for s in rec["stages"]} == {"k2", "k3"}
    return api


@pytest.fixture(scope="module")
def oai(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=240)


def _fmt(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(oai: openai.OpenAI, question: str, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 160)
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kw)


def _streamed(stream: Any) -> tuple[str, str | None]:
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_constrained_chat_validates_whole_and_streamed(oai, name):
    schema = SCHEMAS[name]
    whole = _chat(oai, QUESTION, temperature=0, response_format=_fmt(name, schema))
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    streamed, finish = _streamed(
        _chat(oai, QUESTION, temperature=0, response_format=_fmt(name, schema), stream=True)
    )
    assert finish == "stop" and streamed == text  # greedy: the same answer either way
    sampled = _chat(oai, QUESTION, temperature=1.0, seed=7, response_format=_fmt(name, schema))
    content = sampled.choices[0].message.content
    assert sampled.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), schema)


@pytest.mark.timeout(300)
def test_json_object_and_completions_with_a_schema(oai):
    obj = _chat(
        oai, "Give me a JSON object about a cat.", temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    prompt = "A person, as JSON: "
    fmt = _fmt("person", PERSON)
    done = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=120, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    stream = oai.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"response_format": fmt},
    )
    parts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(parts) == done.choices[0].text


@pytest.mark.timeout(300)
def test_unconstrained_output_is_unchanged_beside_constrained_requests(oai):
    """The same greedy answer before, and while constrained requests share the batch."""
    import threading

    before = _chat(oai, "What is the capital of France?", temperature=0, max_tokens=24)
    constrained: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda: constrained.append(
                _chat(oai, QUESTION, temperature=0, response_format=_fmt("p", PERSON))
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    during = _chat(oai, "What is the capital of France?", temperature=0, max_tokens=24)
    for t in threads:
        t.join(timeout=200)
    assert during.choices[0].message.content == before.choices[0].message.content
    assert len(constrained) == 2
    for c in constrained:
        jsonschema.validate(json.loads(c.choices[0].message.content), PERSON)


@pytest.mark.timeout(300)
def test_n_choices_equal_separate_requests_with_the_same_seeds(oai):
    kw = {"temperature": 1.0, "max_tokens": 16}
    several = _chat(oai, "Name a fruit.", n=3, seed=11, **kw)
    assert [c.index for c in several.choices] == [0, 1, 2]
    alone = [_chat(oai, "Name a fruit.", seed=11 + i, **kw) for i in range(3)]
    assert [c.message.content for c in several.choices] == [a.choices[0].message.content for a in alone]
    assert several.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert several.usage.prompt_tokens == alone[0].usage.prompt_tokens

    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes: dict[int, str] = {}
    for chunk in _chat(oai, "Name a fruit.", n=3, seed=11, stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert ["".join(texts[i]) for i in range(3)] == [c.message.content for c in several.choices]
    assert set(finishes) == {0, 1, 2}
    constrained = _chat(oai, QUESTION, n=2, temperature=1.0, seed=3, response_format=_fmt("p", PERSON))
    for c in constrained.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


@pytest.mark.timeout(300)
def test_logit_bias_forces_and_bans_tokens(oai, tokenizer):
    free = _chat(oai, "What is the capital of France?", temperature=0, max_tokens=8)
    first = tokenizer.encode(free.choices[0].message.content, add_special_tokens=False)[0]
    banned = _chat(
        oai, "What is the capital of France?", temperature=0, max_tokens=8, logit_bias={first: -100}
    )
    assert tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = _chat(oai, "Hi", temperature=0, max_tokens=4, logit_bias={forced_id: 100})
    assert forced.usage.completion_tokens == 4
    assert forced.choices[0].message.content.count("banana") == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        {"response_format": {"type": "json_object"}, "ignore_eos": True},
        {"logit_bias": {"99999999": 5}},
        {"logit_bias": {"5": 500}},
    ],
)
def test_bad_formats_get_an_openai_400_naming_the_parameter(api, extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    r = httpx.post(api + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    wanted = "ignore_eos" if extra.get("ignore_eos") else next(iter(extra))
    assert error["param"] == wanted and error["type"] == "invalid_request_error", error


@pytest.mark.timeout(400)
def test_constrained_stream_survives_a_sigkill_of_its_sampling_stage(cluster, api, oai):
    """Last: the node of the last stage (where the default model samples) is SIGKILLed mid-stream; the
    rebuilt stage's matcher is rebuilt from the tokens so far, and the stream ends with the fault-free,
    valid JSON."""
    schema = SCHEMAS["array_of_objects"]
    fmt = _fmt("todo", schema)
    question = "List three chores as JSON."
    reference = _chat(oai, question, temperature=0, response_format=fmt)
    expected = reference.choices[0].message.content
    assert reference.usage.completion_tokens >= 12, expected
    rec = next(r for r in api_state(api)["instances"] if r["model"] == MODEL)
    victim = rec["stages"][-1]["node_id"]

    parts, killed, finish = [], False, None
    for chunk in _chat(oai, question, temperature=0, response_format=fmt, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
                if len(parts) == 6 and not killed:
                    cluster.nodes[victim].kill(signal.SIGKILL)
                    killed = True
            finish = choice.finish_reason or finish
    assert killed
    text = "".join(parts)
    assert text == expected and finish == "stop"
    jsonschema.validate(json.loads(text), schema)
    rec = next(r for r in api_state(api)["instances"] if r["instance"] == rec["instance"])
    assert rec["recoveries"] >= 1
