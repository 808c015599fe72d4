"""The models a node holds, as its reports list them: each with its footprint and model digest."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from shardline.cluster import messages as cm
from shardline.models.footprint import footprint_from_dir
from shardline.models.store.manifest import local_models, record_imports

log = logging.getLogger("shardline.node")
RECORD_RETRY_S = 60.0  # a model that could not be hashed (still being copied in) is tried again after this
RESCAN_S = 5.0  # the directory is read again at most this often (reports come every half second)


class LocalModels:
    """The models under one directory, read again every RESCAN_S; models that appear without recorded
    digests are hashed in the background."""

    def __init__(self, models_root: Path) -> None:
        self.models_root = models_root
        self._models: dict[str, cm.LocalModel] = {}
        self._models_at = 0.0
        self._recording = threading.Lock()  # one background hashing of newly seen models at a time
        self._record_after = 0.0  # monotonic: when the next background hashing may start

    def get(self) -> dict[str, cm.LocalModel]:
        if time.monotonic() - self._models_at > RESCAN_S or not self._models_at:
            found = {}
            for name, p in local_models(self.models_root).items():
                fp = None
                if p.full:
                    try:
                        fp = footprint_from_dir(self.models_root / name, name)
                    except Exception as exc:
                        log.warning("model %s: %s", name, exc)
                        continue
                found[name] = cm.LocalModel(
                    full=p.full,
                    start=p.start,
                    end=p.end,
                    footprint=fp,
                    digest=p.digest,
                    imported_at=p.imported_at,
                )
            self._models, self._models_at = found, time.monotonic()
            if any(m.full and not m.digest for m in found.values()):
                self._record_later()
        return self._models

    def _record_later(self) -> None:
        """Hash models that appeared since the start beside the reports (a big one takes minutes): they are
        listed without a digest, so never a source nor the truth, until then."""
        if time.monotonic() < self._record_after or not self._recording.acquire(blocking=False):
            return

        def record() -> None:
            try:
                record_imports(self.models_root)
            finally:
                self._record_after = time.monotonic() + RECORD_RETRY_S
                self.rescan()
                self._recording.release()

        threading.Thread(target=record, daemon=True, name="node-record").start()

    def rescan(self) -> None:
        """Read the directory again at the next `get` (a stage was fetched, a model hashed)."""
        self._models_at = 0.0
