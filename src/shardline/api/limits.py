"""Every bound a request body is held to beyond its field types, in one place for the three APIs.

Each is checked before anything is spent on the request, and a request past one gets a 400 in its API's
shape naming the parameter. They keep what one request sends to an instance a few kilobytes of settings
(sent once, to the stage that samples) plus its tokens, however a client writes its body:

- logit_bias (OpenAI): at most MAX_LOGIT_BIAS tokens, keys token ids in canonical decimal ("17": no sign,
  spaces or leading zeros, so no two keys name one token), biases in [-MAX_BIAS, MAX_BIAS] (OpenAI's own).
- n (OpenAI): at most MAX_CHOICES. Each choice is a request of its own, with its own KV reservation, all
  submitted at once; 16 keeps one call within a quarter of a node's default 64 requests in flight (a
  request past its node's max_pending is refused too), and 16 of a prompt fit any KV budget that fits one
  with a short answer. OpenAI allows 128.
- stop sequences (every API): at most MAX_STOPS of at most MAX_STOP_CHARS characters (api/stops.py says why
  16, not OpenAI's 4).
- schemas (response_format, Ollama's format, a tool call's grammar): at most MAX_SCHEMA_CHARS characters of
  grammar; tools: at most MAX_TOOLS of at most MAX_TOOLS_CHARS characters of JSON together.
"""

from __future__ import annotations

import json
from typing import Any

from shardline.api.errors import bad_request
from shardline.compute.sampling import MAX_BIAS, MAX_LOGIT_BIAS

__all__ = [
    "MAX_BIAS",
    "MAX_CHOICES",
    "MAX_LOGIT_BIAS",
    "MAX_SCHEMA_CHARS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOOLS",
    "MAX_TOOLS_CHARS",
    "check_choices",
    "check_schema",
    "check_tools",
]

MAX_CHOICES = 16
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_SCHEMA_CHARS = 200_000  # a grammar this long takes seconds to compile
MAX_TOOLS = 128  # OpenAI's
MAX_TOOLS_CHARS = 400_000


def check_choices(n: int, param: str = "n") -> None:
    if n > MAX_CHOICES:
        raise bad_request(f"{param} is {n}; at most {MAX_CHOICES} choices per request", param)


def check_schema(chars: int, param: str) -> None:
    if chars > MAX_SCHEMA_CHARS:
        raise bad_request(
            f"the schema in {param} makes a grammar of {chars} characters; at most {MAX_SCHEMA_CHARS}", param
        )


def check_tools(tools: list[Any] | None, param: str = "tools") -> None:
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"{param} lists {len(tools)} tools; at most {MAX_TOOLS}", param)
    chars = len(json.dumps(tools, separators=(",", ":"), default=str))
    if chars > MAX_TOOLS_CHARS:
        raise bad_request(f"{param} is {chars} characters of JSON; at most {MAX_TOOLS_CHARS}", param)
