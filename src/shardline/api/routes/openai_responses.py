"""OpenAI's Responses API: POST /v1/responses (whole or streamed as its typed events), GET and DELETE of a
stored response. Bodies are in api/routes/responses_schema.py, stored responses in responses_store.py.

Another face of the same service as /v1/chat/completions: the input items become the same neutral chat
messages (api/tools/prompt.py), tools and `text.format` the same grammars (read in responses_input.py), and
the answer one active request.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from shardline.api.active import ActiveRequest, Outcome
from shardline.api.errors import ApiError, error_responses
from shardline.api.response_format import checked
from shardline.api.routes.responses_input import (
    check_request,
    conversation_of,
    format_constraint,
    responses_plan,
    responses_tools,
)
from shardline.api.routes.responses_schema import DeletedResponse, ResponseObject, ResponsesRequest
from shardline.api.routes.responses_store import ResponseStore
from shardline.api.service import Service
from shardline.api.streaming import SSE_EVENT, sse, stream_response, whole
from shardline.api.tools.calls import (
    ArgsPiece,
    CallEnd,
    CallStart,
    CallStream,
    Event,
    TextPiece,
    call_id,
    calls_in,
)
from shardline.api.tools.prompt import ToolPlan, plan_constraint
from shardline.compute.sampling import SamplingParams

ERRORS = error_responses("openai", 400, 401, 404, 429, 503)
ANSWERS = {**ERRORS, 200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the answer --------------------------------------------------------------------------------------------


def message_item(text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item_id = _item_id("msg")
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def call_item(name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id(),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as the chat messages a follow-up's prompt holds."""
    return conversation_of(
        [
            {"type": "message", "role": "assistant", "content": item["content"]}
            if item["type"] == "message"
            else {k: item[k] for k in ("type", "name", "arguments", "call_id")}
            for item in output
        ]
    )


@dataclass
class Run:
    """One Responses request: what it asked, and what its Response object echoes."""

    req: ResponsesRequest
    plan: ToolPlan | None
    history: list[dict[str, Any]]  # the conversation before the answer (earlier turns + this input)
    store: ResponseStore
    rid: str = ""
    created: int = 0
    model: str = ""
    output: list[dict[str, Any]] = field(default_factory=list)

    def response(self, status: str, outcome: Outcome | None = None) -> dict[str, Any]:
        req = self.req
        usage = None
        if outcome is not None:
            usage = {
                "input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": outcome.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            }
        tools = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": True,
            }
            for t in (self.plan.tools if self.plan is not None else ())
        ]
        fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.output,
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": req.top_p or 1.0,
            "tool_choice": req.tool_choice or "auto",
            "tools": tools,
            "text": {"format": fmt},
            "truncation": "disabled",
            "background": False,
            "reasoning": {"effort": None, "summary": None},
            "timings": outcome.timings.as_dict() if outcome is not None else None,
        }

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The final Response object, stored unless the request said `store: false`."""
        status = "incomplete" if outcome.finish_reason == "length" and not self._called() else "completed"
        response = self.response(status, outcome)
        if self.req.store is not False:
            self.store.put(self.rid, response, self.history + output_messages(self.output))
        return response

    def _called(self) -> bool:
        return any(i["type"] == "function_call" and i["status"] == "completed" for i in self.output)


def whole_output(outcome: Outcome, plan: ToolPlan | None) -> list[dict[str, Any]]:
    calls = calls_in(outcome.text, plan)
    if calls is not None:
        return [call_item(c.name, c.arguments_json, "completed") for c in calls]
    return [message_item(outcome.text, "incomplete" if outcome.finish_reason == "length" else "completed")]


async def _events(active: ActiveRequest, run: Run) -> AsyncIterator[bytes]:
    """The Responses API's typed events, each an SSE `event:` named as its `type`, numbered in order."""
    seq = itertools.count()

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    plan = run.plan
    calling = plan is not None and plan.calling
    calls = CallStream(may_be_text=plan is None or plan.mode == "auto")
    message: dict[str, Any] | None = None
    at: dict[str, Any] = {}  # the message's place: item_id, output_index, content_index
    text: list[str] = []
    open_calls: dict[int, int] = {}  # a streamed call's index -> its output index
    yield ev("response.created", response=run.response("in_progress"))
    yield ev("response.in_progress", response=run.response("in_progress"))

    def opened(item: dict[str, Any]) -> bytes:
        run.output.append({**item, "status": "in_progress"})
        return ev("response.output_item.added", output_index=len(run.output) - 1, item=run.output[-1])

    def message_events() -> list[bytes]:
        nonlocal message
        if message is not None:
            return []
        message = message_item("", "in_progress")
        part = message["content"][0]
        message["content"] = []
        at.update(item_id=message["id"], output_index=len(run.output), content_index=0)
        return [opened(message), ev("response.content_part.added", **at, part=part)]

    def translated(events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, TextPiece):
                out += message_events()
                assert message is not None
                text.append(e.text)
                out.append(ev("response.output_text.delta", **at, delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                open_calls[e.index] = len(run.output)
                out.append(opened(call_item(e.name, "", "in_progress")))
            elif isinstance(e, ArgsPiece):
                index = open_calls[e.index]
                item_id = run.output[index]["id"]
                out.append(
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=e.text,
                    )
                )
            elif isinstance(e, CallEnd):
                index = open_calls.pop(e.index)
                item = run.output[index]
                item.update(arguments=e.arguments, status="completed")
                out.append(
                    ev(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=e.arguments,
                    )
                )
                out.append(ev("response.output_item.done", output_index=index, item=item))
        return out

    try:
        async for chunk in active.chunks():
            events: list[Event] = calls.feed(chunk.text) if calling else [TextPiece(chunk.text)]
            for part in translated([e for e in events if not isinstance(e, TextPiece) or e.text]):
                yield part
        for part in translated(calls.end() if calling else []):
            yield part
    except ApiError as exc:
        yield ev("error", code=exc.code or exc.kind, message=exc.message, param=exc.param)
        failed = run.response("failed")
        failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
        yield ev("response.failed", response=failed)
        return
    outcome = active.outcome
    assert outcome is not None
    status = "incomplete" if outcome.finish_reason == "length" else "completed"
    if not run.output:  # nothing at all was said: still one (empty) message, as a whole answer has
        for part in message_events():
            yield part
    if message is not None:
        index = at["output_index"]
        whole_text = "".join(text)
        part = {"type": "output_text", "text": whole_text, "annotations": [], "logprobs": []}
        yield ev("response.output_text.done", **at, text=whole_text, logprobs=[])
        yield ev("response.content_part.done", **at, part=part)
        run.output[index].update(content=[part], status=status)
        yield ev("response.output_item.done", output_index=index, item=run.output[index])
    for index in open_calls.values():  # a call cut short by max_output_tokens
        run.output[index]["status"] = "incomplete"
        yield ev("response.output_item.done", output_index=index, item=run.output[index])
    response = run.finish(outcome)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield ev(kind, response=response)


# ---- the routes --------------------------------------------------------------------------------------------


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no stored response {rid!r}: responses made with store: false are not kept, and stored ones are "
        "kept in memory by the node that answered, for a bounded time and number",
        "invalid_request_error",
        param,
        "response_not_found" if param is None else "previous_response_not_found",
    )


