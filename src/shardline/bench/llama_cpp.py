"""llama.cpp as a reference here: build `llama-bench`, `llama-perplexity`, `llama-tokenize` and
`llama-quantize` once, run them.

The source is the llama.cpp that the `llama-cpp-python` sdist vendors (one pinned version, fetched with pip,
the ordinary client of the registry), built CPU-only with native instructions into the user's cache. It is
built only when asked (`shardline bench llama-cpp --build`, or scripts/build-llama-cpp.sh): the helpers return
None when the binaries are missing, and every bench then says how to build them and skips its ratios to
llama.cpp.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from platformdirs import user_cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARIES = ("llama-bench", "llama-perplexity", "llama-tokenize", "llama-quantize")
BUILD_HINT = "shardline bench llama-cpp --build"
CACHE_ENV = "SHARDLINE_CACHE_DIR"  # the same override as the model cache's
_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    # CPU only, everywhere: no Metal on macOS, no BLAS, no GPU backends.
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_CCACHE=OFF",
    # Static: the binaries copied out of the build tree need nothing beside them.
    "-DBUILD_SHARED_LIBS=OFF",
    # Nothing fetched at configure or build time, nothing built that is not needed.
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def install_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    override = os.environ.get(CACHE_ENV)
    base = Path(override).expanduser() if override else Path(user_cache_dir("shardline"))
    return base / "llama.cpp" / version


def binary(name: str) -> Path | None:
    """The built binary, or None when llama.cpp was not built here."""
    path = install_dir() / "bin" / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_message() -> str:
    return f"llama.cpp not built; run `{BUILD_HINT}` (10-20 minutes on 2 cores)"


def build(jobs: int | None = None, force: bool = False) -> Path:
    """Fetch the pinned sdist, build the tools, keep only them (and how they were built). Returns bin/."""
    dest = install_dir()
    if not force and all(binary(b) for b in BINARIES):
        return dest / "bin"
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=dest) as tmp:
        work = Path(tmp)
        spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", spec, "-d", tmp])
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        source = _extract_vendored(sdist, work / "src")
        build_dir = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *_CMAKE_FLAGS])
        jobs = jobs or os.cpu_count() or 1
        _run(["cmake", "--build", str(build_dir), "--target", *BINARIES, "-j", str(jobs)])
        bin_dir = dest / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name in BINARIES:
            shutil.copy2(build_dir / "bin" / name, bin_dir / name)
        info = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_flags": list(_CMAKE_FLAGS)}
        (dest / "build-info.json").write_text(json.dumps(info, indent=1))
    return dest / "bin"


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _extract_vendored(sdist: Path, into: Path) -> Path:
    """Only vendor/llama.cpp of the sdist, with tarfile's data filter (no links out, no odd files)."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(into, members=members, filter="data")
    (root,) = into.iterdir()
    return root / "vendor" / "llama.cpp"


# ---- running the tools -------------------------------------------------------------------------------------


def _pinned(threads: int) -> Callable[[], None]:
    """Pin the tool to its first `threads` cores, as our stages and baseline are pinned one per core."""
    cores = sorted(os.sched_getaffinity(0))[: max(1, threads)] if hasattr(os, "sched_getaffinity") else []

    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    return pin


def parse_bench_json(text: str) -> dict[str, float]:
    """`llama-bench -o json`: one record per test; pp (n_gen 0) is prefill, tg (n_prompt 0) is decode."""
    out: dict[str, float] = {}
    for test in json.loads(text):
        if int(test.get("n_prompt", 0)) > 0 and int(test.get("n_gen", 0)) == 0:
            out["prefill_tps"] = float(test["avg_ts"])
            out["prefill_tokens"] = int(test["n_prompt"])
        elif int(test.get("n_gen", 0)) > 0 and int(test.get("n_prompt", 0)) == 0:
            out["decode_tps"] = float(test["avg_ts"])
            out["decode_tokens"] = int(test["n_gen"])
    if "prefill_tps" not in out and "decode_tps" not in out:
        raise ValueError("llama-bench output has no prefill (pp) nor decode (tg) test")
    return out


def llama_bench(
    gguf: Path,
    threads: int,
    prompt: int = 512,
    gen: int = 128,
    repetitions: int = 2,
    timeout: float = 900,
    cpus: int | None = None,
) -> dict[str, float] | None:
    """llama.cpp's prefill and decode tokens/s for `gguf` on `threads` threads pinned to the first `cpus`
    cores (default: as many as threads); prompt or gen 0 skips that test. None when not built."""
    exe = binary("llama-bench")
    if exe is None:
        return None
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen)]
    cmd += ["-r", str(repetitions), "-o", "json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=True, preexec_fn=_pinned(cpus or threads)
    )
    return parse_bench_json(done.stdout)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_TOO_SHORT = re.compile(r"tokenizes to only (\d+) tokens")


def parse_perplexity_output(text: str) -> dict[str, float]:
    """`llama-perplexity`'s log: the final estimate, its error, and the chunks and context it used."""
    if m := _TOO_SHORT.search(text):
        raise ValueError(f"text too short for llama-perplexity: {m.group(1)} tokens")
    final = _FINAL.search(text)
    if final is None:
        raise ValueError("llama-perplexity printed no final estimate")
    out = {"ppl": float(final.group(1)), "ppl_err": float(final.group(2))}
    if chunks := _CHUNKS.search(text):
        out["chunks"] = int(chunks.group(1))
        out["ctx"] = int(chunks.group(2))
        # Each chunk scores the tokens of its second half but the last (see perplexity.cpp).
        out["tokens_scored"] = out["chunks"] * (out["ctx"] - out["ctx"] // 2 - 1)
    return out


def llama_perplexity_report(
    gguf: Path, text_file: Path, ctx: int, threads: int = 1, chunks: int | None = None, timeout: float = 1800
) -> dict[str, float] | None:
    exe = binary("llama-perplexity")
    if exe is None:
        return None
    # -b ctx: one batch per chunk, as its default batch (2048) is for a chunk of 512 too.
    cmd = [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx)]
    cmd += ["-t", str(threads), *(["--chunks", str(chunks)] if chunks else [])]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, preexec_fn=_pinned(threads)
    )
    # It logs to stderr (LOG_INF) and stdout (the running [i]ppl figures); the estimate can be on either.
    text = done.stdout + "\n" + done.stderr
    if done.returncode != 0 and _TOO_SHORT.search(text) is None:
        raise RuntimeError(f"llama-perplexity exited with {done.returncode}: {text[-2000:]}")
    return parse_perplexity_output(text)


def llama_perplexity(
    gguf: Path, text_file: Path, ctx: int, threads: int = 1, chunks: int | None = None
) -> float | None:
    """llama.cpp's perplexity of `text_file` (chunks of `ctx`, second halves scored); None when not built."""
    report = llama_perplexity_report(gguf, text_file, ctx, threads, chunks)
    return None if report is None else report["ppl"]


def main(argv_build: bool, jobs: int | None) -> int:
    """`shardline bench llama-cpp`: build when asked, else say where it is (or that it is not)."""
    if argv_build:
        print(f"built: {build(jobs)}")
        return 0
    found = {name: binary(name) for name in BINARIES}
    if not all(found.values()):
        print(missing_message())
        return 1
    for name, path in found.items():
        print(f"{name}: {path}")
    return 0
