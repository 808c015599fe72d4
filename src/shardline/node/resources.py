"""A node's identity (stable across restarts) and its resources (memory, a measured compute score)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from shardline.cluster.messages import Resources

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'24G', '512M', '1.5GiB', '1000000' -> bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 24G, 512M, 1.5GiB)")
    value = float(match[1]) * _UNITS[match[2].lower()]
    if value < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)


def node_identity(data_dir: Path, name: str | None = None) -> tuple[str, str]:
    """(node id, name): the id is made once and kept in the data directory, so a node that comes back is
    the same node (never a ghost beside its old self)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "node.json"
    try:
        saved = json.loads(path.read_text())
        node_id = str(saved["id"])
    except (OSError, ValueError, KeyError, TypeError):
        node_id = uuid.uuid4().hex[:12]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": node_id}))
        os.replace(tmp, path)
    return node_id, name or f"{socket.gethostname()}-{node_id[:4]}"


def compute_score(seconds: float = 0.3) -> float:
    """GFLOP/s of a float32 matmul on the default MLX device: the best of repeated runs over about
    `seconds`, so that a busy moment (another process on the core) does not make a node look slow."""
    import mlx.core as mx

    n = 512
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)  # warm-up
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds or best == 0.0:
        t = time.perf_counter()
        mx.eval(a @ b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def read_bandwidth(rows: int = 16384, cols: int = 6144, tries: int = 3) -> float:
    """GB/s at which a decode product reads weights on the default device: one row times a 4-bit matrix
    (~60 MB with its scales, far past the caches) through the product runners use. A decode step reads every
    weight once, so this is what its time is bound by (a plain memory sum reads ~4x faster on CPU than the
    product does, and would make weights look cheap next to the links). The best of a few runs."""
    import mlx.core as mx

    from shardline.compute import quantized

    group = 32
    w = mx.zeros((rows, cols * 4 // 32), dtype=mx.uint32)
    scales = mx.ones((rows, cols // group))
    biases = mx.zeros((rows, cols // group))
    x = mx.ones((1, cols))
    mx.eval(w, scales, biases, x)
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    best = 0.0
    for _ in range(tries):
        t = time.perf_counter()
        mx.eval(quantized.quantized_matmul(x, w, scales, biases, group, 4))
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def stream_bandwidth(threads: int = 1, nbytes: int = 512 << 20, tries: int = 3) -> float:
    """GB/s of a plain streaming read of `nbytes` (far past the caches) by `threads` threads, each summing
    its share: what the memory gives a core or a node, the ceiling a decode product's weight reads are held
    to (benches report their share of it). The best of a few runs."""
    import numpy as np

    a = np.ones(nbytes // 8, dtype=np.int64)
    parts = np.array_split(a, max(1, threads))
    best = 0.0
    with ThreadPoolExecutor(max(1, threads)) as pool:  # numpy's reductions release the GIL
        for _ in range(tries):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def device_kind() -> str:
    import mlx.core as mx

    return str(mx.default_device()).removeprefix("Device(").removesuffix(")")


def resources(
    score: float,
    device: str,
    memory_limit: int | None,
    held_bytes: int,
    read_gbps: float = 0.0,
    models_root: Path | None = None,
) -> Resources:
    """held_bytes: memory this node's runners hold now; placement sees what is left of the limit.
    models_root: where the node keeps models (its free disk decides who downloads a model none holds)."""
    vm = psutil.virtual_memory()
    available = vm.available if memory_limit is None else max(0, min(vm.available, memory_limit - held_bytes))
    return Resources(
        memory_total=memory_limit or vm.total,
        memory_available=available,
        memory_limit=memory_limit,
        compute_score=score,
        device=device,
        cpus=os.cpu_count() or 1,
        read_gbps=read_gbps,
        disk_free=_disk_free(models_root) if models_root is not None else 0,
    )


def rss_of(pids: Iterable[int]) -> int:
    """Resident bytes of these processes together (one that is gone counts nothing)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def _disk_free(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0
