"""Constrained decoding: which tokens a request may sample next, from a grammar and its output so far.

A `Constraint` is a small serialisable spec that travels with the request's sampling settings (never a
Python object): a JSON schema, a Lark grammar or a regex, and the tokens that end the output. The grammar
engine is llguidance, over the tokenizer the model ships (tokenizer.json).

The stage that samples keeps one matcher per request (`Matchers`), a cache only: the allowed tokens are a
pure function of (constraint, output tokens so far), and a matcher missing or out of step with the row's
output is rebuilt from it. So a resumed, resubmitted or cancelled request needs nothing from this cache.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

log = logging.getLogger("shardline.constraints")

# Compact JSON, one fixed separator each: a small model given free whitespace can fill max_tokens with it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Whether an object schema that does not say which other keys it takes takes none (closed, as xgrammar's
# strict mode and OpenAI's strict schemas have it) or any (open, JSON Schema's own default). Open, a small
# model adds keys until max_tokens; closed, it writes the keys the schema names and stops.
Objects = Literal["closed", "open"]
OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")  # a schema's own say


class Constraint(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Literal["json_schema", "lark", "regex"]
    source: str  # the schema as JSON text, the Lark grammar, or the regex
    end: tuple[int, ...]  # tokens that end the output: allowed only once the grammar accepts


def json_schema(schema: dict[str, Any] | bool, end: Iterable[int], objects: Objects = "closed") -> Constraint:
    # The key order is kept: properties come out in the order the schema lists them.
    if objects == "closed":
        schema = closed_objects(schema)
    return Constraint(kind="json_schema", source=json.dumps(schema), end=tuple(end))


def any_json_object(end: Iterable[int]) -> Constraint:
    return json_schema({"type": "object"}, end)


# ---- objects closed by default ---------------------------------------------------------------------------

_DEFS = ("$defs", "definitions")
_NAMED = ("properties", "patternProperties", *_DEFS)  # maps of name -> schema
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "contains")  # a schema
_MANY = ("prefixItems", "items", "anyOf", "oneOf", "allOf")  # lists of schemas


def closed_objects(schema: Any) -> Any:
    """The schema with every object that names its keys (`properties`) and says nothing of others
    (additionalProperties, patternProperties, unevaluatedProperties) closed: `additionalProperties: false`,
    keys it requires without describing them named too. A copy; the schema passed is left as it is.

    Objects assembled from several schemas (allOf, or `properties` beside anyOf/oneOf/$ref) are left as
    written, and so are the definitions such an assembly refers to: the keys of one part are extra keys
    to another, so closing each part would refuse the whole. `not`, if/then/else and the like are left
    too (closing under `not` would open)."""
    if not isinstance(schema, dict):
        return schema
    return _close(schema, _assembled_refs(schema), closable=True)


def _assembling(s: dict[str, Any]) -> bool:
    """Whether s is the intersection of its own keywords with other schemas' (its members or its ref)."""
    beside = any(k in s for k in ("anyOf", "oneOf", "$ref"))
    return "allOf" in s or (beside and isinstance(s.get("properties"), dict))


def _parts(s: dict[str, Any]) -> list[Any]:
    """The schemas an assembly intersects with its own keywords."""
    parts: list[Any] = [{"$ref": s["$ref"]}] if "$ref" in s else []
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            parts += s[key]
    return parts


