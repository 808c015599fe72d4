"""Names the machine a benchmark ran on: ratios only mean something next to it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from shardline.compute import blas


def describe() -> dict[str, str | int]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas.describe(),
    }


def run_worker(module: str, args: dict, timeout: float, check: bool) -> subprocess.CompletedProcess[str]:
    """`module`'s `_worker()` in a fresh process given `args` as JSON: the BLAS a runner gets is chosen in
    its environment before it starts (one thread), and what one measurement allocated is gone after it."""
    return subprocess.run(
        [sys.executable, "-c", f"from {module} import _worker; _worker()", json.dumps(args)],
        env=blas.runner_env(1),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), 0 where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
