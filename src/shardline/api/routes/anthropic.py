"""Anthropic-compatible route: POST /v1/messages, whole or as its stream of typed events; tools as
`tool_use` blocks (streamed as `input_json_delta`s) and `tool_result` blocks in later turns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from shardline.api.active import ActiveRequest, Outcome
from shardline.api.errors import bad_request, error_responses, unsupported
from shardline.api.limits import check_tools
from shardline.api.response_format import checked
from shardline.api.service import Service
from shardline.api.stops import checked_stops
from shardline.api.streaming import STREAMED_SSE, sse, stream_response, whole
from shardline.api.tools.calls import (
    ArgsPiece,
    CallEnd,
    CallStart,
    CallStream,
    TextPiece,
    call_id,
    calls_in,
)
from shardline.api.tools.prompt import Mode, Tool, ToolPlan, history_call, named, plan_constraint, tool_of
from shardline.compute.sampling import SamplingParams


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class OutTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    # As Anthropic counts: input_tokens are those not read from the cache; the prompt is their sum.
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens whose KV came from the instance's prefix cache


def _usage(o: Outcome) -> MessageUsage:
    return MessageUsage(
        input_tokens=o.prompt_tokens - o.cached_tokens,
        output_tokens=o.completion_tokens,
        cache_read_input_tokens=o.cached_tokens,
    )


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutTextBlock | OutToolUse]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage
    timings: dict[str, float | None] = {}


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for block in content:
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise unsupported(where, f"content block of type {kind!r}")
        out.append(block["text"])
    return "".join(out)


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation in the neutral form of api/tools/prompt.py: an assistant's `tool_use` blocks are its
    calls, a user's `tool_result` blocks are tool messages (first, as Anthropic orders them)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, results = [], [], []
        for b in blocks:
            kind = b.get("type")
            if kind == "tool_use" and m.role == "assistant":
                calls.append(history_call(b.get("name"), b.get("input"), b.get("id"), "messages"))
            elif kind == "tool_result" and m.role == "user":
                content = b.get("content", "")
                if not isinstance(content, str | list):
                    raise bad_request("a tool_result holds text or text blocks", "messages")
                result = content if isinstance(content, str) else _text(content, "messages")
                results.append({"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id", "")})
            else:
                texts.append(b)
        out += results
        if texts or calls or not results:
            turn: dict[str, Any] = {"role": m.role, "content": _text(texts, "messages")}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def tools_of(tools: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    """Anthropic's client tools: `{name, description, input_schema}` (server tools are refused)."""
    out = []
    for t in tools or []:
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else t
            raise unsupported("tools", f"a tool of type {kind!r}")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tool {t.get('name')!r} needs an input_schema object", "tools")
        out.append(tool_of(t.get("name"), t.get("description"), t["input_schema"], "tools"))
    if len({t.name for t in out}) != len(out):
        raise bad_request("tool names must be unique", "tools")
    return tuple(out)


MODES: dict[str, Mode] = {"auto": "auto", "any": "required", "none": "none"}


def plan_of(tools: tuple[Tool, ...], choice: dict[str, Any] | None) -> ToolPlan | None:
    """Anthropic's tool_choice: auto, any (some tool), tool (that one), none; disable_parallel_tool_use."""
    choice = choice or {"type": "auto"}
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    if not tools:
        if kind in ("any", "tool"):
            raise bad_request(f"tool_choice {kind!r} needs tools", "tool_choice")
        return None
    if kind == "tool":
        return named(tools, str(choice.get("name")), parallel, "tool_choice")
    return ToolPlan(tools, MODES[kind], None, parallel)


