"""Weight distribution between nodes: a node that lacks a model gets its stage's tensors from a peer.

Only the tensors of the stage's layer range travel, over zenoh queryables of the cluster's namespace (never
from outside). A source describes a model with a `Manifest` (every tensor's dtype, shape, place and sha256;
small files with theirs), built once per model directory and cached beside it. A fetcher asks for chunks of
tensors' raw bytes, writes them where they belong in one preallocated safetensors file and records each
finished chunk in an append-only log, so a fetch that is interrupted continues where it stopped. Every tensor
is checked against its hash: a mismatch fetches that tensor again. The finished directory replaces the old one
with a rename and carries a shard manifest (`SHARD_MANIFEST`) that says which layers it holds and their
hashes, so corruption on disk is found later (`verify_shard`) and repaired by fetching only what is wrong.

Keys, under the cluster namespace (one queryable per serving node: `{namespace}/weights/{node_id}/**`):
    {namespace}/weights/{node_id}/{model}/manifest  -> Manifest JSON
    {namespace}/weights/{node_id}/{model}/tensor    payload ChunkRequest JSON -> raw bytes of a tensor range
    {namespace}/weights/{node_id}/{model}/file      payload ChunkRequest JSON -> raw bytes of a small file
Errors come back as `reply_err` with an `ErrorReply` JSON.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

import zenoh
from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger("shardline.weights")

SHARD_MANIFEST = "shardline_shard.json"  # in a directory that holds one stage's tensors (read by load_shard)
WEIGHTS_FILE = "model.safetensors"  # the single weights file of a fetched stage
MANIFEST_FORMAT = 1
MAX_CHUNK_BYTES = 64 << 20  # a server never reads more than this for one query: bounds its memory
MAX_SMALL_FILE_BYTES = 256 << 20  # a "small" file (tokenizer, config) larger than this is not a model file
# The importer's provenance file says "a complete import of X": a stage directory must not pose as one.
_NOT_COPIED = frozenset({"shardline_import.json"})
# Model and small-file names: one path component, not hidden; keeps every path inside its root.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_HASH_BLOCK = 8 << 20
_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


class WeightsError(RuntimeError):
    """A weight transfer or check failed; the message says what, from whom and what to do."""


class ModelNotOnSourceError(WeightsError):
    """The source node has not the model, or not the layers asked for."""


class SourceUnavailableError(WeightsError):
    """Nothing answers weight queries for that node in this namespace."""


# ---------------------------------------------------------------------------------------------- manifest


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


class ChunkRequest(BaseModel):
    name: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0, le=MAX_CHUNK_BYTES)
    digest: str  # the manifest the fetcher plans from: a model that changed since is refused, never mixed


class ErrorReply(BaseModel):
    code: Literal["no_model", "bad_request", "stale", "internal"]
    message: str


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
        if m := _LAYER.match(name):
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


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _read_header(path: Path) -> tuple[int, dict]:
    """(data start, header) of a safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(path.stat().st_size - 8, 100 << 20):
            raise WeightsError(f"{path}: safetensors header length {n} is impossible")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path}: safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is not an object")
    return 8 + n, header


def _hash_range(fd: int, offset: int, size: int) -> str:
    h = hashlib.sha256()
    done = 0
    while done < size:
        block = os.pread(fd, min(_HASH_BLOCK, size - done), offset + done)
        if not block:
            break  # a truncated file: the hash cannot match
        h.update(block)
        done += len(block)
    return h.hexdigest()


def _hash_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _hash_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model*.safetensors"))  # exactly what mlx-lm loads


def _small_files(model_dir: Path) -> list[Path]:
    """Top-level files other than weights: config, tokenizer, generation settings."""
    out = []
    for p in sorted(model_dir.iterdir()):
        name = p.name
        if not p.is_file() or not _NAME.match(name) or name == SHARD_MANIFEST:
            continue
        if name.endswith((".safetensors", ".safetensors.index.json")):
            continue  # weights travel as tensors; an index would name files a stage does not have
        if p.stat().st_size <= MAX_SMALL_FILE_BYTES:
            out.append(p)
    return out