def router(service: Service, store: ResponseStore | None = None) -> APIRouter:
    r = APIRouter(tags=["OpenAI"])
    stored = store or ResponseStore()

    @r.post("/v1/responses", responses=ANSWERS)
    async def create(req: ResponsesRequest, request: Request) -> Any:
        check_request(req)
        tools = responses_tools(req.tools)
        plan = responses_plan(req, tools)
        calling = plan is not None and plan.calling
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = stored.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = list(previous.conversation)
        assert req.input is not None
        history += conversation_of(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
        objects = service.settings.structured_objects
        constraint = format_constraint(req, objects)
        if calling:
            constraint = plan_constraint(plan, constraint, objects)
        param = "tools" if calling else "text"
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0,
            constraint=await asyncio.to_thread(checked, constraint, param),
        )
        prompt_tools = plan.tools if calling and plan is not None else ()
        try:
            active = await service.start(
                "responses",
                req.model,
                lambda text: text.chat(messages, prompt_tools),
                req.max_output_tokens,
                sampling,
                [],
            )
        except ApiError as exc:
            if exc.param == "max_tokens":  # the service's name for it
                exc.param, exc.message = (
                    "max_output_tokens",
                    exc.message.replace("max_tokens", "max_output_tokens"),
                )
            raise
        run = Run(req, plan, history, stored, f"resp_{active.id}", active.created, active.model)
        if req.stream:
            return stream_response(active, lambda a: _events(a, run), "openai")
        outcome = await whole(request, active)
        run.output = whole_output(outcome, plan)
        return JSONResponse(run.finish(outcome))

    @r.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS)
    async def retrieve(response_id: str) -> Any:
        found = stored.get(response_id)
        if found is None:
            raise _not_found(response_id)
        return JSONResponse(found.response)

    @r.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=ERRORS)
    async def delete(response_id: str) -> DeletedResponse:
        if not stored.delete(response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    return r
