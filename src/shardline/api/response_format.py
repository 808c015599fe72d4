"""What a request asks its output to be: OpenAI's `response_format` as a constraint, and `logit_bias`.

Pure translation and validation; a bad value is a 400 naming its parameter. The constraint's end tokens are
the model's, filled in by the service once it knows the model (service.start).
"""

from __future__ import annotations

import re
from typing import Any

from shardline.api.errors import bad_request
from shardline.api.limits import MAX_BIAS, MAX_LOGIT_BIAS, check_schema
from shardline.api.limits import MAX_SCHEMA_CHARS as MAX_SCHEMA_CHARS  # bench chaos reads it here
from shardline.compute.constraints import Constraint, Objects, any_json_object, json_schema, problem

PARAM = "response_format"
TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical decimal: one spelling per token id


def constraint_of(fmt: dict[str, Any] | None, objects: Objects = "closed") -> Constraint | None:
    """OpenAI's response_format: text (none), json_object (any object) or json_schema (that schema, its
    objects `closed` or `open`: constraints.Objects)."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return any_json_object(())
    if kind != "json_schema":
        raise bad_request(
            f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'", PARAM
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format 'json_schema' needs a json_schema object", PARAM)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string", PARAM)
    if not isinstance(spec.get("strict", False), bool | None):
        raise bad_request("response_format.json_schema.strict must be a boolean", PARAM)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", PARAM)
    c = json_schema(schema, (), objects)
    check_schema(len(c.source), PARAM)
    return c


def checked(c: Constraint | None, param: str = PARAM) -> Constraint | None:
    """The constraint, once its grammar compiles (off the event loop: a large schema takes a while); else
    a 400 naming `param`, the parameter it came from (response_format, or tools for a call's grammar)."""
    if c is None:
        return None
    check_schema(len(c.source), param)  # before compiling it
    why = problem(c)
    if why is not None:
        raise bad_request(f"the schema in {param} cannot be used: {why}", param)
    return c


def logit_bias_of(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token id (a string key in JSON) -> bias in [-100, 100], at most 300 of them.

    Keys are token ids in canonical decimal: "01", "+1" or " 1" would name token 1 again under another
    key, so they are refused rather than read."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias names {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = []
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key):
            raise bad_request(_not_canonical(key, bias), "logit_bias")
        token = int(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -MAX_BIAS <= value <= MAX_BIAS
        ):
            raise bad_request(
                f"logit_bias for token {token} must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                "logit_bias",
            )
        out.append((token, float(value)))
    return tuple(sorted(out))


def _not_canonical(key: str, bias: dict[str, float]) -> str:
    try:
        token = int(key)
    except ValueError:
        return f"logit_bias key {key[:40]!r} is not a token id"
    if str(token) in bias:
        return f"logit_bias keys {key[:40]!r} and {str(token)!r} name the same token"
    return f"logit_bias key {key[:40]!r} is not a token id in canonical decimal (write {str(token)!r})"


def check_bias_tokens(bias: tuple[tuple[int, float], ...], vocab: int) -> None:
    if bad := [t for t, _ in bias if t >= vocab]:
        raise bad_request(
            f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad}", "logit_bias"
        )
