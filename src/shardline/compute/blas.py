"""Pick a fast BLAS, and keep freed memory, for runner processes.

The Linux mlx[cpu] wheel links a bundled reference BLAS; OpenBLAS exports the same CBLAS symbols and,
preloaded into a runner, makes float32 matmul an order of magnitude faster. Runners are fresh processes, so
the choice is made in their environment before they start.

MLX on CPU takes every array from malloc, and glibc serves blocks above its mmap threshold with fresh
mappings that it unmaps on free: a prefill chunk's attention tiles then page-fault their way in again for
every tile (a third of a stage's time went to the kernel). The runner keeps them in its heap instead.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas() -> str | None:
    if not sys.platform.startswith("linux"):
        return None  # macOS uses Accelerate, CUDA builds do not use CPU BLAS for the model
    explicit = os.environ.get("SHARDLINE_OPENBLAS")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("openblas")
    return name


def runner_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """A runner's environment: OpenBLAS preloaded (unless SHARDLINE_BLAS=reference), `threads` threads."""
    env = dict(os.environ if base is None else base)
    lib = None if env.get("SHARDLINE_BLAS") == "reference" else find_openblas()
    if lib:
        env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
        env["OPENBLAS_NUM_THREADS"] = str(max(1, threads))
    env["SHARDLINE_THREADS"] = str(max(1, threads))  # the CPU kernel's products (compute/quantized.py)
    # glibc only; ignored by other allocators. Blocks up to 32 MiB (glibc's ceiling) come from the heap, and
    # the heap is not trimmed back below 1 GiB: tiles reuse the same pages from one step to the next.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    # glibc gives each thread that allocates (zenoh's receive workers, the runner's own) an arena of its
    # own, whose freed blocks no other thread reuses: a first stage's peak RSS fell 367 -> 288 MiB with two
    # arenas (the node daemon's setting too), at the same speed.
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def describe() -> str:
    lib = find_openblas()
    return f"OpenBLAS ({lib})" if lib else "MLX bundled BLAS (install OpenBLAS for ~10x faster CPU matmul)"
