"""The Responses API's request, read: `input` (a string or items) as the neutral chat messages of
api/tools/prompt.py, its function tools and tool_choice as a ToolPlan, `text.format` as response_format's
constraint. Every bad value is a 400 naming its parameter; what this server does not do is refused as such.
The route is api/routes/openai_responses.py.
"""

from __future__ import annotations

from typing import Any

from shardline.api.errors import ApiError, bad_request, unsupported
from shardline.api.limits import check_tools
from shardline.api.response_format import constraint_of
from shardline.api.routes.responses_schema import ResponsesRequest
from shardline.api.tools.prompt import Tool, ToolPlan, history_call, openai_plan, tool_of
from shardline.compute.constraints import Constraint, Objects

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds


def check_request(req: ResponsesRequest) -> None:
    if req.background:
        raise unsupported("background", "background mode")
    if req.conversation is not None:
        raise unsupported("conversation", "a conversation object (use previous_response_id)")
    if req.prompt is not None:
        raise unsupported("prompt", "a stored prompt template")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "top_logprobs")
    if req.input is None or req.input == "" or req.input == []:
        raise bad_request("input is required: a string or a list of input items", "input")
    if not isinstance(req.input, str) and not (
        isinstance(req.input, list) and all(isinstance(item, dict) for item in req.input)
    ):
        raise bad_request("input must be a string or a list of input items (objects)", "input")
    meta = req.metadata or {}
    if len(meta) > METADATA_KEYS or any(
        len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS for k, v in meta.items()
    ):
        raise bad_request(
            f"metadata holds at most {METADATA_KEYS} pairs, keys of at most {METADATA_KEY_CHARS} and values "
            f"of at most {METADATA_VALUE_CHARS} characters",
            "metadata",
        )


def _parts_text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string; other parts (images, files) refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in TEXT_PARTS:
            raise bad_request(f"{where}: a {kind} part needs a string text", "input")
        else:
            raise unsupported("input", f"content parts of type {kind!r} (only text)")
    return "".join(texts)


def conversation_of(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages in api/tools/prompt.py's neutral form: messages, earlier function calls (one
    assistant turn for neighbouring calls) and their outputs as tool turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", "input")
            out.append({"role": role, "content": _parts_text(item.get("content"), where)})
        elif kind == "function_call":
            call = history_call(item.get("name"), item.get("arguments"), item.get("call_id"), "input")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where}: a function_call_output needs the call_id it answers", "input")
            output = _parts_text(item.get("output"), where)
            out.append({"role": "tool", "content": output, "tool_call_id": cid})
        elif kind == "reasoning":
            continue  # another server's reasoning, replayed by a client: nothing this model can read back
        else:
            raise unsupported("input", f"input items of type {kind!r}")
    return out


def responses_tools(tools: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    """The Responses API's function tools: `{"type": "function", name, description, parameters, strict}`."""
    check_tools(tools)
    out = []
    for spec in tools or []:
        kind = spec.get("type")
        if kind != "function":
            raise unsupported("tools", f"the built-in tool {kind!r} (only function tools are)")
        if not isinstance(spec.get("strict", False), bool | None):
            raise bad_request(f"tool {spec.get('name')!r}: strict must be a boolean", "tools")
        out.append(tool_of(spec.get("name"), spec.get("description"), spec.get("parameters"), "tools"))
    if len({t.name for t in out}) != len(out):
        raise bad_request("tool names must be unique", "tools")
    return tuple(out)


def responses_plan(req: ResponsesRequest, tools: tuple[Tool, ...]) -> ToolPlan | None:
    """tool_choice `auto` / `none` / `required` or `{"type": "function", "name"}` (the chat form's
    function object flattened); allowed_tools and built-in tools' choices are refused."""
    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported("tool_choice", f"tool_choice of type {choice.get('type')!r}")
        if not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice {"type": "function"} needs the name of a function', "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return openai_plan(tools, choice, req.parallel_tool_calls)


def format_constraint(req: ResponsesRequest, objects: Objects = "closed") -> Constraint | None:
    """`text.format` as response_format's constraint (the same grammar, objects closed or open as the node
    keeps them), errors naming text.format."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        fmt = {"type": "json_schema", "json_schema": spec}
    elif kind not in ("text", "json_object"):
        raise bad_request(
            f"text.format type {kind!r} is not one of 'text', 'json_object', 'json_schema'", "text"
        )
    try:
        return constraint_of(fmt, objects)
    except ApiError as exc:
        exc.message = exc.message.replace("response_format.json_schema.", "text.format.")
        exc.message = exc.message.replace("response_format", "text.format")
        exc.param = "text"
        raise
