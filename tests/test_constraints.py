"""Constrained decoding's pure parts on the default model's tokenizer: the allowed-token mask, the matcher
cache rebuilt from the output, masked sampling in a batched step, and the API's parsing of formats."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from shardline.api.errors import ApiError
from shardline.api.response_format import checked, constraint_of, logit_bias_of
from shardline.compute.constraints import Constraint, Matchers, json_schema, problem
from shardline.compute.sampling import SamplingParams, sample
from shardline.dataplane.messages import BATCH_ID, Row, Step
from shardline.runner.stage import Held, finish
from shardline.testing.cluster import FAST_RUNNERS as FAST

END = (2,)  # the default model's <|im_end|>

SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"type": "null"}]},
            "kind": {"enum": ["a", "b"]},
        },
        "required": ["value", "kind"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tokenizer_json(model_dir: Path) -> Path:
    return model_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def hf(tokenizer_json: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json))


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _allowed(mask: np.ndarray) -> list[int]:
    return [int(t) for t in np.nonzero(mask)[0]]


@pytest.mark.timeout(120)
def test_mask_opens_an_object_and_ends_only_once_the_grammar_accepts(model_dir, tokenizer_json, hf):
    vocab = _vocab(model_dir)
    m = Matchers(tokenizer_json)
    c = json_schema(SCHEMAS[0], END)
    first = _allowed(m.mask("r", c, [], vocab))
    assert first and all(hf.decode([t]).startswith("{") for t in first)
    assert END[0] not in first

    half = hf.encode('{"name": "Bo', add_special_tokens=False).ids
    middle = m.mask("r", c, half, vocab)
    assert not middle[END[0]] and middle.sum() > 1  # inside a string: many tokens, never the end

    whole = hf.encode('{"name": "Bob", "age": 42}', add_special_tokens=False).ids
    assert _allowed(m.mask("r", c, whole, vocab)) == [END[0]]  # complete: the end, alone

    # A regex that accepts and may go on: the end is allowed beside more of it.
    more = Constraint(kind="regex", source="a(b)*", end=END)
    ab = hf.encode("ab", add_special_tokens=False).ids
    after = _allowed(m.mask("x", more, ab, vocab))
    assert END[0] in after and len(after) > 1
    assert all(set(hf.decode([t])) <= {"b"} for t in after if t != END[0])


@pytest.mark.timeout(120)
def test_a_grammar_is_compiled_once_for_every_request_that_uses_it_each_within_an_announced_grace(
    model_dir, tokenizer_json, hf, monkeypatch
):
    """The n choices of one request (and later requests with the same constraint) share one compile: each
    matcher is a copy of it, and masks are what a matcher compiled for the request alone gives. The build
    and each compile are announced before they start, sized to their input."""
    from contextlib import contextmanager

    from llguidance import LLMatcher

    from shardline.compute.constraints import allowed, compile_grace_s, grammar_of, tokenizer_grace_s

    announced: list[float] = []

    @contextmanager
    def grace(seconds: float):
        announced.append(seconds)
        yield

    vocab = _vocab(model_dir)
    m = Matchers(tokenizer_json, grace=grace)
    m.load(vocab)
    assert m.loaded and announced == [tokenizer_grace_s(tokenizer_json.stat().st_size)]
    c, other = json_schema(SCHEMAS[0], END), json_schema(SCHEMAS[1], END)
    outputs = ["", '{"na', '{"name": "Al', '{"name": "Bob", "age": 4']
    ids = [hf.encode(o, add_special_tokens=False).ids for o in outputs]
    got = m.masks([(f"choice-{i}", c, out) for i, out in enumerate(ids)], vocab)
    m.masks([("other", other, [])], vocab)
    again = m.mask("later", c, ids[2], vocab)
    assert announced[1:] == [compile_grace_s(len(grammar_of(c))), compile_grace_s(len(grammar_of(other)))]
    tok = m.tokenizer(vocab)
    for out, mask in zip(ids, got, strict=True):
        alone = LLMatcher(tok, grammar_of(c), log_level=0)
        alone.consume_tokens(out)
        assert np.array_equal(mask, allowed(alone, END, vocab, list(tok.eos_tokens)))
    assert np.array_equal(again, got[2])
    # Past the budget of kept grammars only the newest stays: an older one is compiled again when next used.
    from shardline.compute import constraints

    monkeypatch.setattr(constraints, "COMPILED_KEPT_CHARS", 0)
    m.mask("newest", other, [], vocab)
    assert np.array_equal(m.mask("evicted", c, ids[2], vocab), got[2])
    assert len(announced) == 4 and announced[3] == announced[1]
    m.close()


@pytest.mark.timeout(120)
def test_matcher_state_is_a_function_of_the_output(model_dir, tokenizer_json, hf):
    """A matcher advanced token by token, one rebuilt from the whole output, and one out of step (another
    output for the same request) all give the mask a fresh matcher gives."""
    vocab = _vocab(model_dir)
    c = json_schema(SCHEMAS[2], END)
    ids = hf.encode('{"user": {"id": 7, "admin": true}, "note": "hi', add_special_tokens=False).ids
    stepped = Matchers(tokenizer_json)
    for n in range(len(ids) + 1):
        got = stepped.mask("r", c, ids[:n], vocab)
    fresh = Matchers(tokenizer_json).mask("r", c, ids, vocab)
    assert np.array_equal(got, fresh)
    other = hf.encode('{"user": {"id": 123', add_special_tokens=False).ids
    diverged = stepped.mask("r", c, other, vocab)  # a resubmitted request with another history
    assert np.array_equal(diverged, Matchers(tokenizer_json).mask("q", c, other, vocab))
    assert not np.array_equal(diverged, fresh)
    shorter = stepped.mask("r", c, ids[:3], vocab)  # behind the cache: rebuilt, not advanced
    assert np.array_equal(shorter, Matchers(tokenizer_json).mask("q", c, ids[:3], vocab))
    stepped.release("r")
    stepped.close()


def _batched(rows: list[tuple[str, SamplingParams, list[int]]], step: int) -> Step:
    return Step(
        seq=step,
        request_id=BATCH_ID,
        pos=0,
        n=len(rows),
        sample=True,
        rows=[Row(request_id=rid, pos=10 + step) for rid, _, _ in rows],
    )


def _held(rows: list[tuple[str, SamplingParams, list[int]]]) -> dict[str, Held]:
    """What the sampling stage holds for these rows: their settings and (the same lists of) their output."""
    return {rid: Held(sp, False, deque(), out) for rid, sp, out in rows}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_rows_of_a_batch_write_valid_json_and_the_free_row_is_unchanged(
    model_dir, tokenizer_json, hf, temperature
):
    """Random logits, every schema's row in one batched step with an unconstrained row: each constrained
    row ends with output its schema validates, the free row samples what it samples alone."""
    vocab = _vocab(model_dir)
    m = Matchers(tokenizer_json)
    settings = [
        SamplingParams(temperature=temperature, top_p=0.9, seed=i, constraint=json_schema(s, END))
        for i, s in enumerate(SCHEMAS)
    ]
    free = SamplingParams(temperature=temperature, seed=99)
    outputs: list[list[int]] = [[] for _ in SCHEMAS]
    ended = [False] * len(SCHEMAS)
    for step in range(120):
        live = [i for i in range(len(SCHEMAS)) if not ended[i]]
        if not live:
            break
        rows = [(f"r{i}", settings[i], outputs[i]) for i in live] + [("free", free, [])]
        y = mx.random.normal((len(rows), vocab), key=mx.random.key(step)) * 4
        result, _ = finish(_batched(rows, step), y, _held(rows), m)
        for i, r in zip(live, result.rows, strict=False):
            assert r.logprob is not None and math.isfinite(r.logprob)
            if r.token in END:
                ended[i] = True
            else:
                outputs[i].append(r.token)
        alone = sample(y[-1], free, 10 + step + 1, [], []).token
        assert result.rows[-1].token == alone
    assert all(ended), [hf.decode(o) for o in outputs]
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        jsonschema.validate(json.loads(hf.decode(out)), schema)
    m.close()


@pytest.mark.timeout(60)
def test_greedy_under_a_mask_is_the_best_allowed_token(model_dir, tokenizer_json):
    vocab = _vocab(model_dir)
    m = Matchers(tokenizer_json)
    c = json_schema({"type": "object"}, END)
    allowed = m.mask("r", c, [], vocab)
    logits = mx.random.normal((vocab,), key=mx.random.key(3))
    s = sample(logits, SamplingParams(temperature=0.0, top_logprobs=2), 5, [], [], mx.array(allowed))
    masked = np.where(allowed, np.array(logits), -np.inf)
    assert s.token == int(np.argmax(masked))
    expected = -np.log(np.exp(masked - masked.max()).sum())  # the best one's log-probability
    assert s.logprob == pytest.approx(float(expected), abs=1e-4)
    native = sample(logits, SamplingParams(temperature=0.0), 5, [], [], mx.array(allowed))
    assert native.token == s.token and native.logprob == pytest.approx(s.logprob, abs=1e-4)
    m.close()


@pytest.mark.timeout(30)
def test_logit_bias_moves_the_pick():
    logits = mx.array([0.0, 3.0, 1.0, -2.0])
    assert sample(logits, SamplingParams(), 0, []).token == 1
    assert sample(logits, SamplingParams(logit_bias=((3, 100.0),)), 0, []).token == 3
    assert sample(logits, SamplingParams(logit_bias=((1, -100.0),)), 0, []).token == 2
    assert sample(logits, SamplingParams(logit_bias=((9, 100.0),)), 0, []).token == 1  # outside: ignored


@pytest.mark.timeout(60)
def test_response_format_parsing_and_its_errors_name_the_parameter():
    assert constraint_of(None) is None and constraint_of({"type": "text"}) is None
    assert json.loads(constraint_of({"type": "json_object"}).source) == {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0], "strict": True}}
    c = checked(constraint_of(fmt))
    assert c is not None and json.loads(c.source) == SCHEMAS[0]
    assert list(json.loads(c.source)["properties"]) == ["name", "age"]  # the schema's order, kept
    bad = [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes", "schema": {}}},
    ]
    for fmt in bad:
        with pytest.raises(ApiError) as err:
            constraint_of(fmt)
        assert err.value.status == 400 and err.value.param == "response_format"
    invalid = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}
    assert problem(constraint_of(invalid)) is not None
    with pytest.raises(ApiError) as err:
        checked(constraint_of(invalid))
    assert err.value.param == "response_format" and "strin" in err.value.message
    assert logit_bias_of({"5": 1, "2": -100}) == ((2, -100.0), (5, 1.0))
    for bias in ({"x": 1}, {"-1": 1}, {"3": 101}):
        with pytest.raises(ApiError) as err:
            logit_bias_of(bias)
        assert err.value.param == "logit_bias"


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A tiny model with the default model's tokenizer files. Its head is smaller than the tokenizer (49,152
    tokens): masks are cut to the model's vocabulary."""
    import shutil

    from shardline.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-tok") / "model", "qwen2", vocab=2048)
    for f in model_dir.glob("tokenizer*.json"):
        shutil.copy(f, model / f.name)
    return model


