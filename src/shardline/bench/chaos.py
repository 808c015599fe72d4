"""Faults: `shardline bench chaos`, and the fault plans `shardline bench soak` draws.

`bench chaos`: requests against a pipeline whose stages are killed, stalled and aborted. Every output is
compared with a fault-free run of the same requests (greedy), so "completed" means "completed with exactly the
right tokens", not merely "returned something".

The soak's plans are pure (decided here, done by the soak): which nodes a partition cuts off with the master,
and the bodies of the abusive client, sized from the HTTP API's own limits so they stay the largest it
accepts (and the smallest it must refuse) whatever those limits become.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from shardline.errors import RequestError

if TYPE_CHECKING:
    from shardline.engine.engine import Engine

FAULTS = {"kill": signal.SIGKILL, "stall": signal.SIGSTOP, "abort": signal.SIGABRT}
MAX_TOKENS = 16


def _prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(500, vocab - 500) for _ in range(rng.randint(4, 120))] for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int] | str]:
    handles = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    out: list[list[int] | str] = []
    for h in handles:
        try:
            out.append(h.tokens(timeout=900))
        except (RequestError, TimeoutError) as exc:
            out.append(f"error: {exc}")
    return out


def run(
    model: str | None,
    json_path: Path | None,
    requests: int = 8,
    seed: int = 0,
    stages: int = 2,
    faults_max: int = 4,
) -> dict:
    from shardline.engine.engine import Engine, EngineConfig  # MLX: only when the bench runs
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    prompts = _prompts(rng, requests, vocab)
    base = dict(model_dir=model_dir, stages=stages, prefill_step=64)
    print(f"chaos: {requests} requests on {stages} stages, fault-free reference first", file=sys.stderr)
    with Engine(EngineConfig(**base)).start() as engine:
        reference = _run(engine, prompts)

    config = EngineConfig(
        **base,
        heartbeat_s=0.25,
        heartbeat_timeout=2.0,
        step_deadline_floor=2.0,
        max_restarts=1000,
        backoff_s=0.1,
    )
    faults: list[tuple[float, str, int]] = []
    pids: set[int] = set()
    with Engine(config).start() as engine:
        done = threading.Event()

        def chaos() -> None:
            # Faults land at random moments, each after the rebuilt instance has served a while: a fault rate
            # above the recovery rate would only measure a livelock.
            while len(faults) < faults_max and not done.wait(rng.uniform(2.0, 6.0)):
                if not engine.serving or (engine.recoveries and engine.recoveries[-1].recovered_at is None):
                    continue
                stage = rng.randrange(stages)
                kind = rng.choice(sorted(FAULTS))
                pid = engine.runner_pids()[stage]
                pids.update(engine.all_runner_pids())
                faults.append((time.monotonic(), kind, stage))
                try:
                    os.kill(pid, FAULTS[kind])
                except ProcessLookupError:
                    pass

        thread = threading.Thread(target=chaos, daemon=True)
        thread.start()
        outputs = _run(engine, prompts)
        done.set()
        thread.join()
        recoveries = list(engine.recoveries)
        pids.update(engine.all_runner_pids())
    orphans = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    detect = []
    for rec in recoveries:
        before = [t for t, _, _ in faults if t <= rec.detected_at]
        if before:
            detect.append(rec.detected_at - max(before))
    recover = [r.recovered_at - r.detected_at for r in recoveries if r.recovered_at is not None]
    lost = sum(1 for o in outputs if isinstance(o, str))
    result = {
        "model": model_dir.name,
        "stages": stages,
        "seed": seed,
        "requests_total": requests,
        "requests_completed": requests - lost,
        "requests_lost": lost,
        "outputs_mismatched": sum(
            1 for o, r in zip(outputs, reference, strict=True) if not isinstance(o, str) and o != r
        ),
        "faults_injected": len(faults),
        "faults": [{"kind": k, "stage": s} for _, k, s in faults],
        "recoveries": len(recoveries),
        "detect_s_max": max(detect, default=0.0),
        "recover_s_median": statistics.median(recover) if recover else 0.0,
        "recover_s_max": max(recover, default=0.0),
        "orphan_processes": len(orphans),
    }
    for key, value in result.items():
        if key != "faults":
            print(f"{key:22} {value:.2f}" if isinstance(value, float) else f"{key:22} {value}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


# ---- the soak's fault plans (pure) -------------------------------------------------------------------------

OPENAI_BIAS_MAX = 300  # OpenAI's cap on logit_bias entries, where the API names none of its own
OPENAI_N_MAX = 128  # OpenAI's cap on n, likewise
ABUSIVE_PROMPT = "Describe the weather today as a JSON object."
# What the abusive client sends, one a second, in this order: every other one the largest body the API must
# serve, between them each way of going one past a limit (which it must refuse with a 400).
ABUSIVE_PLAN = (
    "largest_accepted",
    "full_vocab_bias",
    "largest_accepted",
    "duplicate_bias",
    "largest_accepted",
    "bias_over_cap",
    "largest_accepted",
    "n_over_cap",
    "largest_accepted",
    "stops_over_cap",
    "largest_accepted",
    "schema_over_cap",
)
ABUSIVE_EXPECTED = {v: 200 if v == "largest_accepted" else 400 for v in ABUSIVE_PLAN}
SCHEMA_PROPERTIES = 32  # the largest schema's properties; the rest of its length is a description


@dataclass(frozen=True)
class ApiLimits:
    """The chat API's caps, read from its code (api/limits.py: api_limits)."""

    n_max: int
    logit_bias_max: int
    logit_bias_max_from: str  # the constant it was read from, or OpenAI's when the API names none
    stops_max: int
    stop_chars_max: int
    schema_chars_max: int
    vocab: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _upper_bound(metadata: Sequence[Any]) -> int | None:
    """A pydantic field's inclusive upper bound (`le`, or `lt` - 1), if it has one."""
    for m in metadata:
        if getattr(m, "le", None) is not None:
            return int(m.le)
        if getattr(m, "lt", None) is not None:
            return int(m.lt) - 1
    return None


