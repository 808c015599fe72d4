"""Where a node gets the weights of a stage it was told to run, always checked against the model digest the
master names: its own whole copy if that matches, its stage copy if that matches, else a copy from the
holders the master named, each one refused when its bytes do not match and the next one tried.

What it refuses is said through `notify(node, message)` (the node turns it into a cluster event): a source
that sent bad bytes, its own whole copy that does not match, or its stage copy that does not match (fetched
again: only what differs travels).

A whole copy is moved aside (never loaded, never deleted) only on this node's own evidence: its bytes no
longer match the digests its own import recorded. A copy intact as recorded is another version, or one not
hashed yet: it stays where it is, serving as what it is, and the expected version's stage is fetched beside it
(VERSIONS_DIR), so a peer's word (the digest a command names) never moves a legitimate copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import zenoh

from shardline.cluster.weights.fetch import fetch_shard
from shardline.cluster.weights.sources import fetch_order
from shardline.models.store.errors import SourceRefusedError, WeightsError
from shardline.models.store.files import SHARD_MANIFEST, weight_files
from shardline.models.store.manifest import import_record, read_shard_manifest, set_aside, tensors_for
from shardline.models.store.verify import check_full_copy, check_stage_copy, verify_copy

Progress = Callable[[int, int, str], None]  # bytes in place, bytes to place, source node


def versions_dir(expected: str) -> str:
    """Where a stage of version `expected` goes when the node's own copy is another version (hidden: never
    listed, never served)."""
    return f".version-{expected[:16]}"


class StageWeights:
    def __init__(
        self,
        session: zenoh.Session,
        namespace: str,
        node_id: str,
        models_root: Path,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        """changed(): the models on disk changed (the node rescans them for its report)."""
        self.session = session
        self.namespace = namespace
        self.node_id = node_id
        self.models_root = Path(models_root)
        self._changed = changed
        self._lock = threading.Lock()
        self._refused: dict[tuple[str, str], float] = {}  # (model, source) -> when it was refused (monotonic)
        self._busy: dict[str, threading.Lock] = {}  # model -> held while one stage's weights are got

    def get(
        self,
        model: str,
        start: int,
        end: int,
        expected: str,
        sources: list[str],
        progress: Progress,
        notify: Callable[[str, str], None],
    ) -> Path:
        """The local directory holding layers [start, end) of `model`, every byte matching digest `expected`.
        notify(node, message): a copy was refused (the node at fault, and why)."""
        if not expected:
            raise WeightsError(
                f"no expected digest of model {model!r} came with the command: not loading it unchecked"
            )
        with self._lock:
            busy = self._busy.setdefault(model, threading.Lock())
        with busy:  # two stages of one model at once: one checks, moves or fetches, the other sees the result
            return self._get(model, start, end, expected, sources, progress, notify)

    def _get(
        self,
        model: str,
        start: int,
        end: int,
        expected: str,
        sources: list[str],
        progress: Progress,
        notify: Callable[[str, str], None],
    ) -> Path:
        target = self.models_root / model
        root = self.models_root
        if (target / SHARD_MANIFEST).is_file():
            if (done := self._stage_copy(target, model, start, end, expected, notify)) is not None:
                return done
        elif (target / "config.json").is_file() and weight_files(target):
            if not (bad := check_full_copy(target, expected, start, end)):
                return target
            if corrupt := self._corrupt(target, start, end):
                aside = set_aside(target)  # its own record says its bytes changed: never loaded again
                self._changed()
                notify(
                    self.node_id,
                    f"the local copy of model {model} on node {self.node_id} does not match the expected "
                    f"digest, nor its own import record ({'; '.join(corrupt[:3])}): not loaded, moved aside "
                    f"as {aside.name}",
                )
            else:
                root = self.models_root / versions_dir(expected)
                beside = root / model
                if (beside / SHARD_MANIFEST).is_file() and (
                    done := self._stage_copy(beside, model, start, end, expected, notify)
                ) is not None:
                    return done
                notify(
                    self.node_id,
                    f"the local copy of model {model} on node {self.node_id} is not the expected version "
                    f"({'; '.join(bad[:3])}): kept as it is, the expected version's stage fetched beside it",
                )
        return self._fetch(model, start, end, expected, sources, progress, notify, root)

    def _stage_copy(
        self, path: Path, model: str, start: int, end: int, expected: str, notify: Callable[[str, str], None]
    ) -> Path | None:
        """`path` when it holds layers [start, end) with every byte as `expected`; None to fetch them."""
        try:
            have = read_shard_manifest(path).layers
        except WeightsError:
            have = None
        if have is None or not (have.start <= start and end <= have.end):
            return None
        if not (bad := check_stage_copy(path, expected)):
            return path
        notify(
            self.node_id,
            f"the stage copy of model {model} on node {self.node_id} does not match the expected "
            f"digest ({', '.join(bad[:3])}): not loaded, fetching it again",
        )
        return None

    @staticmethod
    def _corrupt(target: Path, start: int, end: int) -> list[str]:
        """What of layers [start, end) no longer matches this copy's own import record (empty: intact as
        recorded, or never recorded: nothing here proves it bad)."""
        record = import_record(target)
        if record is None:
            return []
        names = tensors_for(record.tensors, start, end, record.num_layers, record.tied)
        return [f"{name} changed since its import" for name in verify_copy(target, record, set(names))]

    def _fetch(
        self,
        model: str,
        start: int,
        end: int,
        expected: str,
        sources: list[str],
        progress: Progress,
        notify: Callable[[str, str], None],
        root: Path,
    ) -> Path:
        with self._lock:
            refused = {s: at for (m, s), at in self._refused.items() if m == model}
        order = fetch_order(sources, self.node_id, refused, time.monotonic())
        if not order:
            raise WeightsError(f"model {model!r} with the expected digest is on no other node of the cluster")
        errors = []
        for source in order:
            try:
                path = fetch_shard(
                    self.session,
                    self.namespace,
                    source,
                    model,
                    start,
                    end,
                    root,
                    progress=lambda done, total, src=source: progress(done, total, src),
                    expected=expected,
                )
            except SourceRefusedError as exc:
                with self._lock:
                    self._refused[(model, source)] = time.monotonic()
                notify(source, f"{exc} (checked by node {self.node_id})")
                errors.append(str(exc))
                continue
            except Exception as exc:
                errors.append(f"{source}: {exc}")
                continue
            self._changed()  # rescan: the report now lists the stage
            return path
        raise WeightsError("; ".join(errors))