def _stop_reason(o: Outcome, called: bool = False) -> str:
    if called and o.finish_reason == "stop":
        return "tool_use"
    if o.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn" if o.finish_reason == "stop" else "max_tokens"


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["Anthropic"])

    @r.post(
        "/v1/messages",
        response_model=MessageResponse,
        responses={**error_responses("anthropic", 400, 401, 404, 429, 503), 200: STREAMED_SSE},
    )
    async def messages(req: MessagesRequest, request: Request) -> Any:
        stops = checked_stops(req.stop_sequences or [], "stop_sequences")
        if any(not s for s in stops):
            raise bad_request("a stop sequence must not be empty", "stop_sequences")
        check_tools(req.tools)
        plan = plan_of(tools_of(req.tools), req.tool_choice)
        calling = plan is not None and plan.calling
        chat: list[dict[str, Any]] = []
        if req.system:
            system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
            chat.append({"role": "system", "content": system})
        chat += chat_messages(req.messages)
        tools = plan.tools if plan is not None and calling else ()
        constraint = plan_constraint(plan, None, service.settings.structured_objects)
        constraint = await asyncio.to_thread(checked, constraint, "tools")
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0,
            top_k=req.top_k or 0,
            constraint=constraint,
        )
        active = await service.start(
            "messages", req.model, lambda t: t.chat(chat, tools), req.max_tokens, sampling, stops
        )
        if req.stream:
            return stream_response(active, lambda r: _events(r, plan if calling else None), "anthropic")
        o = await whole(request, active)
        calls = calls_in(o.text, plan)
        content: list[OutTextBlock | OutToolUse] = [OutTextBlock(text=o.text)]
        if calls is not None:
            content = [OutToolUse(id=call_id("toolu_"), name=c.name, input=c.arguments) for c in calls]
        return MessageResponse(
            id=f"msg_{active.id}",
            model=active.model,
            content=content,
            stop_reason=_stop_reason(o, calls is not None),  # type: ignore[arg-type]
            stop_sequence=o.stop_sequence,
            usage=_usage(o),
            timings=o.timings.as_dict(),
        )

    return r


async def _events(active: ActiveRequest, plan: ToolPlan | None) -> AsyncIterator[bytes]:
    """Anthropic's event stream; under tools a text block opens at the first text, a `tool_use` block at
    each call's start, its input streamed as `input_json_delta`s."""
    start = {
        "id": f"msg_{active.id}",
        "type": "message",
        "role": "assistant",
        "model": active.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # What is cached is known only at the end: message_delta's usage (cumulative) corrects this.
        "usage": {"input_tokens": active.prompt_tokens, "output_tokens": 0},
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    stream = CallStream(may_be_text=plan is None or plan.mode == "auto")
    blocks = 0  # blocks opened
    open_kind: str | None = None  # the open block's type

    def opened(block: dict[str, Any]) -> bytes:
        nonlocal blocks, open_kind
        blocks, open_kind = blocks + 1, block["type"]
        start = {"type": "content_block_start", "index": blocks - 1, "content_block": block}
        return sse(start, "content_block_start")

    def delta(d: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": blocks - 1, "delta": d}, "content_block_delta")

    def closed() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [sse({"type": "content_block_stop", "index": blocks - 1}, "content_block_stop")]

    def parts(events: list[Any]) -> list[bytes]:
        out = []
        for e in events:
            if isinstance(e, TextPiece):
                if open_kind != "text":
                    out += [*closed(), opened({"type": "text", "text": ""})]
                out.append(delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                block = {"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": {}}
                out += [*closed(), opened(block)]
            elif isinstance(e, ArgsPiece):
                out.append(delta({"type": "input_json_delta", "partial_json": e.text}))
            elif isinstance(e, CallEnd):
                out += closed()
        return out

    if plan is None:
        yield opened({"type": "text", "text": ""})
    async for c in active.chunks():
        if c.text:
            for part in parts(stream.feed(c.text) if plan is not None else [TextPiece(c.text)]):
                yield part
    for part in parts(stream.end()):
        yield part
    o = active.outcome
    assert o is not None
    if blocks == 0:  # nothing said: an empty text block, as a whole answer has
        yield opened({"type": "text", "text": ""})
    for part in closed():  # the text block, or a call cut by max_tokens
        yield part
    delta_out = {
        "type": "message_delta",
        "delta": {"stop_reason": _stop_reason(o, stream.calls > 0), "stop_sequence": o.stop_sequence},
        "usage": _usage(o).model_dump(),
    }
    yield sse(delta_out, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
