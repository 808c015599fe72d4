"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models (their bodies are in
api/routes/openai_schema.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from shardline.api.active import ActiveRequest, Outcome
from shardline.api.errors import ApiError, bad_request, error_responses, unsupported
from shardline.api.limits import check_choices, check_tools
from shardline.api.model_text import ModelText
from shardline.api.response_format import check_bias_tokens, checked, constraint_of, logit_bias_of
from shardline.api.routes.openai_schema import (
    AnswerTimings,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatMessage,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FunctionCall,
    ModelCard,
    ModelList,
    Sampling,
    TextPart,
    ToolCall,
    Usage,
)
from shardline.api.service import Service
from shardline.api.stops import checked_stops
from shardline.api.streaming import STREAMED_SSE, ActiveGroup, merged, sse, stream_response, whole_all
from shardline.api.tools.calls import ArgsPiece, CallStart, CallStream, Event, TextPiece, call_id, calls_in
from shardline.api.tools.prompt import ToolPlan, history_call, openai_plan, openai_tools, plan_constraint
from shardline.compute.constraints import Objects
from shardline.compute.sampling import SamplingParams
from shardline.front.request import Token

ERRORS = error_responses("openai", 400, 401, 404, 429, 503)


# ---- request -> active requests ----------------------------------------------------------------------------


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = checked_stops([stop] if isinstance(stop, str) else list(stop or []), "stop")
    if any(not s for s in stops):
        raise bad_request("a stop sequence must not be empty", "stop")
    return stops


def sampling_of(req: Sampling, top_logprobs: int = 0, objects: Objects = "closed") -> SamplingParams:
    """The settings of the request's first choice (see choice_sampling for the others); its constraint is
    parsed here and compiled by `checked`."""
    fields: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": req.top_p or 1.0,
        "top_k": req.top_k or 0,
        "min_p": req.min_p or 0.0,
        "repetition_penalty": req.repetition_penalty or 1.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "top_logprobs": top_logprobs,
        "logit_bias": logit_bias_of(req.logit_bias),
        "constraint": constraint_of(req.response_format, objects),
    }
    if req.seed is not None:
        fields["seed"] = req.seed % (2**63)
    return SamplingParams(**fields)


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n: seed + i when a seed was given (so it equals a lone request with that seed), else a
    seed of its own (drawn by the front)."""
    if index == 0 or "seed" not in sampling.model_fields_set:
        return sampling
    return sampling.model_copy(update={"seed": (sampling.seed + index) % (2**63)})


async def start_choices(
    service: Service,
    endpoint: str,
    req: Sampling,
    prompt: Callable[[ModelText], list[int]],
    max_tokens: int | None,
    sampling: SamplingParams,
    stops: list[str],
    constraint_param: str = "response_format",
) -> list[ActiveRequest]:
    """Submit the request's n choices (all or none): each is a request of its own through the front."""
    n = req.n or 1
    check_choices(n)
    if n > service.settings.max_pending:
        raise bad_request(f"n is {n}; this node runs at most {service.settings.max_pending} at once", "n")
    constraint = await asyncio.to_thread(checked, sampling.constraint, constraint_param)
    sampling = sampling.model_copy(update={"constraint": constraint})

    made: list[int] = []  # the n choices share one prompt: templated and tokenised once

    def ids(text: ModelText) -> list[int]:
        if not made:
            check_bias_tokens(sampling.logit_bias, text.vocab_size)
            made.extend(prompt(text))
        return made

    actives: list[ActiveRequest] = []
    try:
        for i in range(n):
            actives.append(
                await service.start(
                    endpoint,
                    req.model,
                    ids,
                    max_tokens,
                    choice_sampling(sampling, i),
                    stops,
                    ignore_eos=bool(req.ignore_eos),
                )
            )
    except BaseException:
        for active in actives:
            active.close()
        raise
    return actives


def message_text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation in the neutral form of api/tools/prompt.py (earlier calls, tool results)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = "system" if msg.role == "developer" else msg.role
        turn: dict[str, Any] = {"role": role, "content": message_text(msg.content)}
        if role == "assistant" and msg.tool_calls:
            turn["tool_calls"] = [_earlier_call(c) for c in msg.tool_calls]
        if role == "tool":
            turn["tool_call_id"] = msg.tool_call_id or ""
        out.append(turn)
    return out


def _earlier_call(c: dict[str, Any]) -> dict[str, Any]:
    fn = c.get("function")
    if c.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request("an assistant's tool_calls must be function calls", "messages")
    return history_call(fn.get("name"), fn.get("arguments"), c.get("id"), "messages")


