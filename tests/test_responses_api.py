"""The OpenAI Responses API (POST /v1/responses), through the official `openai` client against a real 1-node
cluster serving the default model: text whole and streamed (the events in order), a function tool round trip,
json_schema output, previous_response_id, store: false, and errors in the API's shape. The store's bounds and
the input items' translation are checked in-process first.

One cluster serves the module; the first request places the model (auto-place).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import serving_cluster, wait_for

from shardline.api.errors import ApiError
from shardline.api.routes.responses_input import conversation_of
from shardline.api.routes.responses_store import ResponseStore
from shardline.testing.cluster import LocalCluster

MODEL = "smollm2-135m-instruct"
QUESTION = "Name the capital of France."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


# ---- in-process: the store, the input items ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(30)
def test_the_store_keeps_the_recently_used_within_its_count_age_and_size():
    clock = Clock()
    store = ResponseStore(max_count=2, ttl_s=10.0, max_chars=10_000, clock=clock)
    for rid in ("a", "b"):
        store.put(rid, {"id": rid}, [{"role": "user", "content": rid}])
    assert store.get("a") is not None  # a is now the most recently used...
    store.put("c", {"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None  # ...b went
    clock.now = 10.0
    assert store.get("a") is None and len(store) == 0  # past the TTL
    store.put("big", {}, [{"role": "user", "content": "x" * 20_000}])  # larger than the whole store
    assert store.get("big") is None
    store.put("d", {}, [{"role": "user", "content": "x" * 6_000}])
    store.put("e", {}, [{"role": "user", "content": "x" * 6_000}])  # the two exceed max_chars: d goes
    assert store.get("d") is None and store.get("e") is not None
    assert store.delete("e") and not store.delete("e")


@pytest.mark.timeout(30)
def test_input_items_become_the_chat_messages_of_the_other_apis():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny in Paris.", "annotations": []}],
        },
    ]
    got = conversation_of(items)
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"] for c in got[2]["tool_calls"]] == [{"city": "Paris"}, {"city": "Lyon"}]
    assert (got[3]["tool_call_id"], got[4]["content"]) == ("c1", "rain")
    assert conversation_of("Hi") == [{"role": "user", "content": "Hi"}]
    for bad in (
        [{"type": "message", "role": "robot", "content": "x"}],
        [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        [{"type": "web_search_call", "id": "ws_1"}],
        [{"type": "function_call_output", "output": "x"}],
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}],
    ):
        with pytest.raises(ApiError) as err:
            conversation_of(bad)
        assert err.value.status == 400 and err.value.param == "input"


# ---- against a node ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir) -> Iterator[LocalCluster]:
    with serving_cluster(tmp_path_factory.mktemp("responses"), ["r1"], model_dir) as c:
        c.client("r1").wait(lambda v: any(n.alive for n in v.nodes), 60, "the node")
        wait_for(lambda: _health(c.nodes["r1"].api) == 200, 30, "r1's API")
        yield c


def _health(api: str) -> int:
    try:
        return httpx.get(api + "/health", timeout=10).status_code
    except httpx.TransportError:
        return 599


@pytest.fixture(scope="module")
def api(cluster) -> str:
    url = cluster.nodes["r1"].api
    first = httpx.post(
        url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}, timeout=300
    )
    assert first.status_code == 200, first.text
    return url


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )


@pytest.mark.timeout(300)
def test_text_whole_is_the_chat_answer_with_the_responses_shape(client):
    r = client.responses.create(
        model=MODEL,
        instructions="Answer in one sentence.",
        input=QUESTION,
        temperature=0,
        max_output_tokens=24,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    messages = [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": QUESTION},
    ]
    chat = _chat(client, messages, 24)
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    cut = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output[0].status == "incomplete"


@pytest.mark.timeout(300)
def test_streamed_events_come_in_order_and_add_up_to_the_whole_answer(client):
    kw: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 16}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    done = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        done,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text  # stored as a whole one is
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events)
    # The client's own stream helper accepts the sequence and assembles the same response.
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == text


@pytest.mark.timeout(300)
def test_a_function_tool_round_trip_by_items_and_by_previous_response_id(client):
    question = "What is the weather in Paris?"
    r = client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=64,
    )
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "c": 21}'}
    followed = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[result],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=24,
    )
    assert followed.output[0].type == "message" and followed.output_text
    # The same conversation sent whole as items: the same prompt, the same answer.
    items = [
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    sent = client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=24
    )
    assert sent.usage.input_tokens == followed.usage.input_tokens and sent.output_text == followed.output_text
    # Streamed, the call comes as its item and pieces of its arguments.
    events = list(
        client.responses.create(
            model=MODEL,
            input=question,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments


@pytest.mark.timeout(300)
def test_json_schema_output_parses_and_the_schema_validates_it(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(
        model=MODEL,
        input="Name the capital of France and its country as JSON.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=48,
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "schema": CITY}}
        )
    assert err.value.body["param"] == "text" and "text.format.name" in err.value.body["message"]


@pytest.mark.timeout(300)
def test_previous_response_id_continues_and_store_false_keeps_nothing(client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", instructions="Be brief.", temperature=0, max_output_tokens=8
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        temperature=0,
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    # The follow-up's prompt holds the first turn and its answer (not its instructions: OpenAI's rule).
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0, max_output_tokens=1)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 4
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    kept_not = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert kept_not.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_not.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=kept_not.id, input="Hi")
    assert err.value.body["code"] == "previous_response_not_found"


BAD = [
    ({"model": "no-such-model", "input": "Hi"}, 404, "model"),
    ({"model": MODEL, "input": 5}, 400, "input"),
    ({"model": MODEL}, 400, "input"),
    ({"model": MODEL, "input": [{"type": "message", "role": "user", "content": 3}]}, 400, "input"),
    ({"model": MODEL, "input": "Hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"model": MODEL, "input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    (
        {"model": MODEL, "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function"}},
        400,
        "tool_choice",
    ),
    (
        {"model": MODEL, "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}},
        400,
        "tool_choice",
    ),
    ({"model": MODEL, "input": "Hi", "background": True}, 400, "background"),
    ({"model": MODEL, "input": "Hi", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": 10**9}, 400, "max_output_tokens"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_get_the_responses_error_shape_and_change_nothing(api, client, body, status, param):
    r = httpx.post(api + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and {"message", "type", "param", "code"} <= set(error)
    assert error["message"] and error["param"] == param
    raised = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(raised) as err:
        client.responses.create(**body)
    assert err.value.body["message"] == error["message"]
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens >= 1
    assert httpx.get(api + "/health", timeout=10).json().get("pending") == 0


@pytest.mark.timeout(300)
def test_a_dropped_stream_cancels_its_request(api):
    body = {"model": MODEL, "input": "Write a very long story.", "max_output_tokens": 1500, "stream": True}
    with httpx.stream("POST", api + "/v1/responses", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if "response.output_text.delta" in line)
        assert httpx.get(api + "/health", timeout=10).json()["pending"] == 1
    wait_for(lambda: httpx.get(api + "/health", timeout=10).json()["pending"] == 0, 30, "the slot freed")