def _read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{model_dir}: config.json is missing or not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise WeightsError(f"{model_dir}: config.json is not an object")
    return config


def build_manifest(model_dir: Path, model: str | None = None) -> Manifest:
    """Hash every tensor and small file of a complete model directory (slow for big models: cache it)."""
    model_dir = Path(model_dir)
    weights = _weight_files(model_dir)
    if not weights:
        raise WeightsError(f"{model_dir}: no model*.safetensors weight file")
    config = _read_config(model_dir)
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    stamps: dict[str, tuple[int, int]] = {}
    for path in weights:
        stamps[path.name] = _stamp(path)
        data_start, header = _read_header(path)
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
                    sha256=_hash_range(fd, data_start + begin, end - begin),
                )
        finally:
            os.close(fd)
    files = {}
    for path in _small_files(model_dir):
        stamps[path.name] = _stamp(path)
        files[path.name] = FileEntry(size=path.stat().st_size, sha256=_hash_file(path))
    layer_ids = [int(m[1]) for n in tensors if (m := _LAYER.match(n))]
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


def _current_stamps(model_dir: Path, names: Iterable[str]) -> dict[str, tuple[int, int]] | None:
    try:
        return {n: _stamp(model_dir / n) for n in names}
    except OSError:
        return None


def model_manifest(model_dir: Path, model: str | None = None) -> Manifest:
    """A model directory's manifest: its shard manifest, else the cached one while its files are unchanged."""
    model_dir = Path(model_dir)
    if (model_dir / SHARD_MANIFEST).is_file():
        return read_shard_manifest(model_dir)
    cache = _cache_path(model_dir)
    present = {p.name for p in _weight_files(model_dir)} | {p.name for p in _small_files(model_dir)}
    try:
        cached = Manifest.model_validate_json(cache.read_bytes())
        if set(cached.stamps) == present and _current_stamps(model_dir, present) == cached.stamps:
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


def missing_tensors(model_dir: Path, wanted: dict[str, tuple[int, ...]]) -> list[str]:
    """Names in `wanted` (name -> shape) that the directory's weight files lack or hold with another shape."""
    have: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(Path(model_dir)):
        _, header = _read_header(path)
        header.pop("__metadata__", None)
        have.update({n: tuple(e["shape"]) for n, e in header.items()})
    return [n for n, shape in wanted.items() if have.get(n) != tuple(shape)]


def _output_header(layout: list[tuple[str, TensorEntry]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    for name, e in layout:
        header[name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.bytes]}
        offset += e.bytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw


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
            data_start, header = _read_header(path)
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
            bad.extend(n for n, e in entries if _hash_range(fd, e.offset, e.bytes) != e.sha256)
        finally:
            os.close(fd)
    for name, f in manifest.files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != f.size or _hash_file(path) != f.sha256:
            bad.append(name)
    return bad


def local_models(models_root: Path) -> dict[str, ModelPresence]:
    """Models under `models_root` (one directory each), whole or one stage, with their weight bytes."""
    out: dict[str, ModelPresence] = {}
    root = Path(models_root)
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or not _NAME.match(d.name) or not (d / "config.json").is_file():
            continue  # hidden entries are fetches in progress, caches and leftovers
        weights = _weight_files(d)
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
                total = int(_read_config(d).get("num_hidden_layers") or 0)
                size = sum(p.stat().st_size for p in weights)
                out[d.name] = ModelPresence(full=True, start=0, end=total, total=total, bytes=size)
        except (OSError, WeightsError, ValueError) as exc:
            log.warning("skipping %s: %s", d, exc)
    return out


# ---------------------------------------------------------------------------------------------- server


def _key_prefix(namespace: str, node_id: str) -> str:
    return f"{namespace}/weights/{node_id}"


def _check_name(what: str, name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"bad {what} name {name!r}: one path component of [A-Za-z0-9._+-], not hidden")


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message)  # type: ignore[arg-type]


