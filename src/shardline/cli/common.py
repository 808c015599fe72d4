"""Helpers every command shares: argument types, one-line errors."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

MODEL_HELP = (
    "a model: a name, an mlx-lm directory, a GGUF file or a Hugging Face org/name[@revision][:QUANT] "
    "(default: the built-in model)"
)
PREFIX_CACHE_HELP = (
    "prefill every prompt in full: keep no prompt KV for later requests that begin the same way"
)


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def positive(value: int, name: str) -> int:
    if value < 1:
        raise CliError(f"{name} must be at least 1, got {value}")
    return value


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number."""
    got: list[int] = []
    done = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        got.append(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    while not done.wait(1.0):  # wakes for signals; the period is not a synchronisation
        pass
    return got[0]


def add_prefix_cache_arg(parser: argparse.ArgumentParser) -> None:
    """--no-prefix-cache, for every command that takes instance settings (InstanceSettings.prefix_cache)."""
    parser.add_argument("--no-prefix-cache", action="store_true", help=PREFIX_CACHE_HELP)


def encode_prompt(tokenizer: object, prompt: str, raw: bool) -> list[int]:
    """The prompt's token ids: through the chat template unless `raw` (or the model has none)."""
    if getattr(tokenizer, "chat_template", None) and not raw:
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return tokenizer.encode(prompt)  # type: ignore[attr-defined]


def stream_tokens(handle: object, tokenizer: object) -> None:
    """Print a request's text to stdout as its tokens arrive; Ctrl-C cancels the request."""
    detok = tokenizer.detokenizer  # type: ignore[attr-defined]
    detok.reset()
    try:
        for tok in handle:  # type: ignore[attr-defined]
            detok.add_token(tok.token)
            sys.stdout.write(detok.last_segment)
            sys.stdout.flush()
    except KeyboardInterrupt:
        handle.cancel()  # type: ignore[attr-defined]
        raise
    detok.finalize()
    sys.stdout.write(detok.last_segment + "\n")


def add_sampling_args(
    p: argparse.ArgumentParser, *, temperature: float, top_p: float, top_k: int, repetition_penalty: float
) -> None:
    """The sampling flags every command that generates takes, with that command's defaults."""
    p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=top_p, help="nucleus sampling: keep this much mass")
    p.add_argument("--top-k", type=int, default=top_k, help="sample among this many best tokens (0: all)")
    penalty = "penalise tokens already seen (1: none)"
    p.add_argument("--repetition-penalty", type=float, default=repetition_penalty, help=penalty)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
