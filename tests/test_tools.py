"""Tool calling's pure parts on the default model's tokenizer: tools and tool_choice parsed (400s naming the
parameter), the generic prompt format, a chat template's own tool format, the grammar of a call (masked
sampling from random logits always ends with calls that validate), and calls read back, whole and
streamed in any split."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from test_constraints import END, _batched, _held, _vocab

from shardline.api.errors import ApiError
from shardline.api.model_text import load_model_text
from shardline.api.response_format import checked
from shardline.api.tools.calls import ArgsPiece, CallEnd, CallStart, CallStream, TextPiece, parse_calls
from shardline.api.tools.prompt import (
    Tool,
    ToolPlan,
    call_text,
    generic_messages,
    openai_plan,
    openai_tools,
    plan_constraint,
    template_takes_tools,
)
from shardline.compute.constraints import Matchers
from shardline.compute.sampling import SamplingParams
from shardline.runner.stage import finish

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -100, "maximum": 100},
                "b": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = openai_tools([WEATHER, ADD])


@pytest.mark.timeout(30)
def test_tools_and_tool_choice_parse_and_bad_ones_name_their_parameter():
    assert [t.name for t in TOOLS] == ["get_weather", "add"]
    assert openai_plan(TOOLS, None, None) == ToolPlan(TOOLS, "auto", None, True)
    assert openai_plan(TOOLS, "required", False) == ToolPlan(TOOLS, "required", None, False)
    named = openai_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert named is not None and [t.name for t in named.allowed] == ["add"]
    assert not openai_plan(TOOLS, "none", None).calling
    assert openai_plan((), None, None) is None
    no_params = openai_tools([{"type": "function", "function": {"name": "now"}}])
    assert no_params[0].parameters == {"type": "object", "properties": {}}
    bad_tools = [
        [{"type": "code_interpreter"}],
        [{"type": "function"}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        [WEATHER, WEATHER],
    ]
    for tools in bad_tools:
        with pytest.raises(ApiError) as err:
            openai_tools(tools)
        assert err.value.status == 400 and err.value.param == "tools"
    for choice in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(ApiError) as err:
            openai_plan(TOOLS, choice, None)
        assert err.value.param == "tool_choice"
    with pytest.raises(ApiError) as err:
        openai_plan((), "required", None)
    assert err.value.param == "tool_choice"
    broken = Tool("f", "", {"type": "object", "properties": {"x": {"type": "strin"}}})
    with pytest.raises(ApiError) as err:
        checked(plan_constraint(ToolPlan((broken,), "required"), None), "tools")
    assert err.value.param == "tools"


@pytest.mark.timeout(30)
def test_generic_format_lists_tools_and_writes_back_calls_and_results():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2 and 3+4?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
        {"role": "tool", "content": "7", "tool_call_id": "call_2"},
    ]
    out = generic_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "<tools>" in system and "<tool_call>" in system
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["get_weather", "add"]
    assert out[2]["content"] == "\n".join([call_text("add", {"a": 1, "b": 2})] * 2)
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
    plain = [{"role": "user", "content": "Hi"}]
    assert generic_messages(plain, ()) == plain  # no tools: the conversation as it was
    assert generic_messages(plain, TOOLS)[0]["role"] == "system"


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.timeout(60)
def test_a_template_with_tool_support_renders_them_its_own_way(model_dir: Path):
    text = load_model_text(model_dir)
    assert not template_takes_tools(text.tokenizer.chat_template)  # the default model: the generic format
    generic = text.tokenizer.decode(text.chat([{"role": "user", "content": "Hi"}], TOOLS))
    assert "# Tools" in generic and '"name": "get_weather"' in generic
    assert template_takes_tools(QWEN_LIKE)
    text.tokenizer._tokenizer.chat_template = QWEN_LIKE
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    own = text.tokenizer.decode(text.chat(messages, TOOLS))
    assert "TOOLS: get_weather add" in own and 'CALL add {"a": 1, "b": 2}' in own
    assert "# Tools" not in own


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "name", "parallel"),
    [("required", None, False), ("required", "add", False), ("required", None, True), ("auto", None, False)],
)
def test_masked_sampling_writes_calls_that_parse_and_validate(model_dir, mode, name, parallel):
    """Random logits under the grammar: every row ends, and its answer is calls of the allowed tools with
    arguments their schemas validate. Under auto, rows that began the wrapper must finish a valid call,
    and rows that began with text (their end token favoured, else random text goes on) stay text."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = _vocab(model_dir)
    plan = ToolPlan(TOOLS, mode, name, parallel)  # type: ignore[arg-type]
    c = checked(plan_constraint(plan, None), "tools")
    assert c is not None
    c = c.model_copy(update={"end": END})
    m = Matchers(model_dir / "tokenizer.json")
    rows = 4
    bias = ((END[0], 6.0),) if mode == "auto" else ()
    settings = [SamplingParams(temperature=1.0, seed=i, constraint=c, logit_bias=bias) for i in range(rows)]
    starts = ["<tool_call>\n{", "<tool_call>", "Sure", "<b>"] if mode == "auto" else [""] * rows
    outputs = [hf.encode(p, add_special_tokens=False).ids for p in starts]
    ended = [False] * rows
    for step in range(400):
        live = [i for i in range(rows) if not ended[i]]
        if not live:
            break
        alive = [(f"r{i}", settings[i], outputs[i]) for i in live]
        batch = _batched(alive, step)
        y = mx.random.normal((len(live), vocab), key=mx.random.key(step)) * 3
        result, _ = finish(batch, y, _held(alive), m)
        for i, r in zip(live, result.rows, strict=True):
            if r.token in END:
                ended[i] = True
            else:
                outputs[i].append(r.token)
    m.close()
    assert all(ended), [hf.decode(o) for o in outputs]
    allowed = {t.name: t for t in plan.allowed}
    for out in outputs:
        answer = hf.decode(out)
        calls = parse_calls(answer, plan.allowed)
        if mode == "auto" and not answer.startswith("<tool_call>"):
            assert calls is None
            continue
        assert calls, answer
        assert answer.startswith(starts[outputs.index(out)])
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(call.arguments, allowed[call.name].parameters)


