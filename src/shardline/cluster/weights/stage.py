"""Where a node gets the weights of a stage it was told to run, always checked against the model digest the
master names: its own whole copy if that matches, its stage copy if that matches, else a copy from the
holders the master named, each one refused when its bytes do not match and the next one tried.

What it refuses is said through `notify(node, message)` (the node turns it into a cluster event): a source
that sent bad bytes, its own whole copy that does not match (moved aside: never loaded, never deleted), or its
stage copy that does not match (fetched again: only what differs travels).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import zenoh

from shardline.cluster.weights.errors import SourceRefusedError, WeightsError
from shardline.cluster.weights.fetch import fetch_shard
from shardline.cluster.weights.files import SHARD_MANIFEST, weight_files
from shardline.cluster.weights.manifest import read_shard_manifest, set_aside
from shardline.cluster.weights.sources import fetch_order
from shardline.cluster.weights.verify import check_full_copy, check_stage_copy

Progress = Callable[[int, int, str], None]  # bytes in place, bytes to place, source node


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
        if (target / SHARD_MANIFEST).is_file():
            try:
                have = read_shard_manifest(target).layers
            except WeightsError:
                have = None
            if have is not None and have.start <= start and end <= have.end:
                if not (bad := check_stage_copy(target, expected)):
                    return target
                notify(
                    self.node_id,
                    f"the stage copy of model {model} on node {self.node_id} does not match the expected "
                    f"digest ({', '.join(bad[:3])}): not loaded, fetching it again",
                )
        elif (target / "config.json").is_file() and weight_files(target):
            if not (bad := check_full_copy(target, expected, start, end)):
                return target
            aside = set_aside(target)  # never loaded, never served again; kept for its owner to look at
            self._changed()
            notify(
                self.node_id,
                f"the local copy of model {model} on node {self.node_id} does not match the expected digest "
                f"({'; '.join(bad[:3])}): not loaded, moved aside as {aside.name}",
            )
        return self._fetch(model, start, end, expected, sources, progress, notify)

    def _fetch(
        self,
        model: str,
        start: int,
        end: int,
        expected: str,
        sources: list[str],
        progress: Progress,
        notify: Callable[[str, str], None],
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
                    self.models_root,
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
