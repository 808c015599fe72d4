"""Ollama-compatible routes: /api/chat and /api/generate (NDJSON streamed by default, as Ollama does),
/api/tags, /api/show, /api/version. `format` ("json" or a JSON schema) constrains the answer; /api/chat
takes `tools` and answers calls as `message.tool_calls` (arguments an object)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

import shardline
from shardline.api.active import ActiveRequest, Outcome
from shardline.api.errors import ApiError, bad_request, error_responses, unsupported
from shardline.api.limits import check_tools
from shardline.api.response_format import checked
from shardline.api.service import Service
from shardline.api.stops import checked_stops
from shardline.api.streaming import STREAMED_NDJSON, ndjson, stream_response, whole
from shardline.api.tools.calls import CallEnd, CallStream, TextPiece, calls_in
from shardline.api.tools.prompt import ToolPlan, history_call, openai_tools, plan_constraint
from shardline.compute.constraints import Constraint, Objects, any_json_object, json_schema
from shardline.compute.sampling import SamplingParams

ERRORS = error_responses("ollama", 400, 401, 403, 404, 429, 503)


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")  # load-time options (num_ctx, num_gpu...) mean nothing here

    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    num_predict: int | None = Field(None, ge=-2)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=0, le=4096)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: list[str] | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # a tool message: the tool that answered


class Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool | None = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | float | None = None


class OllamaChatRequest(Common):
    messages: list[OllamaMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Common):
    prompt: str = ""
    system: str | None = None
    raw: bool | None = False
    images: list[str] | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)  # what older Ollama clients send

    @model_validator(mode="after")
    def _one_name(self) -> ShowRequest:
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    @property
    def wanted(self) -> str:
        return self.model or self.name or ""


class Details(BaseModel):
    format: str = "safetensors"
    family: str = ""
    families: list[str] = []
    parameter_size: str = ""
    quantization_level: str = ""


class TagModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class Tags(BaseModel):
    models: list[TagModel]


class FunctionOut(BaseModel):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(BaseModel):
    function: FunctionOut


class ChatOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[ToolCallOut] | None = None


class Final(BaseModel):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(Final):
    message: ChatOut


class GenerateResponse(Final):
    response: str


class ShowResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(BaseModel):
    version: str


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _sampling(o: Options | None) -> tuple[SamplingParams, int | None, list[str]]:
    o = o or Options()
    fields: dict[str, Any] = {
        "temperature": 0.8 if o.temperature is None else o.temperature,  # Ollama's default
        "top_p": o.top_p or 0.9,
        "top_k": 40 if o.top_k is None else o.top_k,
        "min_p": o.min_p or 0.0,
        "repetition_penalty": o.repeat_penalty or 1.1,
        "repetition_context": 64 if o.repeat_last_n is None else o.repeat_last_n,
        "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0,
    }
    if o.seed is not None:
        fields["seed"] = o.seed % (2**63)
    limit = None if o.num_predict is None or o.num_predict < 0 else o.num_predict
    if limit == 0:
        raise ApiError(400, "num_predict must not be 0", param="num_predict")
    stops = [s for s in checked_stops(o.stop or [], "options.stop") if s]  # Ollama ignores empty ones
    return SamplingParams(**fields), limit, stops


def model_name(service: Service, name: str) -> str:
    """Ollama's `name:latest` is the model `name` (shardline has no tags), unless a model is so named."""
    if name.endswith(":latest") and name not in service.model_names():
        return name.removesuffix(":latest")
    return name


