"""Structured output end to end: response_format through the official `openai` client against a real
3-node cluster serving the default model (k1 serves HTTP and holds no stage; the stages are on k2 and k3),
streamed and whole, on chat and completions; n choices; logit_bias; tool calls through the official
`openai`, `anthropic` and `ollama` clients (required, named and auto, whole and streamed, a tool result in
a later turn) and Ollama's `format`; and a constrained stream that survives a SIGKILL of its sampling
stage's node (the last test: it changes the cluster)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from conftest import api_state, place_and_wait_ready, serving_cluster
from pydantic import BaseModel, Field

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
SHORT = {"type": "string", "maxLength": 12}
SCHEMAS.update(
    {
        "enum": {
            "type": "object",
            "properties": {"mood": {"enum": ["happy", "sad", "neutral"]}},
            "required": ["mood"],
            "additionalProperties": False,
        },
        "bounded_numbers": {
            "type": "object",
            "properties": {
                "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["celsius", "humidity"],
            "additionalProperties": False,
        },
        "optional_fields": {
            "type": "object",
            "properties": {"title": SHORT, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
            "required": ["title"],
            "additionalProperties": False,
        },
        "array_of_numbers": {
            "type": "object",
            "properties": {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 10},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            "required": ["scores"],
            "additionalProperties": False,
        },
        "deeply_nested": {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["c"],
                            "additionalProperties": False,
                        }
                    },
                    "required": ["b"],
                    "additionalProperties": False,
                }
            },
            "required": ["a"],
            "additionalProperties": False,
        },
        "booleans": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "done": {"type": "boolean"}},
            "required": ["ok", "done"],
            "additionalProperties": False,
        },
        "pattern": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        "any_of_objects": {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "circle"},
                                "radius": {"type": "integer", "minimum": 1, "maximum": 99},
                            },
                            "required": ["kind", "radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "square"},
                                "side": {"type": "integer", "minimum": 1, "maximum": 99},
                            },
                            "required": ["kind", "side"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
        "nullable": {
            "type": "object",
            "properties": {
                "note": {"anyOf": [SHORT, {"type": "null"}]},
                "count": {"type": "integer", "minimum": 0, "maximum": 50},
            },
            "required": ["note", "count"],
            "additionalProperties": False,
        },
        "array_of_arrays": {
            "type": "object",
            "properties": {
                "grid": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["grid"],
            "additionalProperties": False,
        },
        "top_level_array": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
        "const_and_enum": {
            "type": "object",
            "properties": {"version": {"const": 1}, "level": {"enum": [1, 2, 3]}},
            "required": ["version", "level"],
            "additionalProperties": False,
        },
        "exclusive_bounds": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                "x": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["n"],
            "additionalProperties": False,
        },
        "product": {
            "type": "object",
            "properties": {
                "name": SHORT,
                "price": {"type": "integer", "minimum": 0, "maximum": 1000},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                "in_stock": {"type": "boolean"},
            },
            "required": ["name", "price", "in_stock"],
            "additionalProperties": False,
        },
    }
)
SAMPLED = [
    "person",
    "nested",
    "array_of_enums",
    "any_of",
    "array_of_objects",
    "refs",
]  # also at temperature 1
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
    if name not in SAMPLED:
        return
    sampled = _chat(oai, QUESTION, temperature=1.0, seed=7, response_format=_fmt(name, schema))
    content = sampled.choices[0].message.content
    assert sampled.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), schema)


@pytest.mark.timeout(300)
def test_json_object_and_completions_with_a_schema(oai):
    # A question the default model answers briefly under any rounding of its activations ("... about a
    # cat." lists a litter until max_tokens under the GGUF kernel's int8 rounding).
    question = "Give me a JSON object with a cat's name and age."
    obj = _chat(oai, question, temperature=0, response_format={"type": "json_object"})
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

    before = _chat(oai, "Name the capital of France.", temperature=0, max_tokens=24)
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
    during = _chat(oai, "Name the capital of France.", temperature=0, max_tokens=24)
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
    free = _chat(oai, "Name the capital of France.", temperature=0, max_tokens=8)
    first = tokenizer.encode(free.choices[0].message.content, add_special_tokens=False)[0]
    banned = _chat(oai, "Name the capital of France.", temperature=0, max_tokens=8, logit_bias={first: -100})
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


# ---- tools ---------------------------------------------------------------------------------------------

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The current time in a time zone.",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 20}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
FUNCTIONS = {f["name"]: f for f in (WEATHER, TIME)}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
ASK = "What is the weather in Paris right now?"


def _valid_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, once its id and type are right and its arguments validate."""
    out = []
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, FUNCTIONS[c.function.name]["parameters"])
        out.append((c.function.name, args))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_openai_tool_calls_parse_and_validate_whole_and_streamed(oai, choice):
    kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False, "temperature": 0}
    whole = _chat(oai, ASK, **kw)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = _valid_calls(c.message.tool_calls)
    assert len(calls) == 1
    if isinstance(choice, dict):
        assert calls[0][0] == "get_time"

    # The stream helper accumulates the tool_calls deltas (it raises on a shape it cannot merge).
    with oai.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=160, **kw
    ) as stream:
        deltas = [
            e for e in stream if e.type == "chunk" and e.chunk.choices and e.chunk.choices[0].delta.tool_calls
        ]
        final = stream.get_final_completion()
    assert _valid_calls(final.choices[0].message.tool_calls) == calls
    assert final.choices[0].finish_reason == "tool_calls"
    first = deltas[0].chunk.choices[0].delta.tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == calls[0][0] and first.function.arguments == ""
    later = [d.chunk.choices[0].delta.tool_calls[0] for d in deltas[1:]]
    assert len(later) >= 2 and all(t.index == 0 and t.id is None and t.function.name is None for t in later)

    # Sampled: still one valid call. (With parallel calls allowed, the default model keeps calling until
    # max_tokens; the grammar of several calls is tested in test_tools.)
    sampled = _chat(oai, ASK, **{**kw, "temperature": 1.0}, seed=5)
    assert sampled.choices[0].finish_reason == "tool_calls", sampled.choices[0].message.content
    assert len(_valid_calls(sampled.choices[0].message.tool_calls)) == 1


