"""Objects closed by default: the schema rewrite (compute/constraints.closed_objects) and what the compiled
grammar then takes, on the default model's tokenizer: keys a schema does not name are refused unless the
schema allows them itself; nested objects, $defs and refs, anyOf, arrays and maps are closed; assemblies
(allOf, properties beside anyOf) are left as written; tools' parameters are closed too, and their refs
resolve inside the call wrapper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from shardline.api.response_format import constraint_of
from shardline.api.tools.prompt import Tool, ToolPlan, call_text, plan_constraint
from shardline.compute.constraints import (
    Constraint,
    Objects,
    closed_objects,
    grammar_of,
    json_schema,
    problem,
)

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
B = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}


class Address(BaseModel):
    city: str
    country: Literal["FR", "DE", "UK"]


class Person(BaseModel):
    name: str
    age: int | None = None
    home: Address
    past: list[Address] = []


@pytest.fixture(scope="module")
def llg_tokenizer(model_dir: Path) -> Any:
    from llguidance import LLTokenizer

    return LLTokenizer(str(model_dir / "tokenizer.json"))


def takes(tok: Any, c: Constraint, text: str) -> bool:
    """Whether the constraint's grammar accepts `text` whole."""
    from llguidance import LLMatcher

    assert problem(c) is None, problem(c)
    m = LLMatcher(tok, grammar_of(c), log_level=0)
    m.consume_tokens(tok.tokenize_str(text))
    return not m.is_error() and m.is_accepting()


def test_closing_adds_additional_properties_false_where_a_schema_is_silent() -> None:
    schema = Person.model_json_schema()
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["$defs"]["Address"]
    # a schema's own say is kept, an object that names no keys stays any object, non-objects are untouched
    for kept in (
        {**A, "additionalProperties": True},
        {**A, "additionalProperties": {"type": "string"}},
        {**A, "patternProperties": {"^x_": {"type": "integer"}}},
        {"type": "object"},
        {"type": "string"},
        True,
    ):
        assert closed_objects(kept) == kept
    # keys required without a schema of their own are named, so they stay possible
    named = closed_objects({**A, "required": ["a", "z"]})["properties"]
    assert named == {"a": {"type": "integer"}, "z": True}


def test_assemblies_are_left_as_written() -> None:
    for schema in (
        {"allOf": [A, B]},
        {"$defs": {"A": A, "B": B}, "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
        {"type": "object", "properties": {"a": {}, "b": {}}, "anyOf": [A, B]},
    ):
        assert closed_objects(schema) == schema
        assert problem(json_schema(schema, ())) is None  # closing the parts would make it unsatisfiable


@pytest.mark.parametrize(
    ("text", "closed", "opened"),
    [
        ('{"name": "Ann", "age": 3, "home": {"city": "Paris", "country": "FR"}, "past": []}', True, True),
        ('{"name": "Ann", "home": {"city": "Paris", "country": "FR"}}', True, True),
        ('{"name": "Ann", "home": {"city": "Paris", "country": "FR"}, "pet": "cat"}', False, True),
        ('{"name": "Ann", "home": {"city": "Paris", "country": "FR", "zip": 1}}', False, True),
        ('{"name": "A", "home": {"city": "P", "country": "FR"}, "past": [{"city": "R", "country": "DE", "x": 1}]}',  # noqa: E501
         False, True),
    ],
)  # fmt: skip
def test_response_format_refuses_unnamed_keys_unless_open(llg_tokenizer, text, closed, opened) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    for objects, expected in (("closed", closed), ("open", opened)):
        c = constraint_of(fmt, objects)  # type: ignore[arg-type]
        assert c is not None
        assert takes(llg_tokenizer, c, text) is expected, (objects, text)


def test_nested_anyof_and_maps_are_closed_and_opt_ins_kept(llg_tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "shape": {"anyOf": [A, B, {"type": "null"}]},
            "by_name": {"type": "object", "additionalProperties": A},
            "extra": {"properties": {"k": {"type": "integer"}}, "additionalProperties": True},
        },
    }
    c = json_schema(schema, ())
    both = '{"shape": {"a": 1}, "by_name": {"x": {"a": 2}}, "extra": {"k": 1, "q": 2}}'
    assert takes(llg_tokenizer, c, both)
    assert not takes(llg_tokenizer, c, '{"shape": {"a": 1, "b": 2}}')
    assert not takes(llg_tokenizer, c, '{"by_name": {"x": {"a": 2, "c": 3}}}')
    assert not takes(llg_tokenizer, c, '{"shape": null, "other": 1}')


@pytest.mark.parametrize("objects", ["closed", "open"])
def test_tool_parameters_with_refs_compile_and_are_closed(llg_tokenizer, objects: Objects) -> None:
    plan = ToolPlan((Tool("Person", "", Person.model_json_schema()),), "required", "Person", False)
    c = plan_constraint(plan, None, objects)
    assert c is not None and problem(c) is None  # pydantic's #/$defs refs resolve inside the wrapper
    home = {"city": "Paris", "country": "FR"}
    assert takes(llg_tokenizer, c, call_text("Person", {"name": "Ann", "home": home}))
    extra = call_text("Person", {"name": "Ann", "home": {**home, "zip": "75001"}})
    assert takes(llg_tokenizer, c, extra) is (objects == "open")


def test_closing_keeps_the_schema_text_of_an_already_closed_schema() -> None:
    """A schema closed by its author is sent as written: the size the API checks is the client's own."""
    schema = {**A, "additionalProperties": False, "properties": {"a": {"type": "integer"}, "n": B}}
    schema["properties"]["n"] = {**B, "additionalProperties": False}
    assert json_schema(schema, ()).source == json.dumps(schema)


def test_every_bench_extract_task_compiles_closed_and_open_as_a_format_and_a_tool() -> None:
    from shardline.bench.extract import TASKS, unnamed_keys

    for task in TASKS:
        schema = task.model.model_json_schema()
        fmt = {"type": "json_schema", "json_schema": {"name": task.name, "schema": schema}}
        plan = ToolPlan((Tool(task.model.__name__, "", schema),), "required", task.model.__name__, False)
        for objects in ("closed", "open"):
            assert problem(constraint_of(fmt, objects)) is None, task.name  # type: ignore[arg-type]
            assert problem(plan_constraint(plan, None, objects)) is None, task.name  # type: ignore[arg-type]
    person, model = '{"name": "Ann", "age": 3', TASKS[0].model
    assert not unnamed_keys(person + "}", model) and unnamed_keys(person + ', "x": 1}', model)
    assert not unnamed_keys("not json", model)