class WeightServer:
    """Answers weight queries for every model under `models_root` (whole models and fetched stages)."""

    def __init__(
        self, session: zenoh.Session, namespace: str, node_id: str, models_root: Path, workers: int = 4
    ) -> None:
        _check_name("node", node_id)
        self.models_root = Path(models_root)
        self.node_id = node_id
        self._prefix = _key_prefix(namespace, node_id) + "/"
        self._lock = threading.Lock()
        self._build_locks: dict[str, threading.Lock] = {}
        self._cache: dict[str, tuple[object, Manifest, str]] = {}  # model -> (dir state, manifest, digest)
        # Replies come from a pool, not zenoh's callback threads: hashing and disk reads never stall zenoh.
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"weights-{node_id}")
        self._closed = False
        self._queryable = session.declare_queryable(self._prefix + "**", self._on_query)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(zenoh.ZError):
            self._queryable.undeclare()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_query(self, query: zenoh.Query) -> None:
        try:
            self._pool.submit(self._serve, query)
        except RuntimeError:  # closing: the query is finalised unanswered, the fetcher retries elsewhere
            query.drop()

    def _serve(self, query: zenoh.Query) -> None:
        try:
            data = self._answer(str(query.key_expr), query.payload.to_bytes() if query.payload else b"")
            query.reply(query.key_expr, data)
        except _Refused as exc:
            query.reply_err(exc.reply.model_dump_json())
        except Exception as exc:  # a query must never go unanswered or kill the pool
            log.exception("weight query %s failed", query.key_expr)
            err = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
            query.reply_err(err.model_dump_json())
        finally:
            query.drop()

    def _answer(self, key: str, payload: bytes) -> bytes:
        parts = key[len(self._prefix) :].split("/") if key.startswith(self._prefix) else []
        if len(parts) != 2 or not _NAME.match(parts[0]) or parts[1] not in ("manifest", "tensor", "file"):
            raise _Refused("bad_request", f"no such weight key {key!r}")
        model, kind = parts
        manifest, digest = self.manifest(model)
        if kind == "manifest":
            return manifest.model_copy(update={"stamps": {}}).model_dump_json().encode()
        try:
            req = ChunkRequest.model_validate_json(payload)
        except ValidationError as exc:
            raise _Refused("bad_request", f"bad chunk request: {exc}") from exc
        if req.digest != digest:
            raise _Refused("stale", f"model {model} on {self.node_id} changed since its manifest was read")
        if kind == "tensor":
            entry = manifest.tensors.get(req.name)
            if entry is None:
                raise _Refused("bad_request", f"model {model} has no tensor {req.name!r} on {self.node_id}")
            path, base, size = self.models_root / model / entry.file, entry.offset, entry.bytes
        else:
            f = manifest.files.get(req.name)
            if f is None:
                raise _Refused("bad_request", f"model {model} has no file {req.name!r} on {self.node_id}")
            path, base, size = self.models_root / model / req.name, 0, f.size
        if req.offset >= size:
            raise _Refused("bad_request", f"offset {req.offset} is past the end ({size}) of {req.name!r}")
        n = min(req.length, size - req.offset)
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, n, base + req.offset)
        finally:
            os.close(fd)
        if len(data) != n:
            raise _Refused("internal", f"{path} is shorter than its manifest says")
        return data

    def _dir_state(self, model_dir: Path) -> object:
        return tuple(sorted((p.name, *_stamp(p)) for p in model_dir.iterdir() if p.is_file()))

    def manifest(self, model: str) -> tuple[Manifest, str]:
        """(manifest, digest) of a model held here; rebuilt when its files change."""
        model_dir = self.models_root / model
        if not (model_dir / "config.json").is_file() or not _weight_files(model_dir):
            raise _Refused("no_model", f"node {self.node_id} has no model {model!r}")
        with self._lock:
            build_lock = self._build_locks.setdefault(model, threading.Lock())
        with build_lock:  # one hashing per model, however many fetchers ask at once
            state = self._dir_state(model_dir)
            cached = self._cache.get(model)
            if cached is not None and cached[0] == state:
                return cached[1], cached[2]
            try:
                manifest = model_manifest(model_dir, model)
            except (WeightsError, OSError, ValueError, KeyError, TypeError) as exc:
                why = f"node {self.node_id} cannot serve model {model!r}: {exc}"
                raise _Refused("no_model", why) from exc
            digest = manifest.digest()
            self._cache[model] = (state, manifest, digest)
            return manifest, digest


