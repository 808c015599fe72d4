"""Tools in the prompt and the grammar of a call: pure, shared by the OpenAI, Anthropic and Ollama routes.

The call format is the `<tool_call>` wrapper that Hermes-style and Qwen models are trained on, one call a
block, blocks separated by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template takes `tools` gets them through its template; any other (the default model)
gets the generic format: a system-prompt section listing the tools' JSON schemas and this wrapper, earlier
calls written back in it and tool results as `<tool_response>` blocks in a user turn.

Routes translate their API's tools and messages into the neutral form here: `Tool`, `ToolPlan` and chat
messages in the shape Hugging Face templates take (assistant `tool_calls` with `arguments` an object, and
`{"role": "tool", "content", "tool_call_id"}`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from shardline.api.errors import bad_request
from shardline.compute.constraints import JSON_OPTIONS, Constraint, Objects, closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it also keeps names out of the grammar's way
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["auto", "required", "none"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolPlan:
    """What the answer may be: text or calls (auto), calls only (required; `name` forces one function),
    or text only (none: the tools stay out of the prompt)."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def calling(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def allowed(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.name is None or t.name == self.name)


# ---- the OpenAI shape (Ollama uses it too) -----------------------------------------------------------------


def tool_of(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    """A tool, checked: a valid name, a string description, an object schema of its parameters."""
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"a tool's name must match {NAME.pattern}, not {name!r}", param)
    if description is not None and not isinstance(description, str):
        raise bad_request(f"tool {name!r}: description must be a string", param)
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad_request(f"tool {name!r}: parameters must be a JSON schema of an object", param)
    return Tool(name, description or "", parameters)


def openai_tools(tools: list[dict[str, Any]] | None, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools`: `{"type": "function", "function": {name, description, parameters}}` each."""
    out: list[Tool] = []
    for spec in tools or []:
        if not isinstance(spec, dict) or spec.get("type", "function") != "function":
            kind = spec.get("type") if isinstance(spec, dict) else spec
            raise bad_request(f"only function tools are supported, not {kind!r}", param)
        fn = spec.get("function")
        if not isinstance(fn, dict):
            raise bad_request("a function tool needs a function object", param)
        out.append(tool_of(fn.get("name"), fn.get("description"), fn.get("parameters"), param))
    if len({t.name for t in out}) != len(out):
        raise bad_request("tool names must be unique", param)
    return tuple(out)


def openai_plan(tools: tuple[Tool, ...], choice: Any, parallel: bool | None) -> ToolPlan | None:
    """OpenAI's tool_choice (`auto`, `none`, `required` or a named function) over the tools; None when the
    request has no tools."""
    parallel = True if parallel is None else parallel
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                '{"name": ...}}',
                "tool_choice",
            )
        return named(tools, name, parallel, "tool_choice")
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice {choice!r} is not one of auto, none, required", "tool_choice")
    if not tools:
        if choice == "required":
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return None
    return ToolPlan(tools, choice, None, parallel)


def named(tools: tuple[Tool, ...], name: str, parallel: bool, param: str) -> ToolPlan:
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param)
    return ToolPlan(tools, "required", name, parallel)


# ---- the grammar of an answer ------------------------------------------------------------------------------


def call_schema(tool: Tool, objects: Objects = "closed") -> dict[str, Any]:
    """One call's JSON: the name first, then the arguments its schema validates.

    The arguments' schema is a resource of its own (an `$id`), so that its references (`#/$defs/...`,
    as pydantic writes nested models) resolve in it, not in this wrapper."""
    arguments = closed_objects(tool.parameters) if objects == "closed" else tool.parameters
    if "$id" not in arguments:
        arguments = {"$id": f"urn:shardline:tool:{tool.name}", **arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_rule(schema: Any) -> str:
    # The call's JSON is written as response_format's is: compact, one separator each.
    body = dict(schema) if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**body, 'x-guidance': JSON_OPTIONS})}"


def plan_constraint(
    plan: ToolPlan | None, text: Constraint | None, objects: Objects = "closed"
) -> Constraint | None:
    """The answer's grammar (a Lark grammar for llguidance): under `required` one call (or several when
    parallel and no function is named) of the allowed tools, each valid against its parameters (their
    objects `closed` or `open`: constraints.Objects); under `auto` that or text, where text is anything
    that does not begin with the wrapper, or JSON of `text`'s schema when given. None (no tools to call)
    leaves `text` as it is."""
    if plan is None or not plan.calling:
        return text
    # A named function is called once (as vLLM's named tool choice does): given room for more, a small
    # model calls it again and again until max_tokens.
    several = plan.parallel and plan.name is None
    calls = ["calls: call", 'calls: call ("\\n" call)*'][several]
    schema = {"anyOf": [call_schema(t, objects) for t in plan.allowed]}
    rules = [calls, f'call: "{OPEN}\\n" body "\\n{CLOSE}"', f"body: {_json_rule(schema)}"]
    if plan.mode == "required":
        rules.insert(0, "start: calls")
    elif text is not None and text.kind == "json_schema":
        rules[:0] = ["start: answer | calls", f"answer: {_json_rule(json.loads(text.source))}"]
    else:
        # `~` (llguidance's complement): text may hold the wrapper later, only not at its start.
        rules[:0] = ["start: TEXT | calls", f"TEXT: /(.|\\n)*/ & ~/{re.escape(OPEN)}(.|\\n)*/"]
    return Constraint(kind="lark", source="\n".join(rules) + "\n", end=())


# ---- the prompt --------------------------------------------------------------------------------------------


def tools_section(tools: tuple[Tool, ...]) -> str:
    """The generic format's system-prompt section: every tool's schema, then how to call one."""
    listed = "\n".join(json.dumps(function_spec(t), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CLOSE}"
    )


def function_spec(t: Tool) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's shape)."""
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (the grammar's exact form)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def generic_messages(messages: list[dict[str, Any]], tools: tuple[Tool, ...]) -> list[dict[str, str]]:
    """Messages with tools, calls and results as plain text turns, for a template that knows no tools.

    The tools' section goes at the end of the system message (one is added when there is none); each
    assistant call is written back as the model wrote it; consecutive tool results become one user turn
    of `<tool_response>` blocks."""
    out: list[dict[str, str]] = []
    results = False  # whether out[-1] is a user turn made of tool results
    for msg in messages:
        role, content = msg["role"], msg.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        fns = [c["function"] for c in msg.get("tool_calls", [])]
        calls = [call_text(fn["name"], fn["arguments"]) for fn in fns]
        out.append({"role": role, "content": "\n".join(([content] if content else []) + calls)})
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


@lru_cache(maxsize=16)
def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads a `tools` variable (then it renders tools its own way)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def history_call(name: Any, arguments: Any, call_id: str | None, param: str) -> dict[str, Any]:
    """An earlier call in a conversation, as templates take it (arguments an object; OpenAI sends text)."""
    if not isinstance(name, str) or not name:
        raise bad_request("an earlier tool call needs a function name", param)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"the arguments of an earlier call to {name!r} are not JSON", param) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"the arguments of an earlier call to {name!r} must be a JSON object", param)
    return {"id": call_id or "", "type": "function", "function": {"name": name, "arguments": arguments}}
