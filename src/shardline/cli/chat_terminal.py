"""The terminal side of `shardline run`: answers streamed from a node's /v1/chat/completions (SSE), and the
interactive chat (`>>> `, readline history, `\"\"\"` blocks, /bye, /clear, Ctrl-C stops an answer)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from shardline.cli.common import CliError

HELP = """Available commands:
  /clear   forget the conversation so far
  /bye     leave (Ctrl-D does too)
  /?       this help (/help too)

Use \"\"\" to begin and end a message of several lines.
Ctrl-C stops an answer; Ctrl-D or /bye leaves."""
BLOCK = '"""'


@dataclass(frozen=True)
class ChatSampling:
    """What each answer is sampled with (None: the node's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class Answer:
    text: str
    tokens: int  # the node's count (usage) when the stream ended, else the chunks that carried text
    seconds: float  # first text to last
    tokens_per_s: float | None  # the node's decode rate (timings), else tokens over seconds
    stopped: bool = False  # Ctrl-C ended it


class ChatStream:
    """Streams one answer at a time for a conversation, through a plain HTTP client."""

    def __init__(self, http: Any, model: str, sampling: ChatSampling) -> None:
        self.http = http
        self.model = model
        self.sampling = sampling

    def answer(self, messages: list[dict[str, str]], write: Callable[[str], None]) -> Answer:
        """Stream the next assistant turn to `write`. Ctrl-C ends it early: leaving the block closes the
        connection, and a node cancels a request whose client went away."""
        import httpx

        try:
            return self._answer(messages, write)
        except httpx.HTTPError as exc:
            raise CliError(f"the node: {exc}") from exc

    def _answer(self, messages: list[dict[str, str]], write: Callable[[str], None]) -> Answer:
        body = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.sampling.body(),
        }
        parts: list[str] = []
        chunks, first, last = 0, None, None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        stopped = False
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                from shardline.cli.run import error_message

                raise CliError(error_message(r))
            try:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        raise CliError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            last = time.monotonic()
                            first = first or last
                            chunks += 1
                            parts.append(text)
                            write(text)
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
            except KeyboardInterrupt:
                stopped = True
        seconds = (last - first) if first is not None and last is not None else 0.0
        tokens = int(usage.get("completion_tokens", chunks)) if not stopped else chunks
        rate = timings.get("decode_tokens_per_s") if not stopped else None
        if rate is None and seconds > 0:
            rate = max(tokens - 1, 0) / seconds  # the first token's time is the prompt's
        return Answer("".join(parts), tokens, seconds, rate, stopped)


def _messages(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _write(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


def answer_once(stream: ChatStream, prompt: str, system: str | None, out: TextIO | None = None) -> int:
    """One prompt's answer to stdout (and nothing else there: it pipes)."""
    out = out or sys.stdout
    messages = [*_messages(system), {"role": "user", "content": prompt}]
    answer = stream.answer(messages, _write(out))
    out.write("\n")
    out.flush()
    return 130 if answer.stopped else 0


def stats_line(answer: Answer, tty: bool) -> str:
    rate = f", {answer.tokens_per_s:.1f} tokens/s" if answer.tokens_per_s else ""
    text = f"{answer.tokens} tokens{rate}, {answer.seconds:.1f} s" + (" (stopped)" if answer.stopped else "")
    return f"\x1b[2m{text}\x1b[0m" if tty else text


def read_message(read: Callable[[str], str] = input) -> str:
    """One message: a line, or a block from a line opening with \"\"\" to one ending with it (as ollama)."""
    line = read(">>> ")
    if not line.lstrip().startswith(BLOCK):
        return line
    rest = line.lstrip()[len(BLOCK) :]
    if rest.rstrip().endswith(BLOCK):
        return rest.rstrip()[: -len(BLOCK)]
    lines = [rest]
    while True:
        more = read("... ")
        if more.rstrip().endswith(BLOCK):
            lines.append(more.rstrip()[: -len(BLOCK)])
            return "\n".join(lines).strip("\n")
        lines.append(more)


def chat(
    stream: ChatStream, system: str | None, out: TextIO | None = None, read: Callable[[str], str] = input
) -> int:
    """The interactive chat; the conversation so far goes with every turn, so the model sees it. `read` is
    input() (line editing and history through readline) but in tests."""
    try:
        import readline  # noqa: F401 - input() gains line editing and up-arrow history
    except ImportError:
        pass
    out = out or sys.stdout
    tty = out.isatty()
    messages = _messages(system)
    print(f"shardline: chatting with {stream.model}; /? for help, /bye or Ctrl-D to leave", flush=True)
    while True:
        try:
            text = read_message(read)
        except EOFError:
            print(flush=True)
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.", flush=True)
            continue
        command = text.strip()
        if not command:
            continue
        if command.startswith("/"):
            if command == "/bye":
                return 0
            if command == "/clear":
                messages = _messages(system)
                print("Cleared session context", flush=True)
            elif command in ("/?", "/help"):
                print(HELP, flush=True)
            else:
                print(f"Unknown command '{command.split()[0]}'. Type /? for help", flush=True)
            continue
        messages.append({"role": "user", "content": text})
        try:
            answer = stream.answer(messages, _write(out))
        except CliError as exc:
            messages.pop()  # that turn did not happen
            print(f"\nshardline: error: {exc}", file=sys.stderr, flush=True)
            continue
        if answer.text:
            messages.append({"role": "assistant", "content": answer.text})
        else:
            messages.pop()  # stopped before a word: as if not asked
        out.write("\n" + stats_line(answer, tty) + "\n\n")
        out.flush()
