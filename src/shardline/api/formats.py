"""What a request asks its output to be: OpenAI's `response_format` as a constraint, and `logit_bias`.

Pure translation and validation; a bad value is a 400 naming its parameter. The constraint's end tokens are
the model's, filled in by the service once it knows the model (service.start).
"""

from __future__ import annotations

from typing import Any

from shardline.api.errors import bad_request
from shardline.compute.constraints import Constraint, any_json_object, json_schema, problem

PARAM = "response_format"
MAX_SCHEMA_CHARS = 200_000  # a schema this long is a grammar too large to compile within a request


def constraint_of(fmt: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format: text (none), json_object (any object) or json_schema (that schema)."""
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
    c = json_schema(schema, ())
    if len(c.source) > MAX_SCHEMA_CHARS:
        raise bad_request(f"response_format's schema is longer than {MAX_SCHEMA_CHARS} characters", PARAM)
    return c


def checked(c: Constraint | None, param: str = PARAM) -> Constraint | None:
    """The constraint, once its grammar compiles (off the event loop: a large schema takes a while); else
    a 400 naming `param`, the parameter it came from (response_format, or tools for a call's grammar)."""
    if c is None:
        return None
    why = problem(c)
    if why is not None:
        raise bad_request(f"the schema in {param} cannot be used: {why}", param)
    return c


def logit_bias_of(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token id (a string key in JSON) -> bias in [-100, 100]."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if token < 0:
            raise bad_request(f"logit_bias token id {token} is negative", "logit_bias")
        if not isinstance(value, int | float) or not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias for token {token} must be a number in [-100, 100]", "logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


def check_bias_tokens(bias: tuple[tuple[int, float], ...], vocab: int) -> None:
    if bad := [t for t, _ in bias if t >= vocab]:
        raise bad_request(
            f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad}", "logit_bias"
        )