def _weather_call(city: str, call_id: str = "call_1") -> dict[str, Any]:
    args = json.dumps({"city": city, "unit": "celsius"})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}


# An earlier call in the conversation: the default model, which knows no tools, then calls under auto.
PRIMED = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [_weather_call("Rome")]},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.mark.timeout(400)
def test_openai_auto_none_and_a_tool_result_in_a_later_turn(oai, tokenizer):
    """none keeps the tools out of the prompt; auto answers text or valid calls, whole and streamed; a
    conversation carrying the assistant's call and the tool's result puts both in the prompt."""
    plain = _chat(oai, ASK, temperature=0, max_tokens=24)
    none = _chat(oai, ASK, temperature=0, max_tokens=24, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    text = _chat(oai, ASK, temperature=0, tools=TOOLS)  # this question: the model answers in text
    assert text.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert text.choices[0].finish_reason == "stop" and text.choices[0].message.tool_calls is None
    assert not text.choices[0].message.content.startswith("<tool_call>")

    kw = {"model": MODEL, "messages": PRIMED, "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    called = oai.chat.completions.create(**kw)
    assert called.choices[0].finish_reason == "tool_calls", called.choices[0].message.content
    calls = _valid_calls(called.choices[0].message.tool_calls)
    with oai.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert _valid_calls(final.choices[0].message.tool_calls) == calls

    def answer(result: str) -> tuple[str, int]:
        messages = [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [_weather_call("Paris", "call_abc")]},
            {"role": "tool", "tool_call_id": "call_abc", "content": result},
        ]
        kw = {"temperature": 0, "max_tokens": 40, "tools": TOOLS, "tool_choice": "none"}
        r = oai.chat.completions.create(model=MODEL, messages=messages, **kw)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
        return r.choices[0].message.content, r.usage.prompt_tokens

    results = ['{"sky": "sunny", "celsius": 31}', '{"sky": "heavy snow and wind", "celsius": -12}']
    (_, n_sunny), (_, n_snowy) = answer(results[0]), answer(results[1])
    assert n_sunny > none.usage.prompt_tokens + 20  # the call and its result
    sizes = [len(tokenizer.encode(r, add_special_tokens=False)) for r in results]
    assert n_snowy - n_sunny == sizes[1] - sizes[0]  # the result itself, token for token


@pytest.mark.timeout(400)
def test_anthropic_tool_use_whole_streamed_and_a_tool_result(api, tokenizer):
    client = anthropic.Anthropic(base_url=api, api_key="unused", max_retries=0, timeout=240)
    tools = [
        {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
        for f in (WEATHER, TIME)
    ]
    messages = [{"role": "user", "content": ASK}]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 160, "tools": tools, "extra_body": {"temperature": 0}}
    one = {"disable_parallel_tool_use": True}
    for choice in ({"type": "any", **one}, {"type": "tool", "name": "get_weather", **one}):
        whole = client.messages.create(messages=messages, tool_choice=choice, **kw)
        assert whole.stop_reason == "tool_use"
        uses = [b for b in whole.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, FUNCTIONS[uses[0].name]["parameters"])
        if choice["type"] == "tool":
            assert uses[0].name == "get_weather"
        with client.messages.stream(messages=messages, tool_choice=choice, **kw) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert "input_json" in kinds and final.stop_reason == "tool_use"
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in streamed] == [(uses[0].name, uses[0].input)]

    def after(result: str) -> int:
        turns = [
            *messages,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "unit": "celsius"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
            },
        ]
        r = client.messages.create(messages=turns, tool_choice={"type": "none"}, **{**kw, "max_tokens": 40})
        assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
        assert r.content[0].text
        return r.usage.input_tokens

    results = ["sunny, 31 degrees", "heavy snow and wind, -12 degrees"]
    sizes = [len(tokenizer.encode(r, add_special_tokens=False)) for r in results]
    assert after(results[1]) - after(results[0]) == sizes[1] - sizes[0]  # the result is in the prompt


