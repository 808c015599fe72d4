"""What a model has: every tensor's dtype, shape, place and sha256, and its small files with theirs.

A whole model's manifest is its import record: hashed once, when the model is imported (`shardline models
pull`) or when a node first sees its directory, and kept beside the directory. It is never rebuilt from the
files afterwards: a file that changed later is a mismatch against the record, not a new truth. A fetched
stage carries its own (`SHARD_MANIFEST`), naming the model digest it was checked against.

Digests: each file has one (a small file: its sha256; a weights file: the sha256 over its tensors' names,
dtypes, shapes and sha256s, so a stage can be checked tensor by tensor); the model digest is the sha256 over
the sorted per-file digests. Nodes report model digests; the master names the expected one with each stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from shardline.models.store.errors import WeightsError
from shardline.models.store.files import (
    LAYER,
    NAME,
    SHARD_MANIFEST,
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
    # size and mtime_ns of every file when it was hashed (local, never sent): says what changed since
    stamps: dict[str, tuple[int, int]] = {}
    recorded_at: float = 0.0  # wall clock of the import record; the earliest import is the cluster's truth

    def file_digests(self) -> dict[str, str]:
        """file -> digest: a small file's sha256; a weights file's over its tensors (not their layout)."""
        out = {n: f.sha256 for n, f in self.files.items()}
        by_file: dict[str, list[list[object]]] = {}
        for n, t in sorted(self.tensors.items()):
            by_file.setdefault(t.file, []).append([n, t.dtype, t.shape, t.bytes, t.sha256])
        for file, entries in by_file.items():
            out[file] = hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()
        return out

    def digest(self) -> str:
        """Identity of the content (not of where it lies): equal digests mean equal bytes."""
        return digest_of(self.file_digests())

    def model_digest(self) -> str:
        """The digest of the whole model this describes: its own, or for a stage the one it was fetched as."""
        if self.layers is None:
            return self.digest()
        return self.source.digest if self.source is not None else ""


def digest_of(file_digests: dict[str, str]) -> str:
    """The model digest: sha256 over the sorted per-file digests (short enough for every node report)."""
    lines = "".join(f"{name} {d}\n" for name, d in sorted(file_digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def derive_layout(config: dict, names: Iterable[str]) -> tuple[int, bool]:
    """(layers, tied head) as the config and tensor names say: a source's claims are checked against it."""
    names = list(names)
    layer_ids = [int(m[1]) for n in names if (m := LAYER.match(n))]
    num_layers = int(config.get("num_hidden_layers") or (max(layer_ids) + 1 if layer_ids else 0))
    tied = config.get("tie_word_embeddings")
    if tied is None:  # the architecture's default; the weights say which it is
        tied = not any(n.startswith("lm_head.") for n in names)
    return num_layers, bool(tied)


class ModelPresence(BaseModel):
    """What a node reports about one model it holds: all of it, or one stage's layers."""

    full: bool
    start: int
    end: int
    total: int
    bytes: int
    digest: str = ""  # the model digest: of its import record, or the one a stage was checked against
    imported_at: float = 0.0  # a whole model: when its record was made (wall clock)


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
        ends = [int(e["data_offsets"][1]) for e in header.values() if isinstance(e, dict)]
        if data_start + max(ends, default=0) > path.stat().st_size:  # still being copied, or cut short
            raise WeightsError(f"{path} is shorter than its header says: not recorded")
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
    num_layers, tied = derive_layout(config, tensors)
    return Manifest(
        model=model or model_dir.name,
        num_layers=num_layers,
        tied=tied,
        metadata=metadata,
        files=files,
        tensors=tensors,
        stamps=stamps,
    )


def record_path(model_dir: Path) -> Path:
    # Beside the directory, not in it: the model directory stays exactly what its importer wrote.
    return Path(model_dir).parent / f".{Path(model_dir).name}.digests.json"


def import_record(model_dir: Path) -> Manifest | None:
    """The digests recorded when the model was imported; None if it never was (or is unreadable)."""
    try:
        return Manifest.model_validate_json(record_path(model_dir).read_bytes())
    except (OSError, ValidationError):
        return None


def record_import(model_dir: Path, model: str | None = None, *, replace: bool = False) -> Manifest:
    """Hash a whole model directory and keep the result beside it: done once, at import. An existing record
    is returned as it is (never rebuilt from files that may have changed since) unless `replace` (a new
    import wrote the directory again)."""
    model_dir = Path(model_dir)
    if not replace and (recorded := import_record(model_dir)) is not None:
        return recorded
    t0 = time.monotonic()
    manifest = build_manifest(model_dir, model)
    manifest.recorded_at = time.time()
    log.info(
        "recorded the digests of %s (%d tensors) in %.1fs",
        model_dir,
        len(manifest.tensors),
        time.monotonic() - t0,
    )
    path = record_path(model_dir)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(manifest.model_dump_json())
        os.replace(tmp, path)
    except OSError as exc:  # a read-only models root still serves: it hashes again at its next start
        log.warning("cannot keep the digests of %s beside it: %s", model_dir, exc)
        tmp.unlink(missing_ok=True)
    return manifest


def record_imports(models_root: Path) -> list[str]:
    """Record every whole model under `models_root` that has no record yet (its first sight is its import)."""
    done = []
    for name, p in local_models(models_root).items():
        if p.full and not p.digest:
            try:
                record_import(Path(models_root) / name, name)
                done.append(name)
            except (OSError, WeightsError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot record the digests of model %s: %s", name, exc)
    return done


def set_aside(model_dir: Path) -> Path:
    """Move a whole model that failed its check out of the way, with its record: hidden (never listed,
    served or loaded), never deleted (its owner may want to look at it)."""
    model_dir = Path(model_dir)
    when = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"  # never onto an earlier one
    aside = model_dir.with_name(f".{model_dir.name}.rejected-{when}")
    os.replace(model_dir, aside)
    with contextlib.suppress(OSError):
        os.replace(record_path(model_dir), record_path(aside))
    return aside


def model_manifest(model_dir: Path, model: str | None = None) -> Manifest:
    """A model directory's manifest: its shard manifest, else its import record (made now at first sight)."""
    model_dir = Path(model_dir)
    if (model_dir / SHARD_MANIFEST).is_file():
        return read_shard_manifest(model_dir)
    return record_import(model_dir, model)


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
                out[d.name] = ModelPresence(
                    full=False, **m.layers.model_dump(), bytes=size, digest=m.model_digest()
                )
            else:
                total = int(read_config(d).get("num_hidden_layers") or 0)
                size = sum(p.stat().st_size for p in weights)
                record = import_record(d)  # read, never made here: hashing is the importer's job
                out[d.name] = ModelPresence(
                    full=True,
                    start=0,
                    end=total,
                    total=total,
                    bytes=size,
                    digest=record.digest() if record is not None else "",
                    imported_at=record.recorded_at if record is not None else 0.0,
                )
        except (OSError, WeightsError, ValueError) as exc:
            log.warning("skipping %s: %s", d, exc)
    return out