def _subschemas(s: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key, value in s.items():
        if key in _NAMED and isinstance(value, dict):
            out += value.values()
        elif (key in _ONE and isinstance(value, dict)) or (key in _MANY and isinstance(value, list)):
            out += [value] if isinstance(value, dict) else value
    return out


def _assembled_refs(root: dict[str, Any]) -> set[str]:
    """The definitions (`#/$defs/NAME`, `#/definitions/NAME`) that some assembly refers to directly."""
    refs: set[str] = set()
    stack: list[Any] = [root]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        if _assembling(s):
            refs |= {p["$ref"] for p in _parts(s) if isinstance(p, dict) and isinstance(p.get("$ref"), str)}
        stack += _subschemas(s)
    return refs


def _close(s: Any, assembled: set[str], closable: bool) -> Any:
    if not isinstance(s, dict):
        return s
    whole = not _assembling(s)
    out: dict[str, Any] = {}
    for key, value in s.items():
        if key in _NAMED and isinstance(value, dict):
            prefix = f"#/{key}/" if key in _DEFS else None
            out[key] = {
                name: _close(sub, assembled, prefix is None or prefix + name not in assembled)
                for name, sub in value.items()
            }
        elif key in _ONE and isinstance(value, dict):
            out[key] = _close(value, assembled, True)
        elif key in _MANY and isinstance(value, list):
            # an assembly's parts are not whole objects; array items always are
            members = whole or key in ("prefixItems", "items")
            out[key] = [_close(sub, assembled, members) for sub in value]
        else:
            out[key] = value
    props = out.get("properties")
    if closable and whole and isinstance(props, dict) and not any(k in out for k in OPENERS):
        required = out.get("required")
        required = required if isinstance(required, list) else []
        named = [r for r in required if isinstance(r, str) and r not in props]
        if named:
            out["properties"] = {**props, **dict.fromkeys(named, True)}
        out["additionalProperties"] = False
    return out


def grammar_of(c: Constraint) -> str:
    """The llguidance grammar of a constraint (pure; compiled against a tokenizer by the matcher)."""
    from llguidance import LLMatcher

    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind == "lark":
        return LLMatcher.grammar_from_lark(c.source)
    return LLMatcher.grammar_from_regex(c.source)


def problem(c: Constraint) -> str | None:
    """Why the constraint cannot be compiled (an invalid schema, an unsupported keyword), or None."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_of(c))
    except ValueError as exc:
        return str(exc)
    return error or None


# ---- what the work may take ---------------------------------------------------------------------------

# Bounds of the two costly steps, per unit of their input, for a heavily loaded machine. Measured on an idle
# one: building the tokenizer of the default model (a 3.5 MB tokenizer.json, 49k tokens) takes 0.38 s, all
# of it holding the GIL (~0.11 us a byte; a loaded machine took ~10x); compiling the grammar of a 200,000
# character JSON schema (181,000 characters of grammar) takes 0.5 s with the GIL released (~2.8 us a
# character). A bound errs long: it only delays calling a runner that hangs in this work stalled.
TOKENIZER_S_PER_BYTE = 2e-6
COMPILE_S_PER_CHAR = 2e-5
# Compiled grammars kept for later requests (a client repeats its schema), newest first, up to this much
# grammar: a compiled grammar takes ~70 bytes a character (12.8 MB for the schema above), so ~35 MB. Copies
# held by live requests share their grammar and cost ~0.1 MB each.
COMPILED_KEPT_CHARS = 500_000


def tokenizer_grace_s(tokenizer_bytes: int) -> float:
    """How long building the constraint tokenizer from a tokenizer.json of this size may take."""
    return TOKENIZER_S_PER_BYTE * tokenizer_bytes


def compile_grace_s(grammar_chars: int) -> float:
    """How long compiling a grammar of this size against the tokenizer may take."""
    return COMPILE_S_PER_CHAR * grammar_chars


def _no_grace(seconds: float) -> AbstractContextManager[object]:
    return nullcontext()


# ---- the mask ------------------------------------------------------------------------------------------


def allowed(matcher: Any, end: tuple[int, ...], vocab: int, engine_eos: list[int]) -> np.ndarray:
    """(vocab,) bool: the tokens the matcher allows next. The end tokens are ours, not the engine's EOS:
    allowed when the grammar accepts, and alone once it is complete (or broken: the request then ends)."""
    only_end = np.zeros(vocab, dtype=bool)
    only_end[[t for t in end if t < vocab]] = True
    if matcher.is_stopped():
        if matcher.is_error():
            log.warning("constraint matcher in error, ending the output: %s", matcher.get_error())
        return only_end
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    mask = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.shape[0])
    mask[:n] = bits[:n].astype(bool)
    mask[[t for t in engine_eos if t < vocab]] = False
    if matcher.is_accepting():
        mask |= only_end
    return mask if mask.any() else only_end


@dataclass
class _Entry:
    constraint: Constraint
    matcher: Any
    tokens: list[int]  # the output the matcher has consumed


class Matchers:
    """One stage's matchers, per request, and the tokenizer they share (built by `load`, at the stage's
    warm-up, or at first use).

    Every matcher call runs on one worker thread (a matcher is not thread-safe): `prepare` starts a step's
    masks there as the step arrives, so they are computed while the stage runs its layers, and `masks`
    collects them (or computes those not prepared).

    A grammar is compiled once and each request's matcher copied from it (a copy costs microseconds, a
    compile up to seconds): the n choices of one request share one compile, and so do later requests with
    the same constraint. `grace(seconds)` wraps each costly piece of work, sized to it: the runner tells its
    controller how long that work may take before it starts."""

    def __init__(
        self,
        tokenizer_json: Path | None,
        grace: Callable[[float], AbstractContextManager[object]] = _no_grace,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.grace = grace
        self._tokenizer: Any = None
        self._vocab = 0
        self._entries: dict[str, _Entry] = {}
        # never-advanced matchers and their grammar's length, newest last
        self._compiled: OrderedDict[Constraint, tuple[Any, int]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._prepared: dict[tuple[str, int, int], Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.on_build: Callable[[], None] | None = None  # injected faults: at the tokenizer's build

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    @property
    def available(self) -> bool:
        """Whether the model ships the tokenizer constrained decoding needs."""
        return self.tokenizer_json is not None and self.tokenizer_json.is_file()

    def load(self, vocab: int) -> None:
        """Build the tokenizer now, on the worker thread, and wait for it: at warm-up, under the load
        deadline, rather than in a request's step."""
        self._run(lambda: self.tokenizer(vocab)).result()

    def _build(self, **kw: Any) -> Any:
        from llguidance import LLTokenizer

        assert self.tokenizer_json is not None
        # The build holds the GIL throughout (no other thread of the process runs, its heartbeat included).
        with self.grace(tokenizer_grace_s(self.tokenizer_json.stat().st_size)):
            if self.on_build is not None:
                self.on_build()
            return LLTokenizer(str(self.tokenizer_json), **kw)

    def tokenizer(self, vocab: int) -> Any:
        if self._tokenizer is None or self._vocab != vocab:
            if not self.available:
                raise FileNotFoundError("constrained decoding needs the model's tokenizer.json")
            tok = self._build()
            # A head padded past the tokenizer's tokens (common) needs them counted; a head smaller than the
            # tokenizer (tiny test models) takes the first `vocab` bits of each mask.
            self._tokenizer = tok if tok.vocab_size >= vocab else self._build(n_vocab=vocab)
            self._vocab = vocab
            self._entries.clear()
            self._compiled.clear()
        return self._tokenizer

    def _matcher(self, c: Constraint, tok: Any) -> Any:
        """A fresh matcher of the constraint: a copy of its compiled grammar, compiled on first use."""
        from llguidance import LLMatcher

        kept = self._compiled.get(c)
        if kept is None:
            grammar = grammar_of(c)
            # The compile releases the GIL, but the step that needs its mask waits for it.
            with self.grace(compile_grace_s(len(grammar))):
                kept = (LLMatcher(tok, grammar, log_level=0), len(grammar))
            self._compiled[c] = kept
        self._compiled.move_to_end(c)
        while len(self._compiled) > 1 and sum(n for _, n in self._compiled.values()) > COMPILED_KEPT_CHARS:
            self._compiled.popitem(last=False)
        return kept[0].deep_copy()

    def mask(self, request_id: str, c: Constraint, output: list[int], vocab: int) -> np.ndarray:
        """The allowed tokens after `output`: the cached matcher advanced, or rebuilt when out of step.
        A constraint that fails here ends its own request (only its end tokens are allowed), never the
        stage: a stage failure would fail every request on it, and the retry would fail again."""
        try:
            return self._mask(request_id, c, output, vocab)
        except Exception:
            log.exception("constraint of request %s failed; ending its output", request_id)
            self._entries.pop(request_id, None)
            only_end = np.zeros(vocab, dtype=bool)
            only_end[[t for t in c.end if t < vocab]] = True
            return only_end

    def _mask(self, request_id: str, c: Constraint, output: list[int], vocab: int) -> np.ndarray:
        tok = self.tokenizer(vocab)
        e = self._entries.get(request_id)
        n = len(e.tokens) if e is not None else 0
        if e is None or e.constraint != c or n > len(output) or output[:n] != e.tokens:
            e = self._entries[request_id] = _Entry(c, self._matcher(c, tok), [])
        if len(output) > len(e.tokens):
            e.matcher.consume_tokens(output[len(e.tokens) :])  # a refused token leaves it in error
            e.tokens = list(output)
        return allowed(e.matcher, c.end, vocab, list(tok.eos_tokens))

    def release(self, request_id: str) -> None:
        for key in [k for k in self._prepared if k[0] == request_id]:
            self._prepared.pop(key).cancel()
        if request_id in self._entries:
            self._run(lambda: self._entries.pop(request_id, None))

    def _run(self, fn: Any) -> Future[Any]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="constraints")
            return self._pool.submit(fn)

    def prepare(self, rows: list[tuple[str, Constraint, list[int]]], vocab: int) -> None:
        """Start these rows' masks on the worker thread; `masks` takes them."""
        for rid, c, output in rows:
            key = (rid, len(output), vocab)  # a mask prepared for another width is not this one
            if key not in self._prepared:
                self._prepared[key] = self._run(lambda r=rid, c=c, o=output: self.mask(r, c, o, vocab))

    def masks(self, rows: list[tuple[str, Constraint, list[int]]], vocab: int) -> list[np.ndarray]:
        self.prepare(rows, vocab)
        futures = [self._prepared.pop((rid, len(output), vocab)) for rid, _, output in rows]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