def _first(modules: Sequence[Any], name: str) -> tuple[int, str] | None:
    """The int constant `name` of the first module that has it, and where it was found."""
    for mod in modules:
        value = getattr(mod, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{mod.__name__}.{name}"
    return None


def api_limits(vocab: int) -> ApiLimits:
    """The caps as the API holds them now: api/limits.py where it has them, else where each lived before
    (the request model's bound on `n`, api/stops.py, api/response_format.py)."""
    import importlib

    from shardline.api import response_format as formats
    from shardline.api import stops
    from shardline.api.routes import openai as openai_api

    modules: list[Any] = [formats, stops, openai_api]
    try:
        modules.insert(0, importlib.import_module("shardline.api.limits"))
    except ImportError:  # an API from before its caps had a module of their own
        pass
    n_caps = [_upper_bound(openai_api.ChatRequest.model_fields["n"].metadata)]
    n_caps.append(c[0] if (c := _first(modules, "MAX_CHOICES")) else None)
    n_max = min((c for c in n_caps if c is not None), default=OPENAI_N_MAX)
    bias = _first(modules, "MAX_LOGIT_BIAS") or (OPENAI_BIAS_MAX, "OpenAI's (the API names no cap)")
    caps = {}
    for name in ("MAX_STOPS", "MAX_STOP_CHARS", "MAX_SCHEMA_CHARS"):
        found = _first(modules, name)
        if found is None:
            raise RuntimeError(f"the API names no {name}: the abusive client cannot size its bodies")
        caps[name] = found[0]
    return ApiLimits(
        n_max=n_max,
        logit_bias_max=min(bias[0], vocab),
        logit_bias_max_from=bias[1],
        stops_max=caps["MAX_STOPS"],
        stop_chars_max=caps["MAX_STOP_CHARS"],
        schema_chars_max=caps["MAX_SCHEMA_CHARS"],
        vocab=vocab,
    )


def largest_schema(chars: int, properties: int = SCHEMA_PROPERTIES) -> dict[str, Any]:
    """A JSON schema whose text (what the API measures: `json.dumps`) is exactly `chars` long: an object of
    optional short strings, padded with a description (cheap to compile: the length is the point)."""
    props = {f"field_{i:03d}": {"type": "string", "maxLength": 16} for i in range(properties)}
    schema: dict[str, Any] = {"type": "object", "description": "", "properties": props}
    schema["additionalProperties"] = False
    pad = chars - len(json.dumps(schema))
    if pad < 0:
        raise ValueError(f"a schema of {properties} properties is longer than {chars} characters")
    schema["description"] = "x" * pad
    return schema


def _bias(ids: Sequence[int], rng: random.Random) -> dict[str, float]:
    return {str(t): round(rng.uniform(-100.0, 100.0), 2) for t in ids}


def abusive_body(variant: str, limits: ApiLimits, model: str, max_tokens: int, seed: int) -> dict[str, Any]:
    """The chat completion body of one abusive variant (ABUSIVE_PLAN): the largest the API accepts in every
    parameter at once, or one parameter one past its cap (a full-vocabulary or duplicated logit_bias too)."""
    if variant not in ABUSIVE_EXPECTED:
        raise ValueError(f"unknown abusive variant {variant!r}: one of {sorted(ABUSIVE_EXPECTED)}")
    rng = random.Random(f"{seed}:{variant}")
    spread = rng.sample(range(limits.vocab), min(limits.vocab, limits.logit_bias_max + 1))
    stop_text = "".join(
        chr(rng.randrange(0x41, 0x5B)) for _ in range(limits.stop_chars_max * limits.stops_max)
    )
    stops = [
        stop_text[i : i + limits.stop_chars_max] for i in range(0, len(stop_text), limits.stop_chars_max)
    ]
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": ABUSIVE_PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "n": limits.n_max,
        "logit_bias": _bias(spread[: limits.logit_bias_max], rng),
        "stop": stops,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": largest_schema(limits.schema_chars_max)},
        },
    }
    if variant == "full_vocab_bias":
        body["logit_bias"] = _bias(range(limits.vocab), rng)
    elif variant == "duplicate_bias":
        # Distinct keys, half as many distinct ids: "7" and "07" name one token.
        half = [str(t) for t in spread[: limits.logit_bias_max // 2]]
        body["logit_bias"] = {k: 1.0 for t in half for k in (t, "0" + t)}
    elif variant == "bias_over_cap":
        body["logit_bias"] = _bias(spread[: limits.logit_bias_max + 1], rng)
    elif variant == "n_over_cap":
        body["n"] = limits.n_max + 1
    elif variant == "stops_over_cap":
        body["stop"] = [*stops, stops[0][::-1]]
    elif variant == "schema_over_cap":
        schema = largest_schema(limits.schema_chars_max + 1)
        body["response_format"]["json_schema"]["schema"] = schema
    return body


def abusive_outcome(status: int) -> str:
    """An abusive request's answer: served (200), refused with a 400, or a failure (anything else)."""
    if status == 200:
        return "served"
    if status == 400:
        return "refused_400"
    return "failure"


def partition_sides(ids: Sequence[str], master: str, rng: random.Random) -> tuple[list[str], list[str]]:
    """(minority, majority): the master and one other node (the master alone below five nodes, so the other
    side still holds a majority) against the rest."""
    if master not in ids:
        raise ValueError(f"master {master!r} is not one of {list(ids)}")
    if len(ids) < 3:
        raise ValueError(f"a partition needs at least 3 nodes (a majority on one side), not {len(ids)}")
    size = max(1, min(2, (len(ids) - 1) // 2))
    others = [n for n in ids if n != master]
    minority = [master, *sorted(rng.sample(others, size - 1))]
    return minority, [n for n in ids if n not in minority]
