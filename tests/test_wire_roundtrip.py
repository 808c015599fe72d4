"""Every variant of every wire union survives dump -> validate, and tolerates fields from a newer sender.

Variants are read from the unions themselves, so a new message or diagnostic is covered without touching this.
"""

from __future__ import annotations

import functools
import json
import math
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter

import shardline.cluster.messages as cluster_messages
import shardline.dataplane.diagnostics as diagnostics
import shardline.dataplane.messages as messages
from shardline.compute.sampling import MAX_BIAS, SamplingParams
from shardline.models.footprint import ModelFootprint

ADAPTERS: dict[str, TypeAdapter[Any]] = {
    f"{module.__name__.rsplit('.', 1)[-1]}.{name}": value
    for module in (messages, cluster_messages, diagnostics)
    for name, value in vars(module).items()
    if isinstance(value, TypeAdapter)
}


def union_variants(adapter: TypeAdapter[Any]) -> list[type[BaseModel]]:
    """The model classes of a discriminated union, read from the adapter's core schema."""
    schema = adapter.core_schema
    definitions: dict[str, Any] = {}
    if schema["type"] == "definitions":
        definitions = {d["ref"]: d for d in schema["definitions"]}
        schema = schema["schema"]
    if schema["type"] == "model":  # a channel of one message
        return [schema["cls"]]
    assert schema["type"] == "tagged-union", f"not a tagged union: {schema['type']}"
    variants = []
    for choice in schema["choices"].values():
        if choice["type"] == "definition-ref":
            choice = definitions[choice["schema_ref"]]
        variants.append(choice["cls"])
    return variants


CASES = [
    pytest.param(adapter, variant, id=f"{name}:{variant.__name__}")
    for name, adapter in ADAPTERS.items()
    for variant in union_variants(adapter)
]


def _bounds(metadata: tuple[Any, ...]) -> dict[str, Any]:
    """Field(ge=..., gt=..., le=..., lt=...) as hypothesis bounds, so generated values are valid."""
    out: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, at.Ge):
            out["min_value"] = item.ge
        elif isinstance(item, at.Gt):
            out["min_value"], out["exclude_min"] = item.gt, True
        elif isinstance(item, at.Le):
            out["max_value"] = item.le
        elif isinstance(item, at.Lt):
            out["max_value"], out["exclude_max"] = item.lt, True
    return out


def _footprint(layers: int, sizes: list[int], small: int, tied: bool) -> ModelFootprint:
    return ModelFootprint(
        name="m",
        layers=layers,
        layer_bytes=(sizes * layers)[:layers],
        embed_bytes=small,
        head_bytes=small,
        tied=tied,
        kv_bytes_per_token_per_layer=small + 1,
        context_length=small + 1,
        hidden_size=small + 1,
        vocab_size=small + 1,
    )


# Models whose validators tie fields together: drawn consistently rather than field by field.
CONSISTENT: dict[Any, st.SearchStrategy[Any]] = {
    ModelFootprint: st.builds(
        _footprint,
        st.integers(1, 8),
        st.lists(st.integers(0, 2**40), min_size=1, max_size=8),
        st.integers(0, 2**30),
        st.booleans(),
    )
}


def strategy_for(tp: Any, metadata: tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    if tp in CONSISTENT:
        return CONSISTENT[tp]
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return st.none()
    if origin is Annotated:
        return strategy_for(args[0], (*metadata, *tp.__metadata__))
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy_for(a, metadata) for a in args))  # bounds apply to the numeric member
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_strategy(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        bounds = _bounds(metadata)
        for key in ("exclude_min", "exclude_max"):  # integers() has no exclusive bounds
            if bounds.pop(key, False):
                edge = "min_value" if key == "exclude_min" else "max_value"
                bounds[edge] += 1 if edge == "min_value" else -1
        return st.integers(**bounds)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False, **_bounds(metadata))
    if tp is str:
        pattern = next((p for m in metadata if isinstance(p := getattr(m, "pattern", None), str)), None)
        return st.from_regex(pattern, fullmatch=True) if pattern else st.text(max_size=12)
    return st.from_type(tp)


@functools.cache
def model_strategy(model: type[BaseModel]) -> st.SearchStrategy[BaseModel]:
    fields = {name: strategy_for(f.annotation, tuple(f.metadata)) for name, f in model.model_fields.items()}
    return st.fixed_dictionaries(fields).map(lambda kw: model(**kw))


def _sampling() -> st.SearchStrategy[SamplingParams]:
    """Settings whose logit_bias names each token once (the model refuses a token named twice)."""
    fields = {
        name: strategy_for(f.annotation, tuple(f.metadata))
        for name, f in SamplingParams.model_fields.items()
        if name != "logit_bias"
    }
    pair = st.tuples(st.integers(0, 2**31), st.floats(-MAX_BIAS, MAX_BIAS))
    bias = st.lists(pair, max_size=3, unique_by=lambda p: p[0]).map(tuple)
    return st.fixed_dictionaries({**fields, "logit_bias": bias}).map(lambda kw: SamplingParams(**kw))


CONSISTENT[SamplingParams] = st.deferred(_sampling)


@pytest.mark.timeout(60)
def test_every_channel_is_enumerated() -> None:
    assert {"messages.RING", "messages.CONTROL", "messages.EVENTS", "messages.STATUS"} <= set(ADAPTERS)
    assert "diagnostics.DIAGNOSTICS" in ADAPTERS
    assert all(union_variants(a) for a in ADAPTERS.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("adapter", "variant"), CASES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_roundtrip(adapter: TypeAdapter[Any], variant: type[BaseModel], data: st.DataObject) -> None:
    value = data.draw(model_strategy(variant))
    assert adapter.validate_json(adapter.dump_json(value)) == value
    assert adapter.validate_json(value.model_dump_json()) == value  # how dataplane.frame encodes


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("adapter", "variant"), CASES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_unknown_extra_field_is_accepted(
    adapter: TypeAdapter[Any], variant: type[BaseModel], data: st.DataObject
) -> None:
    value = data.draw(model_strategy(variant))
    sent = adapter.dump_python(value, mode="json")
    sent["field_from_a_newer_sender"] = {"nested": [1, "two", None]}
    got = adapter.validate_json(json.dumps(sent))
    assert type(got) is type(value)
    extras = set(got.model_extra or ())
    assert got.model_dump(exclude=extras) == value.model_dump()
    if variant.model_config.get("extra") == "allow":  # kept, so a relay forwards it intact
        assert (
            json.loads(adapter.dump_json(got))["field_from_a_newer_sender"]
            == sent["field_from_a_newer_sender"]
        )


@pytest.mark.timeout(30)
def test_infinite_floats_survive_diagnostics() -> None:
    value = diagnostics.Unknown(at=math.inf, line="x")
    assert diagnostics.DIAGNOSTICS.validate_json(diagnostics.DIAGNOSTICS.dump_json(value)) == value
    assert diagnostics.DIAGNOSTICS.validate_json(value.model_dump_json()) == value


@pytest.mark.timeout(30)
def test_infinite_logprob_survives_events() -> None:
    value = messages.TokenEvent(request_id="r", index=0, token=1, logprob=-math.inf)
    assert messages.EVENTS.validate_json(value.model_dump_json()) == value  # as dataplane.frame encodes