@pytest.mark.timeout(400)
def test_ollama_format_and_tools(api):
    client = ollama.Client(host=api, timeout=240)
    schema = SCHEMAS["person"]
    msgs = [{"role": "user", "content": QUESTION}]
    opts = {"temperature": 0, "num_predict": 120}
    whole = client.chat(model=MODEL, messages=msgs, format=schema, options=opts)
    jsonschema.validate(json.loads(whole.message.content), schema)
    parts = [
        c.message.content
        for c in client.chat(model=MODEL, messages=msgs, format=schema, options=opts, stream=True)
    ]
    assert "".join(parts) == whole.message.content
    generated = client.generate(model=MODEL, prompt="A cat, as JSON:", format="json", options=opts)
    assert isinstance(json.loads(generated.response), dict)
    streamed = "".join(
        c.response
        for c in client.generate(
            model=MODEL, prompt="A cat, as JSON:", format="json", options=opts, stream=True
        )
    )
    assert streamed == generated.response

    # No tool_choice in Ollama: the model decides. An earlier call makes the default model call.
    ask = [
        PRIMED[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}}
            ],
        },
        PRIMED[2],
    ]
    called = client.chat(model=MODEL, messages=ask, tools=TOOLS, options=opts)
    calls = called.message.tool_calls or []
    assert calls, called.message.content
    for c in calls:
        jsonschema.validate(dict(c.function.arguments), FUNCTIONS[c.function.name]["parameters"])
    stream_calls = [
        tc
        for c in client.chat(model=MODEL, messages=ask, tools=TOOLS, options=opts, stream=True)
        for tc in c.message.tool_calls or []
    ]
    assert [(c.function.name, dict(c.function.arguments)) for c in stream_calls] == [
        (c.function.name, dict(c.function.arguments)) for c in calls
    ]
    turns = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": calls[0].function.name, "arguments": dict(calls[0].function.arguments)}}
            ],
        },
        {"role": "tool", "content": "sunny, 31 degrees", "tool_name": calls[0].function.name},
    ]
    follow = client.chat(model=MODEL, messages=turns, options={**opts, "num_predict": 40})
    assert follow.message.content


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools",
        ),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"functions": [WEATHER]}, "functions"),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            **WEATHER,
                            "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}},
                        },
                    }
                ]
            },
            "tools",
        ),
    ],
)
def test_bad_tools_get_a_400_naming_the_parameter(api, path, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    r = httpx.post(api + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.timeout(120)
def test_bad_tools_on_anthropic_and_ollama_get_their_own_400s(api):
    msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    for extra in (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"tools": [{"name": "f"}]},
        {"tool_choice": {"type": "any"}},
        {
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
    ):
        r = httpx.post(api + "/v1/messages", json={**msg, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
    for path, extra in (
        ("/api/chat", {"format": "yaml"}),
        ("/api/generate", {"format": {"type": "strin"}, "prompt": "x"}),
    ):
        r = httpx.post(api + path, json={**msg, "stream": False, **extra}, timeout=60)
        assert r.status_code == 400 and "format" in r.json()["error"], r.text


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: Literal["FR", "DE", "UK", "US"]


class Person(BaseModel):  # as instructor and the OpenAI SDK's users send it: no additionalProperties
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    home: Address
    nickname: str | None = Field(None, max_length=12)


READ = "Ann Lee is 34 and lives in Paris, France. Extract her details."


def _only_named_keys(args: dict[str, Any]) -> None:
    person = Person.model_validate(args)
    assert set(args) <= set(Person.model_fields) and set(args["home"]) <= set(Address.model_fields), args
    assert person.home.country in ("FR", "DE", "UK", "US")


@pytest.mark.timeout(300)
def test_a_pydantic_model_without_additional_properties_finishes_as_a_tool_call_and_as_a_format(oai):
    """Objects closed by default: the schema names its keys and nothing else, so the default model writes
    them and stops (open, it adds keys until max_tokens), and a named function is called once."""
    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema), schema
    tool = {"type": "function", "function": {"name": "Person", "parameters": schema}}
    named = {"type": "function", "function": {"name": "Person"}}
    called = _chat(oai, READ, tools=[tool], tool_choice=named, temperature=0, max_tokens=200)
    c = called.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert len(c.message.tool_calls) == 1
    _only_named_keys(json.loads(c.message.tool_calls[0].function.arguments))

    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}}
    answered = _chat(oai, READ, response_format=fmt, temperature=0, max_tokens=200)
    assert answered.choices[0].finish_reason == "stop", answered.choices[0].message.content
    _only_named_keys(json.loads(answered.choices[0].message.content))


@pytest.mark.timeout(300)
def test_a_schema_that_allows_other_keys_still_gets_them(oai):
    """patternProperties and additionalProperties are the schema's own say: with at least one key more
    than it names required (minProperties), the output holds one, of the form the schema gives."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    counts = {"type": "object", "properties": {}, "patternProperties": {"^[a-z]{1,8}$": digit}}
    counts |= {"additionalProperties": False, "minProperties": 1, "maxProperties": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "counts", "schema": counts}}
    answered = _chat(oai, "Count the fruit: two apples, one pear.", response_format=fmt, temperature=0)
    assert answered.choices[0].finish_reason == "stop"
    out = json.loads(answered.choices[0].message.content)
    assert 1 <= len(out) <= 2 and all(0 <= v <= 9 for v in out.values()), out

    city = {"type": "string", "maxLength": 12}
    params = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    params |= {"additionalProperties": digit, "minProperties": 2, "maxProperties": 2}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    called = _chat(oai, ASK, tools=[tool], tool_choice="required", temperature=0, parallel_tool_calls=False)
    c = called.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert len(args) == 2 and "city" in args, args


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