# ---------------------------------------------------------------------------------------------- fetcher


@dataclass
class FetchStats:
    bytes_received: int = 0  # over the network
    bytes_resumed: int = 0  # already in place from an interrupted fetch
    bytes_reused: int = 0  # copied from the earlier local copy (a repair, or a new range that overlaps)
    chunks: int = 0
    refetched: list[str] = field(default_factory=list)  # tensors/files whose bytes failed their hash
    seconds: float = 0.0


class _NoAnswer(Exception):
    """No usable reply; `failed`: the source answered with an internal error (worth another try)."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class _Source:
    """Queries to one node's weight server, with deadlines proportional to the bytes asked for."""

    def __init__(
        self, session: zenoh.Session, namespace: str, node: str, model: str, retries: int, min_rate_bps: float
    ) -> None:
        self.session = session
        self.node = node
        self.model = model
        self.prefix = f"{_key_prefix(namespace, node)}/{model}"
        self.retries = retries
        self.min_rate_bps = min_rate_bps

    def ask(self, kind: str, payload: bytes | None, timeout: float) -> bytes:
        replies = self.session.get(f"{self.prefix}/{kind}", payload=payload, timeout=timeout)
        for reply in replies:
            if reply.ok is not None:
                return reply.ok.payload.to_bytes()
            raw = reply.err.payload.to_bytes() if reply.err is not None else b""
            try:
                err = ErrorReply.model_validate_json(raw)
            except ValidationError:
                err = ErrorReply(code="internal", message=raw.decode(errors="replace")[:500])
            if err.code == "no_model":
                raise ModelNotOnSourceError(err.message)
            if err.code == "internal":
                raise _NoAnswer(err.message, failed=True)
            raise WeightsError(f"node {self.node} refused {kind} of {self.model}: {err.message}")
        raise _NoAnswer("no reply")

    def manifest(self, timeout_s: float, discover_s: float) -> Manifest:
        t0 = time.monotonic()
        pause, failures = 0.02, 0
        while True:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise WeightsError(f"node {self.node} sent no manifest of {self.model} in {timeout_s:.0f}s")
            asked = time.monotonic()
            try:
                raw = self.ask("manifest", None, left)
                break
            except _NoAnswer as exc:
                failures += exc.failed
                if failures > self.retries:
                    raise WeightsError(f"node {self.node} cannot describe model {self.model}: {exc}") from exc
                # An empty answer at once means no queryable is routed (yet): node absent or just joined.
                quick = time.monotonic() - asked < 0.5 * left
                if quick and not exc.failed and time.monotonic() - t0 > discover_s:
                    raise SourceUnavailableError(
                        f"node {self.node} does not answer weight queries on {self.prefix} "
                        f"(not connected, or not serving weights): {exc}"
                    ) from exc
                time.sleep(pause)  # backoff while routes form; never a synchronisation point
                pause = min(pause * 2, 0.5)
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as exc:
            raise WeightsError(f"node {self.node} sent an invalid manifest of {self.model}: {exc}") from exc

    def chunk(self, kind: str, req: ChunkRequest, expected: int) -> bytes:
        timeout = 5.0 + req.length / self.min_rate_bps
        payload = req.model_dump_json().encode()
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.1 * 2**attempt, 2.0))
            try:
                data = self.ask(kind, payload, timeout)
            except _NoAnswer as exc:
                why = str(exc)
                continue
            if len(data) == expected:
                return data
            why = f"{len(data)} bytes instead of {expected}"
        raise WeightsError(
            f"{kind} {req.name!r} bytes {req.offset}+{req.length} of {self.model} from node {self.node}: "
            f"{why} (after {self.retries + 1} tries, {timeout:.1f}s each)"
        )


