"""Copying a stage's tensors from a peer: resumable, in parallel chunks, each tensor checked by its hash.
The questions to the peer, and the checks of what it says before anything is trusted, are in peer.py.

With `expected` (the model digest the master names), the source's manifest must be a whole model's whose
digest is that one: the hashes every byte is then checked against are the model's, not whatever the source
says. A source that fails any check is refused (`SourceRefusedError`); what was already verified stays in
the working directory, so a fetch from the next holder resumes from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TextIO

import zenoh

from shardline.cluster.weights.peer import WeightSource, check_digest, check_manifest
from shardline.cluster.weights.protocol import MAX_CHUNK_BYTES, ChunkRequest
from shardline.models.store.errors import ModelNotOnSourceError, SourceRefusedError, WeightsError
from shardline.models.store.files import (
    HASH_BLOCK,
    SHARD_MANIFEST,
    WEIGHTS_FILE,
    check_name,
    current_stamps,
    hash_file,
    hash_range,
)
from shardline.models.store.manifest import (
    Manifest,
    SourceInfo,
    StageSpan,
    TensorEntry,
    derive_layout,
    read_shard_manifest,
    tensors_for,
)
from shardline.models.store.verify import verify_shard

log = logging.getLogger("shardline.weights")

# The importer's provenance file says "a complete import of X": a stage directory must not pose as one.
_NOT_COPIED = frozenset({"shardline_import.json"})


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


@dataclass
class FetchStats:
    bytes_received: int = 0  # over the network
    bytes_resumed: int = 0  # already in place from an interrupted fetch
    bytes_reused: int = 0  # copied from the earlier local copy (a repair, or a new range that overlaps)
    chunks: int = 0
    refetched: list[str] = field(default_factory=list)  # tensors/files whose bytes failed their hash
    seconds: float = 0.0


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


class _Fetch:
    """A fetch's state in its working directory: what is planned, which chunks are in, which tensors check."""

    PART = WEIGHTS_FILE + ".part"

    def __init__(
        self,
        src: WeightSource,
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
        self.offsets = list(itertools.accumulate((e.bytes for _, e in self.plan), initial=0))[:-1]
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
        # Tensors with chunks from an earlier run, not yet checked: a crash may have lost some of their bytes,
        # so a mismatch there is ours and they come again; a mismatch of bytes all sent now is the source's.
        self.resumed: set[int] = set()
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
        self.resumed = {t for t in range(len(self.plan)) if self.done[t] and t not in self.ok}
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
        if hash_range(self.fd, len(self.header) + self.offsets[t], e.bytes) == e.sha256:
            self.ok.add(t)
            self.resumed.discard(t)
            self.log.write(f"ok {t}\n")
            return True
        if t not in self.resumed:
            self.refuse(f"tensor {name} does not match its sha256 (its copy there is corrupt or altered)")
        self.resumed.discard(t)  # bytes left by an interrupted run: fetch the whole tensor again, once
        self.stats.refetched.append(name)
        self.done[t].clear()
        self.log.write(f"bad {t}\n")
        self.total += e.bytes  # keeps (done, total) monotonic: the bytes come again
        return False

    def refuse(self, why: str) -> NoReturn:
        """Give the source up: unchecked chunks are forgotten (the next source sends them again)."""
        for t in range(len(self.plan)):
            if t not in self.ok and self.done[t]:
                self.done[t].clear()
                if self.log is not None:
                    self.log.write(f"bad {t}\n")
        raise SourceRefusedError(self.src.node, self.src.model, why)

    def check_layout(self) -> None:
        """The layer count and head tying the plan used must be what the (checked) config.json and tensor
        names say. Only a whole model's can be derived so: a stage holder lists only some tensors."""
        if self.manifest.layers is not None:
            return
        try:
            config = json.loads((self.work / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            self.refuse(f"its config.json is missing or unreadable ({exc})")
        if not isinstance(config, dict):
            self.refuse("its config.json is not an object")
        claimed = (self.manifest.num_layers, self.manifest.tied)
        derived = derive_layout(config, self.manifest.tensors)
        if claimed != derived:
            self.refuse(f"it claims (layers, tied) = {claimed}, its config and tensors say {derived}")

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
                    block = os.pread(fd, min(HASH_BLOCK, e.bytes - copied), o.offset + copied)
                    if not block:
                        break
                    os.pwrite(self.fd, block, len(self.header) + self.offsets[t] + copied)
                    copied += len(block)
            finally:
                os.close(fd)
            if copied == e.bytes and hash_range(self.fd, len(self.header) + self.offsets[t], e.bytes) == (
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
            if hash_file(src) == f.sha256:
                shutil.copyfile(src, dst)

    def fetch_files(self) -> None:
        for name, f in self.files.items():
            path = self.work / name
            if path.is_file() and path.stat().st_size == f.size and hash_file(path) == f.sha256:
                self.received += f.size  # resumed, or copied from the earlier local copy
                self.stats.bytes_reused += f.size
                self.report()
                continue
            data = bytearray()
            while len(data) < f.size:
                n = min(self.chunk_bytes, f.size - len(data))
                req = ChunkRequest(name=name, offset=len(data), length=n, digest=self.digest)
                data += self.src.chunk("file", req, n)
                self.stats.chunks += 1
            self.stats.bytes_received += len(data)
            if hashlib.sha256(data).hexdigest() != f.sha256:
                self.refuse(f"file {name} does not match its sha256 (its copy there is corrupt or altered)")
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
            source=SourceInfo(node=self.src.node, digest=self.manifest.model_digest()),
        )
        shard.stamps = current_stamps(self.work, [WEIGHTS_FILE, *self.files]) or {}
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
    expected: str | None = None,
) -> Path:
    """Fetch the tensors of layers [start, end) of `model` from `source_node` into `dest_root/model`.

    `progress(done, total)` gets bytes in place and bytes to place, both never decreasing (a tensor that
    fails its hash adds its size to both as it comes again). `timeout_s` bounds the wait for the manifest
    (a source hashes a model it never hashed before); each chunk's deadline is 5 s plus its size at
    `min_rate_bps`, with `retries` more tries. `discover_s`: how long to wait for the source to be routed.
    An existing stage directory is checked and repaired: only tensors that differ travel.
    `expected`: the model digest the copy must have (a source that cannot prove it is refused); None checks
    the bytes against the source's own manifest only (tools and tests of the transfer itself).
    """
    check_name("model", model)
    check_name("node", source_node)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
    if parallel < 1 or retries < 0:
        raise ValueError("parallel must be >= 1 and retries >= 0")
    stats = stats if stats is not None else FetchStats()
    t0 = time.monotonic()
    src = WeightSource(session, namespace, source_node, model, retries, min_rate_bps)
    manifest = src.manifest(timeout_s, discover_s)
    check_manifest(manifest, source_node)
    if expected is not None:
        check_digest(manifest, source_node, model, expected)
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
            job.check_layout()
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
    # Another model digest with the same tensors (a version that differs elsewhere): rewritten, from itself.
    same = (
        old.layers == job.span
        and old.model_digest() == job.manifest.model_digest()
        and {n: e.sha256 for n, e in old.tensors.items()} == {n: e.sha256 for n, e in job.plan}
        and {n: f.sha256 for n, f in old.files.items()} == {n: f.sha256 for n, f in job.files.items()}
    )
    return same and not verify_shard(final)
