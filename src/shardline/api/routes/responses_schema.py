"""The OpenAI Responses API's bodies: the request as pydantic validates it, the Response object as the OpenAPI
spec documents it. The route that takes and gives them is api/routes/openai_responses.py.

Input items, tools and `text.format` stay plain dicts here: the route reads them one by one, so a bad one is
a 400 that names what is wrong with it rather than a union's list of every shape it failed to be.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity and the like: accepted, nothing to do

    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # include, reasoning, truncation, user...: accepted and ignored

    model: str
    input: Any = None  # a string or a list of input items; checked by the route, so its 400 names `input`
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    # Refused when set (a 400 naming them): what this server does not do.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


# ---- the Response object (documented in the OpenAPI spec) --------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str  # resp_...
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage | FunctionCallItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    text: dict[str, Any] = {}


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