def _check_chat(req: ChatRequest) -> None:
    if req.functions or req.function_call is not None:
        name = "functions" if req.functions else "function_call"
        raise unsupported(name, f"{name} (deprecated; use tools and tool_choice)")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")


def chat_plan(req: ChatRequest) -> ToolPlan | None:
    """The request's tools and tool_choice; None when it has none (or only tool_choice "none")."""
    check_tools(req.tools)
    if req.parallel_tool_calls is not None and not req.tools:
        raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
    return openai_plan(openai_tools(req.tools), req.tool_choice, req.parallel_tool_calls)


def _message(outcome: Outcome, plan: ToolPlan | None) -> tuple[AssistantMessage, str]:
    """A whole answer: its calls when it is made of valid calls, else its text (see api/tools/prompt.py)."""
    calls = calls_in(outcome.text, plan)
    if calls is None:
        return AssistantMessage(content=outcome.text), outcome.finish_reason
    out = [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments_json)) for c in calls
    ]
    return AssistantMessage(content=None, tool_calls=out), "tool_calls"


def _completion_prompt(req: CompletionRequest) -> Any:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        if len(p) != 1:
            raise unsupported("prompt", "a batch of several prompts")
        p = p[0]
    if isinstance(p, list):
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        return list(p)
    return p


def _prompt_ids(prompt: Any, text: ModelText) -> list[int]:
    if isinstance(prompt, str):
        return text.text(prompt)
    if any(not 0 <= t < text.vocab_size for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {text.vocab_size})", "prompt")
    return prompt


# ---- formatting --------------------------------------------------------------------------------------------


def _usage(outcomes: list[Outcome]) -> dict[str, Any]:
    """The prompt once, the completion tokens of every choice. The prompt's cached tokens once too: the most
    any choice found (each choice is a request of its own; one ended at a stop string never learns its)."""
    prompt = outcomes[0].prompt_tokens
    completion = sum(o.completion_tokens for o in outcomes)
    cached = max(o.cached_tokens for o in outcomes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _timings(outcomes: list[Outcome]) -> dict[str, float | None]:
    """The first choice's figures, over the time all of them took."""
    return {**outcomes[0].timings.as_dict(), "total_s": round(max(o.timings.total_s for o in outcomes), 6)}


def _token_logprob(t: Token, text: ModelText) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        s = text.tokenizer.decode([tok])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs]}


def _completion_logprobs(tokens: list[Token], text: ModelText) -> dict[str, Any]:
    strs = [text.tokenizer.decode([t.token]) for t in tokens]
    offsets, at = [], 0
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": strs,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{text.tokenizer.decode([i]): lp for i, lp in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }


def router(service: Service) -> APIRouter:
    r = APIRouter(tags=["OpenAI"])

    @r.get("/v1/models", response_model=ModelList, responses=error_responses("openai", 401))
    async def list_models() -> ModelList:
        now = int(time.time())
        return ModelList(data=[ModelCard(id=name, created=now) for name in service.model_names()])

    @r.get("/v1/models/{model}", response_model=ModelCard, responses=error_responses("openai", 401, 404))
    async def get_model(model: str) -> ModelCard:
        if model not in service.model_names():
            raise ApiError(
                404, f"model {model!r} does not exist", "not_found_error", "model", "model_not_found"
            )
        return ModelCard(id=model, created=int(time.time()))

    @r.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses={**ERRORS, 200: STREAMED_SSE},
    )
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        _check_chat(req)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        sampling = sampling_of(req, top, service.settings.structured_objects)
        plan = chat_plan(req)
        calling = plan is not None and plan.calling
        if calling:
            objects = service.settings.structured_objects
            constraint = plan_constraint(plan, sampling.constraint, objects)
            sampling = sampling.model_copy(update={"constraint": constraint})
        stops = _stops(req.stop)
        messages = chat_messages(req.messages)
        tools = plan.tools if calling and plan is not None else ()
        max_tokens = req.max_completion_tokens or req.max_tokens
        actives = await start_choices(
            service,
            "chat",
            req,
            lambda text: text.chat(messages, tools),
            max_tokens,
            sampling,
            stops,
            "tools" if calling else "response_format",
        )
        group = ActiveGroup(actives)
        text = actives[0].text
        want_lp = bool(req.logprobs)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(
                group, lambda g: _chat_events(g.actives, text, want_lp, usage, plan), "openai"
            )
        outcomes = await whole_all(request, group)
        choices = []
        for i, (active, outcome) in enumerate(zip(actives, outcomes, strict=True)):
            logprobs = {"content": [_token_logprob(t, text) for t in active.used]} if want_lp else None
            message, finish = _message(outcome, plan)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish,  # type: ignore[arg-type]
                )
            )
        return ChatCompletion(
            id=f"chatcmpl-{actives[0].id}",
            created=actives[0].created,
            model=actives[0].model,
            choices=choices,
            usage=Usage(**_usage(outcomes)),
            timings=AnswerTimings(**_timings(outcomes)),  # type: ignore[arg-type]
        )

    @r.post("/v1/completions", response_model=Completion, responses={**ERRORS, 200: STREAMED_SSE})
    async def completions(req: CompletionRequest, request: Request) -> Any:
        if req.echo:
            raise unsupported("echo", "echo")
        if req.suffix:
            raise unsupported("suffix", "suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "best_of > 1")
        prompt = _completion_prompt(req)
        sampling = sampling_of(req, req.logprobs or 0, service.settings.structured_objects)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default for completions
        actives = await start_choices(
            service,
            "completions",
            req,
            lambda text: _prompt_ids(prompt, text),
            max_tokens,
            sampling,
            _stops(req.stop),
        )
        group = ActiveGroup(actives)
        text = actives[0].text
        want_lp = req.logprobs is not None
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(
                group, lambda g: _completion_events(g.actives, text, want_lp, usage), "openai"
            )
        outcomes = await whole_all(request, group)
        return Completion(
            id=f"cmpl-{actives[0].id}",
            created=actives[0].created,
            model=actives[0].model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=outcome.text,
                    logprobs=_completion_logprobs(active.used, text) if want_lp else None,
                    finish_reason=outcome.finish_reason,  # type: ignore[arg-type]
                )
                for i, (active, outcome) in enumerate(zip(actives, outcomes, strict=True))
            ],
            usage=Usage(**_usage(outcomes)),
            timings=AnswerTimings(**_timings(outcomes)),  # type: ignore[arg-type]
        )

    return r