def _check_manifest(m: Manifest, node: str) -> None:
    """A peer's manifest is input: names become paths and headers, sizes become allocations."""
    for name in m.files:
        if not _NAME.match(name) or name.endswith(".safetensors") or name == SHARD_MANIFEST:
            raise WeightsError(f"node {node} lists a file with a forbidden name {name!r}")
    for name, t in m.tensors.items():
        if not name or len(name) > 500 or any(ord(c) < 32 for c in name):
            raise WeightsError(f"node {node} lists a tensor with a forbidden name {name!r}")
        item = _ITEMSIZE.get(t.dtype)
        if any(d < 0 for d in t.shape) or (item is not None and math.prod(t.shape) * item != t.bytes):
            raise WeightsError(f"node {node}: tensor {name} {t.dtype}{t.shape} cannot be {t.bytes} bytes")
    if m.num_layers <= 0:
        raise WeightsError(f"node {node}: model {m.model} has no layers")


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise WeightsError(f"another fetch holds {path}") from exc
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _layout(plan: list[tuple[str, TensorEntry]]) -> list[int]:
    offsets, off = [], 0
    for _, e in plan:
        offsets.append(off)
        off += e.bytes
    return offsets


class _Fetch:
    """A fetch's state in its working directory: what is planned, which chunks are in, which tensors check."""

    PART = WEIGHTS_FILE + ".part"

    def __init__(
        self,
        src: _Source,
        manifest: Manifest,
        span: StageSpan,
        names: list[str],
        work: Path,
        chunk_bytes: int,
        stats: FetchStats,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.src = src
        self.manifest = manifest
        self.digest = manifest.digest()
        self.span = span
        self.plan = [(n, manifest.tensors[n]) for n in names]
        self.offsets = _layout(self.plan)
        self.header = _output_header(self.plan, manifest.metadata)
        self.files = {n: f for n, f in manifest.files.items() if n not in _NOT_COPIED}
        self.work = work
        self.stats = stats
        self.progress = progress
        identity = {"digest": self.digest, "tensors": names, "files": sorted(self.files)}
        self.plan_id = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
        self.chunk_bytes = chunk_bytes
        self.done: list[set[int]] = [set() for _ in self.plan]
        self.ok: set[int] = set()
        self.attempts: dict[str, int] = {}
        self.total = sum(e.bytes for _, e in self.plan) + sum(f.size for f in self.files.values())
        self.received = 0  # bytes accounted as in place (for progress)
        self.fd: int | None = None
        self.log: TextIO | None = None

    # -- persistent state

    def _part(self) -> Path:
        return self.work / self.PART

    def open(self) -> None:
        """Resume the working directory when it holds this very plan, else start it afresh."""
        plan_path = self.work / "plan.json"
        part_size = len(self.header) + sum(e.bytes for _, e in self.plan)
        try:
            saved = json.loads(plan_path.read_text())
            resumable = (
                saved["plan_id"] == self.plan_id
                and 0 < int(saved["chunk_bytes"]) <= MAX_CHUNK_BYTES
                and self._part().stat().st_size == part_size
            )
        except (OSError, ValueError, KeyError, TypeError):
            resumable = False
        if resumable:
            self.chunk_bytes = int(saved["chunk_bytes"])  # chunk numbers in the log count in these
            self._replay()
        else:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work.mkdir(parents=True)
            with self._part().open("wb") as f:
                f.write(self.header)
                f.truncate(part_size)  # sparse: chunks land at their final offsets in any order
            plan_path.write_text(json.dumps({"plan_id": self.plan_id, "chunk_bytes": self.chunk_bytes}))
        self.fd = os.open(self._part(), os.O_RDWR)
        self.log = (self.work / "done.log").open("a", buffering=1)  # one line per event, flushed at once

    def _replay(self) -> None:
        try:
            lines = (self.work / "done.log").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            parts = line.split()
            try:
                kind, t = parts[0], int(parts[1])
                if not 0 <= t < len(self.plan):
                    continue
                if kind == "c" and 0 <= (c := int(parts[2])) < self.chunks_of(t):
                    self.done[t].add(c)
                elif kind == "ok":
                    self.ok.add(t)
                elif kind == "bad":
                    self.ok.discard(t)
                    self.done[t].clear()
            except (IndexError, ValueError):
                continue  # a line cut short by a crash: that chunk simply comes again
        for t in self.ok:
            self.done[t] = set(range(self.chunks_of(t)))  # checked whole, also when copied from a local copy
        resumed = sum(self._tensor_done_bytes(t) for t in range(len(self.plan)))
        self.stats.bytes_resumed += resumed
        self.received += resumed

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.log is not None:
            self.log.close()
            self.log = None

    # -- accounting

    def chunks_of(self, t: int) -> int:
        return math.ceil(self.plan[t][1].bytes / self.chunk_bytes)

    def _tensor_done_bytes(self, t: int) -> int:
        size = self.plan[t][1].bytes
        return sum(min(self.chunk_bytes, size - c * self.chunk_bytes) for c in self.done[t])

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.received, self.total)

    # -- verification

    def _verify(self, t: int) -> bool:
        name, e = self.plan[t]
        if _hash_range(self.fd, len(self.header) + self.offsets[t], e.bytes) == e.sha256:
            self.ok.add(t)
            self.log.write(f"ok {t}\n")
            return True
        # Wrong bytes from the wire or the disk: fetch the whole tensor again, a bounded number of times.
        self.attempts[name] = self.attempts.get(name, 0) + 1
        if self.attempts[name] > self.src.retries:
            raise WeightsError(
                f"tensor {name} of {self.src.model} from node {self.src.node} does not match its sha256 "
                f"after {self.attempts[name]} fetches: the source's copy is corrupt (check it with verify)"
            )
        self.stats.refetched.append(name)
        self.done[t].clear()
        self.log.write(f"bad {t}\n")
        self.total += e.bytes  # keeps (done, total) monotonic: the bytes come again
        return False

    # -- the work

    def seed_from(self, old_dir: Path) -> None:
        """Copy tensors and files whose hashes the old local copy shares: only what differs travels."""
        try:
            old = read_shard_manifest(old_dir)
        except WeightsError:
            return
        for t, (name, e) in enumerate(self.plan):
            o = old.tensors.get(name)
            if t in self.ok or self.done[t] or o is None or o.sha256 != e.sha256 or o.bytes != e.bytes:
                continue
            try:
                fd = os.open(old_dir / o.file, os.O_RDONLY)
            except OSError:
                continue
            try:
                copied = 0
                while copied < e.bytes:
                    block = os.pread(fd, min(_HASH_BLOCK, e.bytes - copied), o.offset + copied)
                    if not block:
                        break
                    os.pwrite(self.fd, block, len(self.header) + self.offsets[t] + copied)
                    copied += len(block)
            finally:
                os.close(fd)
            if copied == e.bytes and _hash_range(self.fd, len(self.header) + self.offsets[t], e.bytes) == (
                e.sha256
            ):
                self.ok.add(t)
                self.done[t] = set(range(self.chunks_of(t)))
                self.log.write(f"ok {t}\n")
                self.received += e.bytes
                self.stats.bytes_reused += e.bytes
        for name, f in self.files.items():
            src = old_dir / name
            dst = self.work / name
            if dst.exists() or not src.is_file() or src.stat().st_size != f.size:
                continue
            if _hash_file(src) == f.sha256:
                shutil.copyfile(src, dst)

    def fetch_files(self) -> None:
        for name, f in self.files.items():
            path = self.work / name
            if path.is_file() and path.stat().st_size == f.size and _hash_file(path) == f.sha256:
                self.received += f.size  # resumed, or copied from the earlier local copy
                self.stats.bytes_reused += f.size
                self.report()
                continue
            for attempt in range(self.src.retries + 1):
                data = bytearray()
                while len(data) < f.size:
                    n = min(self.chunk_bytes, f.size - len(data))
                    req = ChunkRequest(name=name, offset=len(data), length=n, digest=self.digest)
                    data += self.src.chunk("file", req, n)
                    self.stats.chunks += 1
                self.stats.bytes_received += len(data)
                if hashlib.sha256(data).hexdigest() == f.sha256:
                    break
                self.stats.refetched.append(name)
                if attempt == self.src.retries:
                    raise WeightsError(
                        f"file {name} of {self.src.model} from node {self.src.node} does not match its sha256"
                    )
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self.received += f.size
            self.report()

    def fetch_tensors(self, parallel: int) -> None:
        for t in range(len(self.plan)):
            if t not in self.ok and len(self.done[t]) == self.chunks_of(t):
                self._verify(t)  # all bytes in from an earlier run, not yet checked (or empty tensors)
        pending: deque[tuple[int, int]] = deque(
            (t, c) for t in range(len(self.plan)) if t not in self.ok for c in range(self.chunks_of(t))
            if c not in self.done[t]
        )  # fmt: skip
        self.report()
        in_flight: dict[Future[int], tuple[int, int]] = {}
        with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="fetch") as pool:
            try:
                while pending or in_flight:
                    while pending and len(in_flight) < parallel:
                        t, c = pending.popleft()
                        in_flight[pool.submit(self._get_chunk, t, c)] = (t, c)
                    finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        t, c = in_flight.pop(fut)
                        n = fut.result()
                        self.done[t].add(c)
                        self.log.write(f"c {t} {c}\n")  # only after its bytes are written
                        self.received += n
                        self.stats.bytes_received += n
                        self.stats.chunks += 1
                        if len(self.done[t]) == self.chunks_of(t) and not self._verify(t):
                            pending.extend((t, k) for k in range(self.chunks_of(t)))
                        self.report()
            finally:
                for fut in in_flight:
                    fut.cancel()  # running ones finish their write; the log does not claim them

    def _get_chunk(self, t: int, c: int) -> int:
        name, e = self.plan[t]
        offset = c * self.chunk_bytes
        n = min(self.chunk_bytes, e.bytes - offset)
        req = ChunkRequest(name=name, offset=offset, length=n, digest=self.digest)
        data = self.src.chunk("tensor", req, n)
        os.pwrite(self.fd, data, len(self.header) + self.offsets[t] + offset)
        return n

    def finish(self, final: Path) -> None:
        """Seal the working directory and put it in place of `final` with renames."""
        os.pwrite(self.fd, self.header, 0)  # the tensors are checked; make sure the header is what we planned
        os.fsync(self.fd)
        self.close()
        os.replace(self._part(), self.work / WEIGHTS_FILE)
        data_start = len(self.header)
        tensors = {
            name: e.model_copy(update={"file": WEIGHTS_FILE, "offset": data_start + self.offsets[t]})
            for t, (name, e) in enumerate(self.plan)
        }
        shard = Manifest(
            model=self.manifest.model,
            num_layers=self.manifest.num_layers,
            tied=self.manifest.tied,
            metadata=self.manifest.metadata,
            files=self.files,
            tensors=tensors,
            layers=self.span,
            source=SourceInfo(node=self.src.node, digest=self.digest),
        )
        shard.stamps = _current_stamps(self.work, [WEIGHTS_FILE, *self.files]) or {}
        (self.work / SHARD_MANIFEST).write_text(shard.model_dump_json(indent=1))
        for scratch in ("plan.json", "done.log"):
            (self.work / scratch).unlink(missing_ok=True)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(self.work, final)
        shutil.rmtree(old, ignore_errors=True)


