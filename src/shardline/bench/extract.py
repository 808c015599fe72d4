"""`shardline bench extract`: the share of structured extractions that finish on the default model, through
the clients people use for them, with schema objects open (JSON Schema's default) and closed (shardline's).

One 2-node cluster serves the model once; node c keeps objects closed, node o is started with
`--structured-objects open`, and every extraction is sent to both, so the two columns differ only in that
setting. The clients (`pip install 'shardline[bench-clients]'`), and the schema each sends:
- instructor: tools mode (a forced call, pydantic's schema as it is), JSON_SCHEMA mode (response_format
  json_schema, as it is) and JSON mode (response_format json_object with the schema in the prompt: no
  schema reaches the grammar, so the setting cannot change it);
- langchain-openai's `with_structured_output`: its default method (response_format json_schema, strict,
  objects closed by the client itself) and `function_calling` (a forced call, the schema as it is);
- pydantic-ai's Agent with an output type (a `final_result` tool, strict: closed by the client).

An extraction finishes when the client returns a valid object from its first attempt (retries off) and no
answer stopped at max_tokens; an object with keys its schema does not name (which pydantic ignores) is
counted apart. Each task is a small pydantic model (a person, an address, an invoice line,
a list of items, nested models, optional fields, enums) and a sentence to read it from; greedy decoding.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import date
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from shardline.bench.machine import describe
from shardline.compute.constraints import closed_objects
from shardline.models.registry import resolve_model
from shardline.testing.cluster import MODEL_RUNNERS, LocalCluster

PIP = "pip install 'shardline[bench-clients]'"
SETTINGS = ("open", "closed")
CLIENTS = (
    "instructor-tools",
    "instructor-json-schema",
    "instructor-json",
    "langchain",
    "langchain-tools",
    "pydantic-ai",
)
SYSTEM = "Extract the requested information from the user's text."


# ---- the tasks ---------------------------------------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str
    postcode: str
    country: str


class InvoiceLine(BaseModel):
    description: str
    quantity: int
    unit_price: float


class Item(BaseModel):
    name: str
    price: float


class ShoppingList(BaseModel):
    items: list[str]


class Order(BaseModel):
    order_id: str
    items: list[Item]


class Contact(BaseModel):
    name: str
    email: str
    phone: str | None = None


class Employee(BaseModel):
    name: str
    address: Address


class Priority(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"


class Ticket(BaseModel):
    title: str
    priority: Priority


class Sentiment(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    confidence: float


class Meeting(BaseModel):
    topic: str
    day: date
    attendees: list[str]


class Book(BaseModel):
    title: str
    author: str
    year: int | None = None


class Weather(BaseModel):
    city: str
    temperature_c: float
    raining: bool


class Company(BaseModel):
    name: str
    founded: int
    ceo: Person


@dataclass(frozen=True)
class Task:
    name: str
    model: type[BaseModel]
    text: str


TASKS = [
    Task("person", Person, "Maria Lopez is 34 years old and works as a nurse."),
    Task("address", Address, "Send it to 12 Baker Street, London, NW1 6XE, United Kingdom."),
    Task("invoice_line", InvoiceLine, "3 boxes of printer paper at 4.50 each."),
    Task("shopping_list", ShoppingList, "We need milk, eggs, bread and two apples."),
    Task("order", Order, "Order A-1042: a lamp for 25.00 and a rug for 80.50."),
    Task("contact_optional", Contact, "Reach Tom Baker at tom@example.com."),
    Task("employee_nested", Employee, "Ana Silva lives at 5 Rua Augusta, Lisbon, 1100-048, Portugal."),
    Task("ticket_enum", Ticket, "URGENT: the login page is down for every customer."),
    Task("sentiment_literal", Sentiment, "I absolutely loved the concert last night!"),
    Task("meeting", Meeting, "Budget review on 2024-05-14 with Alice, Bob and Chen."),
    Task("book_optional", Book, "Dune was written by Frank Herbert in 1965."),
    Task("weather", Weather, "It is 18.5 degrees and raining in Dublin today."),
    Task("company_nested", Company, "Acme Corp was founded in 1999; its CEO is Jane Roe, aged 52."),
]


# ---- one extraction ----------------------------------------------------------------------------------------


@dataclass
class Extraction:
    client: str
    objects: str
    task: str
    finished: bool = False
    length: bool = False  # some answer stopped at max_tokens
    extra_keys: bool = False  # the object the model wrote has keys its schema does not name
    error: str = ""
    seconds: float = 0.0
    raw: str = ""  # the JSON the model wrote (the call's arguments, or the content)


def _instructor(api: str, model: str, mode_name: str, max_tokens: int) -> Callable[[Task, Extraction], None]:
    import instructor
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0, timeout=600),
        mode=getattr(instructor.Mode, mode_name),
    )

    def one(task: Task, out: Extraction) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.text}]
        try:
            _, completion = client.chat.completions.create_with_completion(
                model=model,
                response_model=task.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0,
                max_retries=0,  # the first attempt only
            )
        except Exception as exc:  # a length stop raises (IncompleteOutputException), and so does a bad object
            last = getattr(exc, "last_completion", None)
            out.raw = _openai_raw(last)
            out.length = "IncompleteOutput" in type(exc).__name__ or _length(last)
            raise
        out.raw = _openai_raw(completion)
        out.length = _length(completion)
        out.finished = not out.length

    return one


def _length(completion: Any) -> bool:
    choices = getattr(completion, "choices", None)
    return bool(choices) and choices[0].finish_reason == "length"


def _openai_raw(completion: Any) -> str:
    choices = getattr(completion, "choices", None)
    if not choices:
        return ""
    message = choices[0].message
    return message.tool_calls[0].function.arguments if message.tool_calls else message.content or ""


def _langchain(api: str, model: str, max_tokens: int, method: str) -> Callable[[Task, Extraction], None]:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model,
        base_url=api + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
    )

    def one(task: Task, out: Extraction) -> None:
        runnable = llm.with_structured_output(task.model, method=method, include_raw=True)  # type: ignore[arg-type]
        got: Any = runnable.invoke([("system", SYSTEM), ("user", task.text)])
        raw = got["raw"]
        out.raw = json.dumps(raw.tool_calls[0]["args"]) if raw.tool_calls else str(raw.content)
        out.length = raw.response_metadata.get("finish_reason") == "length"
        if got["parsing_error"] is not None:
            raise got["parsing_error"]
        out.finished = isinstance(got["parsed"], task.model) and not out.length

    return one


def _pydantic_ai(api: str, model: str, max_tokens: int) -> Callable[[Task, Extraction], None]:
    from pydantic_ai import Agent, capture_run_messages
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def one(task: Task, out: Extraction) -> None:
        # a client per extraction: each runs its own event loop (asyncio.run), to which a client is bound
        chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=api + "/v1", api_key="unused"))
        agent = Agent(chat, output_type=task.model, instructions=SYSTEM, retries={"tools": 0, "output": 0})
        settings: Any = {"max_tokens": max_tokens, "temperature": 0}
        with capture_run_messages() as messages:
            try:
                result = asyncio.run(agent.run(task.text, model_settings=settings))
            finally:
                answers = [m for m in messages if isinstance(m, ModelResponse)]
                out.length = any(m.finish_reason == "length" for m in answers)
                calls = [p for m in answers for p in m.parts if isinstance(p, ToolCallPart)]
                out.raw = calls[0].args_as_json_str() if calls else ""
        out.finished = isinstance(result.output, task.model) and not out.length

    return one


def _clients(api: str, model: str, max_tokens: int) -> dict[str, Callable[[Task, Extraction], None]]:
    return {
        "instructor-tools": _instructor(api, model, "TOOLS", max_tokens),
        "instructor-json-schema": _instructor(api, model, "JSON_SCHEMA", max_tokens),
        "instructor-json": _instructor(api, model, "JSON", max_tokens),
        "langchain": _langchain(api, model, max_tokens, "json_schema"),
        "langchain-tools": _langchain(api, model, max_tokens, "function_calling"),
        "pydantic-ai": _pydantic_ai(api, model, max_tokens),
    }


def unnamed_keys(raw: str, model: type[BaseModel]) -> bool:
    """Whether the JSON the model wrote has keys its schema does not name (checked against the schema
    closed, so a key the schema allows is not counted)."""
    import jsonschema

    try:
        value = json.loads(raw)
    except ValueError:
        return False
    validator = jsonschema.Draft202012Validator(closed_objects(model.model_json_schema()))
    return any(e.validator == "additionalProperties" for e in validator.iter_errors(value))


def _run_one(fn: Callable[[Task, Extraction], None], task: Task, out: Extraction) -> Extraction:
    start = time.monotonic()
    try:
        fn(task, out)
    except Exception as exc:  # a client's failure to extract is this bench's measurement
        out.finished = False
        out.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    out.seconds = round(time.monotonic() - start, 2)
    out.extra_keys = unnamed_keys(out.raw, task.model)
    return out


# ---- the run -----------------------------------------------------------------------------------------------


def missing_clients() -> list[str]:
    """The client packages this bench drives that are not installed."""
    import importlib.util

    wanted = {
        "instructor": "instructor",
        "langchain_openai": "langchain-openai",
        "pydantic_ai": "pydantic-ai-slim",
    }
    return [pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None]


@dataclass
class Share:
    finished: int = 0
    length: int = 0
    extra_keys: int = 0
    errors: int = 0
    total: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, o: Extraction) -> None:
        self.total += 1
        self.finished += o.finished
        self.length += o.length
        self.extra_keys += o.extra_keys
        self.errors += bool(o.error)
        if o.error and len(self.examples) < 3:
            self.examples.append(f"{o.task}: {o.error}")


def run(
    model: str | None = None,
    json_path: Path | None = None,
    max_tokens: int = 256,
    concurrency: int = 4,
    clients: tuple[str, ...] = CLIENTS,
    tasks: int | None = None,
) -> dict[str, Any]:
    if missing := missing_clients():
        raise SystemExit(f"bench extract needs {', '.join(missing)}: {PIP}")
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        raise SystemExit(f"unknown clients {sorted(unknown)}: choose from {', '.join(CLIENTS)}")
    model_dir = resolve_model(model, progress=False)
    chosen = TASKS[:tasks] if tasks else TASKS
    outcomes: list[Extraction] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardline-bench-extract-") as tmp:
        cluster = LocalCluster(
            Path(tmp),
            ["c", "o"],
            model_dir.parent,
            extra=["--prefill-step", "128"],
            runners=dict(MODEL_RUNNERS),
            api=True,
            node_extra={"o": ["--structured-objects", "open"]},
        ).start()
        try:
            client = cluster.client("c")
            client.wait(lambda v: sum(n.alive for n in v.nodes) == 2, 60, "2 nodes")
            reply = client.place(model_dir.name)
            assert reply.instance is not None, reply.error
            rec = client.wait_ready(reply.instance.instance, 600)
            apis = {"closed": cluster.nodes["c"].api, "open": cluster.nodes["o"].api}
            made = {s: _clients(apis[s], rec.model, max_tokens) for s in SETTINGS}
            jobs = [(name, s, t) for name in clients for t in chosen for s in SETTINGS]
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [pool.submit(_run_one, made[s][c], t, Extraction(c, s, t.name)) for c, s, t in jobs]
                for f in futures:
                    o = f.result()
                    outcomes.append(o)
                    state = "finished" if o.finished else ("length" if o.length else "failed")
                    print(
                        f"{o.client:17} {o.objects:6} {o.task:18} {state:8} {o.seconds:6.1f}s",
                        file=sys.stderr,
                    )
        finally:
            cluster.close()

    shares: dict[str, dict[str, Share]] = {c: {s: Share() for s in SETTINGS} for c in clients}
    for o in outcomes:
        shares[o.client][o.objects].add(o)
    result = {
        "machine": describe(),
        "model": model_dir.name,
        "max_tokens": max_tokens,
        "tasks": [t.name for t in chosen],
        "wall_s": round(time.monotonic() - started, 1),
        "clients": {c: _versions(c) for c in clients},
        "finished_share": {
            c: {s: round(sh.finished / sh.total, 3) if sh.total else None for s, sh in by.items()}
            for c, by in shares.items()
        },
        "shares": {c: {s: asdict(sh) for s, sh in by.items()} for c, by in shares.items()},
        "outcomes": [asdict(o) for o in outcomes],
    }
    _print(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _versions(client: str) -> str:
    from importlib.metadata import version

    pkg = "pydantic-ai-slim" if client == "pydantic-ai" else client.split("-")[0]
    pkg = "langchain-openai" if pkg == "langchain" else pkg
    return version(pkg)


def _print(result: dict[str, Any]) -> None:
    n = len(result["tasks"])
    print(f"\nbench extract: {result['model']}, {n} tasks, max_tokens {result['max_tokens']}")
    print("finished / tasks (stopped at max_tokens, objects with keys the schema does not name)")
    print(f"{'client':24} {'open':>16} {'closed':>16}")
    for c, by in result["shares"].items():
        cells = [
            f"{by[s]['finished']}/{by[s]['total']} ({by[s]['length']}, {by[s]['extra_keys']})"
            for s in SETTINGS
        ]
        print(f"{c:24} {cells[0]:>16} {cells[1]:>16}")
