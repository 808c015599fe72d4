"""Checks of a model directory against what it should hold: tensors present, bytes matching their hashes."""

from __future__ import annotations

import os
from pathlib import Path

from shardline.cluster.weights.errors import WeightsError
from shardline.cluster.weights.files import hash_file, hash_range, read_header, weight_files
from shardline.cluster.weights.manifest import TensorEntry, read_shard_manifest


def missing_tensors(model_dir: Path, wanted: dict[str, tuple[int, ...]]) -> list[str]:
    """Names in `wanted` (name -> shape) that the directory's weight files lack or hold with another shape."""
    have: dict[str, tuple[int, ...]] = {}
    for path in weight_files(Path(model_dir)):
        _, header = read_header(path)
        header.pop("__metadata__", None)
        have.update({n: tuple(e["shape"]) for n, e in header.items()})
    return [n for n, shape in wanted.items() if have.get(n) != tuple(shape)]


def verify_shard(model_dir: Path) -> list[str]:
    """Names of the tensors (and small files) whose bytes on disk no longer match the shard manifest.

    The weights file's name is listed too when its header no longer describes the tensors (unloadable).
    """
    model_dir = Path(model_dir)
    manifest = read_shard_manifest(model_dir)
    bad: list[str] = []
    by_file: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, e in manifest.tensors.items():
        by_file.setdefault(e.file, []).append((name, e))
    for file, entries in by_file.items():
        path = model_dir / file
        try:
            data_start, header = read_header(path)
            header.pop("__metadata__", None)
            described = {
                n: (e.dtype, e.shape, [e.offset - data_start, e.offset - data_start + e.bytes])
                for n, e in entries
            }
            if {n: (h.get("dtype"), h.get("shape"), h.get("data_offsets")) for n, h in header.items()} != (
                described
            ):
                bad.append(file)
            fd = os.open(path, os.O_RDONLY)
        except (OSError, WeightsError, AttributeError, TypeError):
            bad.append(file)
            bad.extend(n for n, _ in entries)
            continue
        try:
            bad.extend(n for n, e in entries if hash_range(fd, e.offset, e.bytes) != e.sha256)
        finally:
            os.close(fd)
    for name, f in manifest.files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != f.size or hash_file(path) != f.sha256:
            bad.append(name)
    return bad
