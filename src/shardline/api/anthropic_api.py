"""Anthropic-compatible route: POST /v1/messages, whole or as its stream of typed events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from shardline.api.errors import bad_request, error_responses, unsupported
from shardline.api.service import ActiveRequest, Outcome, Service
from shardline.api.stops import checked_stops
from shardline.api.streaming import STREAMED_SSE, sse, stream_response, whole
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


class OutTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutTextBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None
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


def _stop_reason(o: Outcome) -> str:
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
        if req.tools:
            raise unsupported("tools", "tools (tool use)")
        stops = checked_stops(req.stop_sequences or [], "stop_sequences")
        if any(not s for s in stops):
            raise bad_request("a stop sequence must not be empty", "stop_sequences")
        chat: list[dict[str, str]] = []
        if req.system:
            system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
            chat.append({"role": "system", "content": system})
        chat += [{"role": m.role, "content": _text(m.content, "messages")} for m in req.messages]
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0,
            top_k=req.top_k or 0,
        )
        run = await service.start(
            "messages", req.model, lambda t: t.chat(chat), req.max_tokens, sampling, stops
        )
        if req.stream:
            return stream_response(run, _events, "anthropic")
        o = await whole(request, run)
        return MessageResponse(
            id=f"msg_{run.id}",
            model=run.model,
            content=[OutTextBlock(text=o.text)],
            stop_reason=_stop_reason(o),  # type: ignore[arg-type]
            stop_sequence=o.stop_sequence,
            usage=MessageUsage(input_tokens=o.prompt_tokens, output_tokens=o.completion_tokens),
            timings=o.timings.as_dict(),
        )

    return r


async def _events(run: ActiveRequest) -> AsyncIterator[bytes]:
    start = {
        "id": f"msg_{run.id}",
        "type": "message",
        "role": "assistant",
        "model": run.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0},
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    yield sse(block, "content_block_start")
    async for c in run.chunks():
        if c.text:
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": c.text},
            }
            yield sse(delta, "content_block_delta")
    o = run.outcome
    assert o is not None
    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": _stop_reason(o), "stop_sequence": o.stop_sequence},
        "usage": {"output_tokens": o.completion_tokens},
    }
    yield sse(delta, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