@pytest.mark.timeout(180)
def test_a_constraint_that_fails_in_the_runner_ends_its_own_request_not_the_stage(
    tiny_with_tokenizer: Path, start_engine
) -> None:
    """The API refuses a grammar that does not compile; a request that reaches a runner anyway (the engine's
    own submit checks nothing of it) must not take the stage, and every request on it, down with it."""
    engine = start_engine(tiny_with_tokenizer, 2)
    broken = SamplingParams(constraint=Constraint(kind="regex", source="(", end=(1,)))
    assert (
        len(engine.submit([5, 6, 7], max_tokens=8, sampling=broken, stop_tokens=[1]).tokens(timeout=60)) <= 1
    )
    digits = SamplingParams(constraint=Constraint(kind="regex", source="[0-9]{3}", end=(1,)))
    out = engine.submit([5, 6, 7], max_tokens=8, sampling=digits, stop_tokens=[1]).tokens(timeout=60)
    assert len(engine.submit([5, 6, 7], max_tokens=8).tokens(timeout=60)) == 8
    assert engine.recoveries == []
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text = load_tokenizer(tiny_with_tokenizer).decode([t for t in out if t != 1])
    assert len(text) == 3 and text.isdigit(), text


@pytest.mark.timeout(180)
def test_a_tokenizer_build_that_holds_the_gil_past_the_heartbeat_timeout_stalls_no_stage(
    tiny_with_tokenizer: Path, start_engine
) -> None:
    """Building the constraint tokenizer holds the GIL (0.3 s for this 49k vocabulary on an idle machine,
    seconds on a loaded one or for a larger vocabulary), so the runner's heartbeat cannot beat meanwhile. Here
    it holds it past the heartbeat timeout in every generation: no stage may be called stalled for it, and
    constrained requests are served as without it."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from shardline.instance.spec import Fault

    hold = Fault(phase="load", action="hold_gil", seconds=FAST["heartbeat_timeout"] + 1.0)
    engine = start_engine(
        tiny_with_tokenizer, 2, faults={0: hold, 1: hold}, faults_every_generation=True, **FAST
    )
    digits = SamplingParams(constraint=Constraint(kind="regex", source="[0-9]{3}", end=(1,)))
    first = engine.submit([5, 6, 7], max_tokens=8, sampling=digits, stop_tokens=[1]).tokens(timeout=60)
    again = engine.submit([5, 6, 7], max_tokens=8, sampling=digits, stop_tokens=[1]).tokens(timeout=60)
    assert engine.recoveries == []
    assert first == again
    text = load_tokenizer(tiny_with_tokenizer).decode([t for t in first if t != 1])
    assert len(text) == 3 and text.isdigit(), text
