"""Serving a node's models to peers: manifests and chunks of tensors and small files, on zenoh queryables."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zenoh
from pydantic import ValidationError

from shardline.cluster.weights.protocol import ChunkRequest, ErrorReply, key_prefix
from shardline.models.store.errors import WeightsError
from shardline.models.store.files import NAME, SHARD_MANIFEST, check_name, stamp, weight_files
from shardline.models.store.manifest import Manifest, model_manifest, record_path

log = logging.getLogger("shardline.weights")

# (model, kind, name, offset, bytes read) -> bytes sent: a test-only fault on the serving side. Only Python
# code can set it (tests/tampering_node.py); no flag, variable or message of a shipped node does.
Tamper = Callable[[str, str, str, int, bytes], bytes]


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message)  # type: ignore[arg-type]


class WeightServer:
    """Answers weight queries for every model under `models_root` (whole models and fetched stages)."""

    def __init__(
        self,
        session: zenoh.Session,
        namespace: str,
        node_id: str,
        models_root: Path,
        threads: int = 4,
        *,
        tamper: Tamper | None = None,
    ) -> None:
        check_name("node", node_id)
        self._tamper = tamper
        self.models_root = Path(models_root)
        self.node_id = node_id
        self._prefix = key_prefix(namespace, node_id) + "/"
        self._lock = threading.Lock()
        self._build_locks: dict[str, threading.Lock] = {}
        self._cache: dict[str, tuple[object, Manifest, str]] = {}  # model -> (dir state, manifest, digest)
        # Replies come from a pool, not zenoh's callback threads: hashing and disk reads never stall zenoh.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"weights-{node_id}")
        self._closed = False
        self._queryable = session.declare_queryable(self._prefix + "**", self._on_query)
        # Read every manifest now, in the background: the first copy a peer asks for (a recovery, most
        # often) then waits on no reading, and what reading costs in memory is paid at start, not mid-run.
        self._pool.submit(self._prepare)

    def _prepare(self) -> None:
        if not self.models_root.is_dir():
            return
        for d in sorted(self.models_root.iterdir()):
            if self._closed:
                return
            # Only what is cheap to read: a model without an import record would be hashed whole here,
            # and that waits for the first peer that asks for it, as before.
            recorded = (d / SHARD_MANIFEST).is_file() or record_path(d).is_file()
            if NAME.match(d.name) and d.is_dir() and recorded:
                with contextlib.suppress(_Refused):
                    self.manifest(d.name)

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
        if len(parts) != 2 or not NAME.match(parts[0]) or parts[1] not in ("manifest", "tensor", "file"):
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
        if self._tamper is not None:
            data = self._tamper(model, kind, req.name, req.offset, data)
        return data

    def _dir_state(self, model_dir: Path) -> object:
        return tuple(sorted((p.name, *stamp(p)) for p in model_dir.iterdir() if p.is_file()))

    def manifest(self, model: str) -> tuple[Manifest, str]:
        """(manifest, digest) of a model held here; rebuilt when its files change."""
        model_dir = self.models_root / model
        if not (model_dir / "config.json").is_file() or not weight_files(model_dir):
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