def fetch_shard(
    session: zenoh.Session,
    namespace: str,
    source_node: str,
    model: str,
    start: int,
    end: int,
    dest_root: Path,
    progress: Callable[[int, int], None] | None = None,
    chunk_bytes: int = 4 << 20,
    timeout_s: float = 300.0,
    *,
    parallel: int = 4,
    retries: int = 3,
    min_rate_bps: float = 1 << 20,
    discover_s: float = 5.0,
    stats: FetchStats | None = None,
) -> Path:
    """Fetch the tensors of layers [start, end) of `model` from `source_node` into `dest_root/model`.

    `progress(done, total)` gets bytes in place and bytes to place, both never decreasing (a tensor that
    fails its hash adds its size to both as it comes again). `timeout_s` bounds the wait for the manifest
    (a source hashes a model it never hashed before); each chunk's deadline is 5 s plus its size at
    `min_rate_bps`, with `retries` more tries. `discover_s`: how long to wait for the source to be routed.
    An existing stage directory is checked and repaired: only tensors that differ travel.
    """
    _check_name("model", model)
    _check_name("node", source_node)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
    if parallel < 1 or retries < 0:
        raise ValueError("parallel must be >= 1 and retries >= 0")
    stats = stats if stats is not None else FetchStats()
    t0 = time.monotonic()
    src = _Source(session, namespace, source_node, model, retries, min_rate_bps)
    manifest = src.manifest(timeout_s, discover_s)
    _check_manifest(manifest, source_node)
    total = manifest.num_layers
    if not 0 <= start < end <= total:
        raise ValueError(f"bad layer range [{start}, {end}) for {model} with {total} layers")
    if manifest.layers is not None and not manifest.layers.start <= start < end <= manifest.layers.end:
        have = manifest.layers
        raise ModelNotOnSourceError(
            f"node {source_node} holds layers [{have.start}, {have.end}) of {model}, not [{start}, {end})"
        )
    names = tensors_for(manifest.tensors, start, end, total, manifest.tied)
    if not names:
        raise WeightsError(f"model {model} on node {source_node} has no tensors for layers [{start}, {end})")
    span = StageSpan(start=start, end=end, total=total)

    dest_root = Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root / model
    if final.exists() and not (final / SHARD_MANIFEST).is_file():
        raise WeightsError(f"{final} holds a model that was not fetched as a stage: not replacing it")
    with _exclusive(dest_root / f".{model}.fetch.lock"):
        job = _Fetch(src, manifest, span, names, dest_root / f".{model}.fetch", chunk_bytes, stats, progress)
        if final.exists() and _up_to_date(final, job):
            job.received = job.total
            job.report()
            stats.seconds = time.monotonic() - t0
            return final
        try:
            job.open()
            if final.exists():
                job.seed_from(final)
            job.fetch_files()
            job.fetch_tensors(parallel)
            job.finish(final)
        finally:
            job.close()
        job.report()
    stats.seconds = time.monotonic() - t0
    log.info(
        "fetched %s layers [%d, %d) from %s: %d bytes received, %d reused, %d resumed in %.1fs",
        model, start, end, source_node, stats.bytes_received, stats.bytes_reused, stats.bytes_resumed,
        stats.seconds,
    )  # fmt: skip
    return final


def _up_to_date(final: Path, job: _Fetch) -> bool:
    """The stage directory already holds exactly this plan, intact."""
    try:
        old = read_shard_manifest(final)
    except WeightsError:
        return False
    same = (
        old.layers == job.span
        and {n: e.sha256 for n, e in old.tensors.items()} == {n: e.sha256 for n, e in job.plan}
        and {n: f.sha256 for n, f in old.files.items()} == {n: f.sha256 for n, f in job.files.items()}
    )
    return same and not verify_shard(final)
