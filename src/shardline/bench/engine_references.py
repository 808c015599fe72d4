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
        out = llama_cpp.llama_bench(self.gguf, threads, self.prompt, self.gen, self.repetitions)
        if out is None:
            raise RuntimeError(llama_cpp.missing_message())
        return out


def llama_reference(
    model: str | None, model_dir: Path, quick: bool
) -> tuple[LlamaCpp | None, Path | None, str]:
    """llama.cpp's side when it can run (its binaries, the model's GGUF), the GGUF, and why not otherwise."""
    from shardline.bench.quality import source_gguf

    gguf = source_gguf(model, model_dir)
    if gguf is None:
        return None, None, "no GGUF source known for this model: llama.cpp ratios skipped"
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
