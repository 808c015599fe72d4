"""Calls out of a model's answer (the `<tool_call>` format of api/tools/prompt.py), whole or as it streams.

`CallStream` turns streamed text into events: text pieces, a call's start (its name), pieces of its
arguments' JSON text as they come, and its end. Every API streams from these events in its own shape.
`parse_calls` reads a whole answer strictly: every block parses, names a tool and has arguments its
schema validates, or the answer is not calls.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from shardline.api.tools.prompt import CLOSE, OPEN, Tool, ToolPlan

_ALPHABET = string.ascii_letters + string.digits


def call_id(prefix: str = "call_") -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def calls_in(text: str, plan: ToolPlan | None) -> list[Call] | None:
    """A whole answer's calls when the request may call (see parse_calls), else None."""
    return parse_calls(text, plan.allowed) if plan is not None and plan.calling else None


def parse_calls(text: str, tools: tuple[Tool, ...]) -> list[Call] | None:
    """The calls an answer makes, each validated against its tool's schema; None when the answer is not
    made of calls alone (text, a call cut short, an unknown tool, arguments the schema refuses)."""
    import jsonschema

    by_name = {t.name: t for t in tools}
    rest, calls = text.strip(), []
    while rest:
        if not rest.startswith(OPEN) or CLOSE not in rest:
            return None
        body, _, rest = rest[len(OPEN) :].partition(CLOSE)
        rest = rest.strip()
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        tool, args = by_name.get(call["name"]), call["arguments"]
        if tool is None or not isinstance(args, dict):
            return None
        try:
            jsonschema.validate(args, tool.parameters)
        except (jsonschema.ValidationError, jsonschema.SchemaError):
            return None
        calls.append(Call(tool.name, args))
    return calls or None


# ---- streaming ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    name: str
    arguments: str  # the arguments' JSON text, as streamed


Event = TextPiece | CallStart | ArgsPiece | CallEnd


@dataclass
class _Scan:
    """One call's JSON object, character by character: its `name` and its `arguments` text."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    key: str | None = None  # the depth-1 key whose value is being read
    token: str = ""  # the depth-1 string being read (a key or the name)
    expect_key: bool = True
    name: str | None = None
    args: str = ""
    args_sent: int = 0


@dataclass
class CallStream:
    """Events from an answer streamed in pieces. `may_be_text`: the answer may be text instead (tool
    choice auto); it is calls when it begins with the wrapper, text otherwise (the grammar's rule)."""

    may_be_text: bool = True
    calls: int = 0
    _mode: str = "undecided"  # undecided | text | open | object | close
    _held: str = ""
    _scan: _Scan = field(default_factory=_Scan)

    def __post_init__(self) -> None:
        if not self.may_be_text:
            self._mode = "open"

    @property
    def is_text(self) -> bool:
        return self._mode == "text"

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            self._step(ch, out)
        if self._mode == "object":
            self._send_args(out)
        return _coalesced(out)

    def end(self) -> list[Event]:
        """At the end: held text that never became a call is text."""
        out: list[Event] = []
        if self._mode in ("undecided", "text") and self._held:
            out.append(TextPiece(self._held))
        self._held = ""
        return out

    def _step(self, ch: str, out: list[Event]) -> None:
        if self._mode == "text":
            out.append(TextPiece(ch))
        elif self._mode == "undecided":
            self._held += ch
            if not OPEN.startswith(self._held) and not self._held.startswith(OPEN):
                self._mode = "text"
                out.append(TextPiece(self._held))
                self._held = ""
            elif self._held == OPEN:
                self._mode, self._held = "object", ""
        elif self._mode == "open":
            self._held = (self._held + ch).lstrip()
            if self._held == OPEN:
                self._mode, self._held = "object", ""
        elif self._mode == "close":
            self._held = (self._held + ch).lstrip()
            if self._held == CLOSE:
                self._mode, self._held = "open", ""
        else:
            self._object(ch, out)

    def _object(self, ch: str, out: list[Event]) -> None:
        s = self._scan
        if s.depth == 0:
            if ch == "{":
                s.depth = 1
            return
        value_ends = s.depth == 1 and ch in ",}" and not s.in_string
        in_args = s.key == "arguments" and not s.expect_key and not value_ends
        if in_args and (s.args or not ch.isspace()):
            s.args += ch
        if s.in_string:
            if s.escaped:
                s.escaped = False
            elif ch == "\\":
                s.escaped = True
            elif ch == '"':
                s.in_string = False
                if s.depth == 1 and s.expect_key:
                    s.key = json.loads(f'"{s.token}"')
                elif s.depth == 1 and s.key == "name":
                    s.name = json.loads(f'"{s.token}"')
                    out.append(CallStart(self.calls, s.name))
            if s.depth == 1 and s.in_string:
                s.token += ch
            return
        if ch == '"':
            s.in_string, s.token = True, ""
        elif ch in "{[":
            s.depth += 1
        elif ch in "}]":
            s.depth -= 1
        elif ch == ":" and s.depth == 1:
            s.expect_key = False
        elif ch == "," and s.depth == 1:
            s.expect_key, s.key = True, None
        if s.depth == 0:  # the call's object closed
            self._send_args(out)
            out.append(CallEnd(self.calls, s.name or "", s.args.rstrip()))
            self.calls += 1
            self._scan = _Scan()
            self._mode = "close"

    def _send_args(self, out: list[Event]) -> None:
        s = self._scan
        if s.name is not None and len(s.args) > s.args_sent:
            out.append(ArgsPiece(self.calls, s.args[s.args_sent :]))
            s.args_sent = len(s.args)


def _coalesced(events: list[Event]) -> list[Event]:
    """Neighbouring text pieces (or pieces of one call's arguments) as one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, TextPiece) and isinstance(last, TextPiece):
            out[-1] = TextPiece(last.text + e.text)
        elif isinstance(e, ArgsPiece) and isinstance(last, ArgsPiece) and last.index == e.index:
            out[-1] = ArgsPiece(e.index, last.text + e.text)
        else:
            out.append(e)
    return out