def format_of(fmt: str | dict[str, Any] | None, objects: Objects = "closed") -> Constraint | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return any_json_object(())
    if isinstance(fmt, dict):
        return json_schema(fmt, (), objects)
    raise bad_request(f'format must be "json" or a JSON schema, not {fmt!r}', "format")


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """The conversation in api/tools/prompt.py's neutral form (Ollama's calls carry arguments as objects)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        calls = [c.get("function") for c in m.tool_calls or []]
        if m.role == "assistant" and calls:
            if not all(isinstance(fn, dict) for fn in calls):
                raise bad_request("an assistant's tool_calls need a function object each", "messages")
            turn["tool_calls"] = [
                history_call(fn["name"], fn.get("arguments"), None, "messages") for fn in calls
            ]
        out.append(turn)
    return out


def _calls_out(text: str, plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    calls = calls_in(text, plan)
    return (
        None if calls is None else [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    )


def _final(active: ActiveRequest, o: Outcome) -> dict[str, Any]:
    t = o.timings
    ns = 1_000_000_000
    prefill = t.ttft_s or 0.0
    return {
        "model": active.model,
        "created_at": _now(),
        "done": True,
        "done_reason": "length" if o.finish_reason == "length" else "stop",
        "total_duration": int(t.total_s * ns),
        "load_duration": 0,
        "prompt_eval_count": o.prompt_tokens,
        "prompt_eval_duration": int(prefill * ns),
        "eval_count": o.completion_tokens,
        "eval_duration": int(max(0.0, t.total_s - prefill) * ns),
    }


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["Ollama"])

    @r.post("/api/chat", response_model=ChatResponse, responses={**ERRORS, 200: STREAMED_NDJSON})
    async def chat(req: OllamaChatRequest, request: Request) -> Any:
        if any(m.images for m in req.messages):
            raise unsupported("images", "images")
        sampling, limit, stops = _sampling(req.options)
        check_tools(req.tools)
        tools = openai_tools(req.tools)
        plan = ToolPlan(tools) if tools else None  # Ollama has no tool_choice: the model decides
        objects = service.settings.structured_objects
        constraint = plan_constraint(plan, format_of(req.format, objects), objects)
        constraint = await asyncio.to_thread(checked, constraint, "tools" if plan else "format")
        sampling = sampling.model_copy(update={"constraint": constraint})
        messages = _messages(req.messages)
        model = model_name(service, req.model)
        active = await service.start(
            "ollama_chat", model, lambda t: t.chat(messages, tools), limit, sampling, stops
        )
        if req.stream is not False:
            return stream_response(active, lambda r: _chat_lines(r, plan), "ollama", "application/x-ndjson")
        o = await whole(request, active)
        calls = _calls_out(o.text, plan)
        message = {"role": "assistant", "content": o.text if calls is None else ""}
        return {**_final(active, o), "message": {**message, **({"tool_calls": calls} if calls else {})}}

    @r.post("/api/generate", response_model=GenerateResponse, responses={**ERRORS, 200: STREAMED_NDJSON})
    async def generate(req: GenerateRequest, request: Request) -> Any:
        if req.images:
            raise unsupported("images", "images")
        sampling, limit, stops = _sampling(req.options)
        constraint = format_of(req.format, service.settings.structured_objects)
        constraint = await asyncio.to_thread(checked, constraint, "format")
        sampling = sampling.model_copy(update={"constraint": constraint})
        model = model_name(service, req.model)
        if not req.prompt:
            # Ollama answers an empty prompt by loading the model; here the model is placed already.
            rec, _, _ = await service.target(model)
            return {
                "model": rec.model,
                "created_at": _now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        if req.raw:
            prompt_ids = lambda t: t.text(req.prompt)  # noqa: E731
        else:
            chat = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}
            ]
            prompt_ids = lambda t: t.chat(chat)  # noqa: E731
        active = await service.start("ollama_generate", model, prompt_ids, limit, sampling, stops)
        if req.stream is not False:
            return stream_response(active, _generate_lines, "ollama", "application/x-ndjson")
        o = await whole(request, active)
        return {**_final(active, o), "response": o.text}

    @r.get("/api/tags", response_model=Tags, responses=error_responses("ollama", 401, 403))
    async def tags() -> Tags:
        now = _now()
        out = []
        for name in service.model_names():
            fp = service.footprint(name)
            out.append(
                TagModel(
                    name=name,
                    model=name,
                    modified_at=now,
                    size=fp.weight_bytes if fp else 0,
                    digest="",
                    details=Details(quantization_level=fp.weight_format if fp else ""),
                )
            )
        return Tags(models=out)

    @r.post("/api/show", response_model=ShowResponse, responses=error_responses("ollama", 400, 401, 403, 404))
    async def show(req: ShowRequest) -> Any:
        model = model_name(service, req.wanted)
        if model not in service.model_names():
            raise ApiError(404, f"model {req.wanted!r} not found", "not_found_error", "model")
        text = await service.text_of(model)
        fp = service.footprint(model)
        info = {
            "general.architecture": text.family,
            f"{text.family}.context_length": text.context_length,
            f"{text.family}.block_count": fp.layers if fp else 0,
        }
        return ShowResponse(
            modelfile=f"FROM {model}\n",
            parameters="",
            template=getattr(text.tokenizer, "chat_template", None) or "",
            details=Details(
                family=text.family, families=[text.family], quantization_level=fp.weight_format if fp else ""
            ),
            model_info=info,
            capabilities=["completion"],
            modified_at=_now(),
        )

    @r.get("/api/version", response_model=Version)
    async def version() -> Version:
        return Version(version=shardline.__version__)

    @r.head("/", include_in_schema=False)
    async def head() -> JSONResponse:  # `ollama` clients probe the server this way
        return JSONResponse(None)

    return r


async def _chat_lines(active: ActiveRequest, plan: ToolPlan | None) -> AsyncIterator[bytes]:
    """Text as it comes; a call (as Ollama streams them) in one line once it is whole."""
    stream = CallStream()

    def lines(events: list[Any]) -> list[bytes]:
        out = []
        for e in events:
            msg: dict[str, Any] | None = None
            if isinstance(e, TextPiece):
                msg = {"role": "assistant", "content": e.text}
            elif isinstance(e, CallEnd):
                call = {"function": {"name": e.name, "arguments": json.loads(e.arguments or "{}")}}
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
            if msg is not None:
                line = {"model": active.model, "created_at": _now(), "message": msg, "done": False}
                out.append(ndjson(line))
        return out

    async for c in active.chunks():
        if c.text:
            for line in lines(stream.feed(c.text) if plan is not None else [TextPiece(c.text)]):
                yield line
    for line in lines(stream.end()):
        yield line
    assert active.outcome is not None
    yield ndjson({**_final(active, active.outcome), "message": {"role": "assistant", "content": ""}})


async def _generate_lines(active: ActiveRequest) -> AsyncIterator[bytes]:
    async for c in active.chunks():
        if c.text:
            yield ndjson({"model": active.model, "created_at": _now(), "response": c.text, "done": False})
    assert active.outcome is not None
    yield ndjson({**_final(active, active.outcome), "response": ""})