async def _chat_events(
    actives: list[ActiveRequest], text: ModelText, logprobs: bool, usage: bool, plan: ToolPlan | None
) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come, each carrying its choice's index; calls as `tool_calls` deltas
    (the first of a call with its id, type and name, then pieces of its arguments)."""
    first = actives[0]
    base = {
        "id": f"chatcmpl-{first.id}",
        "object": "chat.completion.chunk",
        "created": first.created,
        "model": first.model,
    }

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    calling = plan is not None and plan.calling
    streams = [CallStream(may_be_text=plan is None or plan.mode == "auto") for _ in actives]

    def deltas(i: int, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, TextPiece):
                out.append({"content": e.text})
            elif isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                call = {"index": e.index, "id": call_id(), "type": "function", "function": fn}
                out.append({"tool_calls": [call]})
            elif isinstance(e, ArgsPiece):
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    for i in range(len(actives)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for i, c in merged([active.chunks() for active in actives]):
        if c is None:
            outcome = actives[i].outcome
            assert outcome is not None
            for d in deltas(i, streams[i].end()):
                yield chunk(i, d)
            called = streams[i].calls > 0 and outcome.finish_reason == "stop"
            yield chunk(i, {}, "tool_calls" if called else outcome.finish_reason)
            continue
        lp = {"content": [_token_logprob(t, text) for t in c.tokens]} if logprobs and c.tokens else None
        if not calling:
            if c.text or lp:
                yield chunk(i, {"content": c.text}, lp=lp)
            continue
        out = deltas(i, streams[i].feed(c.text)) or ([{"content": ""}] if lp else [])
        for k, d in enumerate(out):
            yield chunk(i, d, lp=lp if k == 0 else None)
    if usage:
        outcomes = [active.outcome for active in actives if active.outcome is not None]
        yield sse({**base, "choices": [], "usage": _usage(outcomes), "timings": _timings(outcomes)})
    yield sse("[DONE]")


async def _completion_events(
    actives: list[ActiveRequest], text: ModelText, logprobs: bool, usage: bool
) -> AsyncIterator[bytes]:
    first = actives[0]
    base = {
        "id": f"cmpl-{first.id}",
        "object": "text_completion",
        "created": first.created,
        "model": first.model,
    }

    def choice(index: int, text: str, lp: Any, finish: str | None) -> bytes:
        part = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return sse({**base, "choices": [part]})

    async for i, c in merged([active.chunks() for active in actives]):
        if c is None:
            outcome = actives[i].outcome
            assert outcome is not None
            yield choice(i, "", None, outcome.finish_reason)
            continue
        lp = _completion_logprobs(c.tokens, text) if logprobs and c.tokens else None
        if c.text or lp:
            yield choice(i, c.text, lp, None)
    if usage:
        outcomes = [active.outcome for active in actives if active.outcome is not None]
        yield sse({**base, "choices": [], "usage": _usage(outcomes), "timings": _timings(outcomes)})
    yield sse("[DONE]")
