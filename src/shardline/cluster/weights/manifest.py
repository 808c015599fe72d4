"""What a model has: every tensor's dtype, shape, place and sha256, and its small files with theirs.

Built once per model directory and cached beside it; a fetched stage carries its own (`SHARD_MANIFEST`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from shardline.cluster.weights.errors import WeightsError
from shardline.cluster.weights.files import (
    LAYER,
    NAME,
    SHARD_MANIFEST,
    current_stamps,
    hash_file,
    hash_range,
    read_config,
    read_header,
    small_files,
    stamp,
    weight_files,
)

log = logging.getLogger("shardline.weights")

MANIFEST_FORMAT = 1


class FileEntry(BaseModel):
    size: int = Field(ge=0)
    sha256: str


class TensorEntry(BaseModel):
    dtype: str
    shape: list[int]
    file: str  # weights file that holds it, in the directory the manifest describes
    offset: int = Field(ge=0)  # absolute byte offset of its data in that file
    bytes: int = Field(ge=0)
    sha256: str


class StageSpan(BaseModel):
    start: int
    end: int  # exclusive
    total: int


class SourceInfo(BaseModel):
    node: str
    digest: str  # of the manifest the stage was fetched against


class Manifest(BaseModel):
    format: int = MANIFEST_FORMAT
    model: str
    num_layers: int
    tied: bool  # the output head is the embedding: the last stage needs model.embed_tokens too
    metadata: dict[str, str] = {}  # safetensors __metadata__, carried into fetched files
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    layers: StageSpan | None = None  # None: the whole model; else a stage directory holding only these layers
    source: SourceInfo | None = None
    # size and mtime_ns of every file hashed: a cached manifest is valid while they hold (local, never sent)
    stamps: dict[str, tuple[int, int]] = {}

    def digest(self) -> str:
        """Identity of the content (not of where it lies): equal digests mean equal bytes."""
        content = {
            "num_layers": self.num_layers,
            "tied": self.tied,
            "tensors": {n: [t.dtype, t.shape, t.bytes, t.sha256] for n, t in sorted(self.tensors.items())},
            "files": {n: f.sha256 for n, f in sorted(self.files.items())},
        }
        return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()


class ModelPresence(BaseModel):
    """What a node reports about one model it holds: all of it, or one stage's layers."""

    full: bool
    start: int
    end: int
    total: int
    bytes: int


def tensors_for(names: Iterable[str], start: int, end: int, total: int, tied: bool) -> list[str]:
    """The tensors a stage holding layers [start, end) of `total` needs, in the order given."""
    if not 0 <= start < end <= total:
        raise ValueError(f"bad layer range [{start}, {end}) of {total}")
    first, last = start == 0, end == total
    keep = []
    for name in names:
        if m := LAYER.match(name):
            wanted = start <= int(m[1]) < end
        elif name.startswith("model.embed_tokens."):
            wanted = first or (last and tied)
        elif name.startswith(("model.norm.", "lm_head.")):
            wanted = last
        else:
            wanted = False
        if wanted:
            keep.append(name)
    return keep


def build_manifest(model_dir: Path, model: str | None = None) -> Manifest:
    """Hash every tensor and small file of a complete model directory (slow for big models: cache it)."""
    model_dir = Path(model_dir)
    weights = weight_files(model_dir)
    if not weights:
        raise WeightsError(f"{model_dir}: no model*.safetensors weight file")
    config = read_config(model_dir)
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    stamps: dict[str, tuple[int, int]] = {}
    for path in weights:
        stamps[path.name] = stamp(path)
        data_start, header = read_header(path)
        meta = header.pop("__metadata__", None)
        if isinstance(meta, dict):
            metadata.update({str(k): str(v) for k, v in meta.items()})
        fd = os.open(path, os.O_RDONLY)
        try:
            # In file order: one sequential read of the whole file.
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = e["data_offsets"]
                tensors[name] = TensorEntry(
                    dtype=e["dtype"],
                    shape=list(e["shape"]),
                    file=path.name,
                    offset=data_start + begin,
                    bytes=end - begin,
                    sha256=hash_range(fd, data_start + begin, end - begin),
                )
        finally:
            os.close(fd)
    files = {}
    for path in small_files(model_dir):
        stamps[path.name] = stamp(path)
        files[path.name] = FileEntry(size=path.stat().st_size, sha256=hash_file(path))
    layer_ids = [int(m[1]) for n in tensors if (m := LAYER.match(n))]
    num_layers = int(config.get("num_hidden_layers") or (max(layer_ids) + 1 if layer_ids else 0))
    tied = config.get("tie_word_embeddings")
    if tied is None:  # the architecture's default; the weights say which it is
        tied = not any(n.startswith("lm_head.") for n in tensors)
    return Manifest(
        model=model or model_dir.name,
        num_layers=num_layers,
        tied=bool(tied),
        metadata=metadata,
        files=files,
        tensors=tensors,
        stamps=stamps,
    )


def _cache_path(model_dir: Path) -> Path:
    # Beside the directory, not in it: the model directory stays exactly what its importer wrote.
    return model_dir.parent / f".{model_dir.name}.weights-manifest.json"


def model_manifest(model_dir: Path, model: str | None = None) -> Manifest:
    """A model directory's manifest: its shard manifest, else the cached one while its files are unchanged."""
    model_dir = Path(model_dir)
    if (model_dir / SHARD_MANIFEST).is_file():
        return read_shard_manifest(model_dir)
    cache = _cache_path(model_dir)
    present = {p.name for p in weight_files(model_dir)} | {p.name for p in small_files(model_dir)}
    try:
        cached = Manifest.model_validate_json(cache.read_bytes())
        if set(cached.stamps) == present and current_stamps(model_dir, present) == cached.stamps:
            return cached
    except (OSError, ValidationError):
        pass
    t0 = time.monotonic()
    manifest = build_manifest(model_dir, model)
    log.info("hashed %s (%d tensors) in %.1fs", model_dir, len(manifest.tensors), time.monotonic() - t0)
    tmp = cache.with_name(cache.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(manifest.model_dump_json())
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only models root still serves, it just hashes again next time
        log.warning("cannot cache the manifest of %s: %s", model_dir, exc)
        tmp.unlink(missing_ok=True)
    return manifest


def read_shard_manifest(model_dir: Path) -> Manifest:
    path = Path(model_dir) / SHARD_MANIFEST
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise WeightsError(f"{path}: unreadable shard manifest ({exc})") from exc


def local_models(models_root: Path) -> dict[str, ModelPresence]:
    """Models under `models_root` (one directory each), whole or one stage, with their weight bytes."""
    out: dict[str, ModelPresence] = {}
    root = Path(models_root)
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or not NAME.match(d.name) or not (d / "config.json").is_file():
            continue  # hidden entries are fetches in progress, caches and leftovers
        weights = weight_files(d)
        if not weights:
            continue
        try:
            if (d / SHARD_MANIFEST).is_file():
                m = read_shard_manifest(d)
                if m.layers is None:
                    continue
                size = sum(e.bytes for e in m.tensors.values())
                out[d.name] = ModelPresence(full=False, **m.layers.model_dump(), bytes=size)
            else:
                total = int(read_config(d).get("num_hidden_layers") or 0)
                size = sum(p.stat().st_size for p in weights)
                out[d.name] = ModelPresence(full=True, start=0, end=total, total=total, bytes=size)
        except (OSError, WeightsError, ValueError) as exc:
            log.warning("skipping %s: %s", d, exc)
    return out