def _events_of(text: str, may_be_text: bool, seed: int) -> list[Any]:
    rng = random.Random(seed)
    stream, events, at = CallStream(may_be_text), [], 0
    while at < len(text):
        n = rng.randint(1, 7)
        events += stream.feed(text[at : at + n])
        at += n
    return events + stream.end()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_calls_stream_in_any_split_and_join_to_the_whole(seed):
    calls = [("get_weather", {"city": 'Pa"ris\\', "unit": "celsius"}), ("add", {"a": 1, "b": -2})]
    answer = "\n".join(call_text(n, a) for n, a in calls)
    whole = parse_calls(answer, TOOLS)
    assert [(c.name, c.arguments) for c in whole or []] == calls
    for may_be_text in (True, False):
        events = _events_of(answer, may_be_text, seed)
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "add")]
        assert not any(isinstance(e, TextPiece) for e in events)
        for i, (_, args) in enumerate(calls):
            pieces = [e.text for e in events if isinstance(e, ArgsPiece) and e.index == i]
            assert json.loads("".join(pieces)) == args
            # a call's start comes before its arguments, its end after them
            kinds = [type(e) for e in events if getattr(e, "index", None) == i]
            assert kinds[0] is CallStart and kinds[-1] is CallEnd
        ends = [e for e in events if isinstance(e, CallEnd)]
        assert [json.loads(e.arguments) for e in ends] == [a for _, a in calls]
    text = "<tool>s are <b>handy</b>: <tool_call> is how I call them."
    events = _events_of(text, True, seed)
    assert events and all(isinstance(e, TextPiece) for e in events)
    assert "".join(e.text for e in events) == text
    assert _events_of("<tool_ca", True, seed) == [TextPiece("<tool_ca")]  # cut short: text


@pytest.mark.timeout(30)
def test_whole_answers_that_are_not_valid_calls_are_not_calls():
    good = call_text("add", {"a": 1, "b": 2})
    assert parse_calls(good, TOOLS) is not None
    for answer in (
        "The answer is 3.",
        good + " and some text",
        good[:-3],  # cut by max_tokens
        call_text("sub", {"a": 1, "b": 2}),  # not a tool
        call_text("add", {"a": 1}),  # b is required
        call_text("add", {"a": 1, "b": 1000}),  # above its maximum
        "<tool_call>\n{not json}\n</tool_call>",
        "",
    ):
        assert parse_calls(answer, TOOLS) is None, answer
