"""Checks of a model directory against what it should hold: tensors present, bytes matching their hashes,
and the whole against the model digest the cluster expects."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from shardline.models.store.errors import WeightsError
from shardline.models.store.files import hash_file, hash_range, read_header, weight_files
from shardline.models.store.manifest import (
    Manifest,
    TensorEntry,
    import_record,
    read_shard_manifest,
    tensors_for,
)


def missing_tensors(model_dir: Path, wanted: dict[str, tuple[int, ...]]) -> list[str]:
    """Names in `wanted` (name -> shape) that the directory's weight files lack or hold with another shape."""
    have: dict[str, tuple[int, ...]] = {}
    for path in weight_files(Path(model_dir)):
        _, header = read_header(path)
        header.pop("__metadata__", None)
        have.update({n: tuple(e["shape"]) for n, e in header.items()})
    return [n for n, shape in wanted.items() if have.get(n) != tuple(shape)]


def verify_copy(model_dir: Path, manifest: Manifest, hash_only: Collection[str] | None = None) -> list[str]:
    """Names of the tensors, small files and weights files of `model_dir` that do not match `manifest`.

    Every weights file's header must describe exactly the manifest's tensors at their places (else the
    loader would read other bytes than those hashed), and no other weights file may be there (the loader
    would read it too). Tensor bytes are hashed for the names in `hash_only` (all when None): a stage needs
    only its own.
    """
    model_dir = Path(model_dir)
    bad: list[str] = []
    by_file: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, e in manifest.tensors.items():
        by_file.setdefault(e.file, []).append((name, e))
    bad.extend(p.name for p in weight_files(model_dir) if p.name not in by_file)
    for file, entries in by_file.items():
        path = model_dir / file
        hashed = [(n, e) for n, e in entries if hash_only is None or n in hash_only]
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
            bad.extend(n for n, _ in hashed)
            continue
        try:
            bad.extend(n for n, e in hashed if hash_range(fd, e.offset, e.bytes) != e.sha256)
        finally:
            os.close(fd)
    for name, f in manifest.files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != f.size or hash_file(path) != f.sha256:
            bad.append(name)
    return bad


def verify_shard(model_dir: Path) -> list[str]:
    """Names of the tensors (and small files) whose bytes on disk no longer match the shard manifest.

    The weights file's name is listed too when its header no longer describes the tensors (unloadable).
    """
    return verify_copy(model_dir, read_shard_manifest(model_dir))


def _short(digest: str) -> str:
    return digest[:12] or "none"


def check_full_copy(model_dir: Path, expected: str, start: int, end: int) -> list[str]:
    """Why a whole local model may not serve layers [start, end) as the model of digest `expected` (empty:
    it may): no import record, a record of another version, or files that no longer match the record."""
    record = import_record(model_dir)
    if record is None:
        return ["no digests were recorded when it was imported"]
    if (digest := record.digest()) != expected:
        return [f"it is another version (digest {_short(digest)}, expected {_short(expected)})"]
    names = tensors_for(record.tensors, start, end, record.num_layers, record.tied)
    return [f"{name} changed since its import" for name in verify_copy(model_dir, record, set(names))]


def check_stage_copy(model_dir: Path, expected: str) -> list[str]:
    """Why a fetched stage directory may not serve as the model of digest `expected` (empty: it may)."""
    try:
        manifest = read_shard_manifest(model_dir)
    except WeightsError as exc:
        return [str(exc)]
    if (digest := manifest.model_digest()) != expected:
        return [f"it was copied from another version (digest {_short(digest)}, expected {_short(expected)})"]
    return verify_shard(model_dir)
