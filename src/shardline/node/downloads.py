"""The downloads the master asked of this node: a model no live node held, fetched once for the cluster.

Each runs in its own thread through the one resolver (models/registry.py `resolve_model`), into this node's
models directory under the model's name; the reports carry its progress (bytes on disk against the hub's
sizes). A node that crashes mid-download finds the download still in the master's view when it is back and
starts it again: the hub client resumes the partial files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from shardline.cluster import messages as cm

log = logging.getLogger("shardline.node")


class Downloads:
    def __init__(self, node_id: str, models_root: Path, on_done: Callable[[], None]) -> None:
        self.node_id = node_id
        self.models_root = models_root
        self._on_done = on_done  # the holdings are read again: the model is listed (and hashed) at once
        self._lock = threading.Lock()
        self._progress: dict[str, cm.DownloadProgress] = {}
        self._running: dict[str, threading.Thread] = {}
        self._asked: dict[str, float] = {}  # model -> the `since` of the master's request it serves

    def follow(self, view: cm.ClusterView) -> None:
        """Start the downloads the view asks of this node that are not running (nor done for that ask)."""
        for d in view.downloads:
            if d.node_id != self.node_id:
                continue
            with self._lock:
                if d.model in self._running or self._asked.get(d.model) == d.since:
                    continue
                self._asked[d.model] = d.since
                self._progress[d.model] = cm.DownloadProgress(source=d.source, phase="downloading")
                t = threading.Thread(target=self._run, args=(d,), daemon=True, name=f"download-{d.model}")
                self._running[d.model] = t
            t.start()

    def progress(self) -> dict[str, cm.DownloadProgress]:
        with self._lock:
            return dict(self._progress)

    def _set(self, model: str, **changes: object) -> None:
        with self._lock:
            if (p := self._progress.get(model)) is not None:
                self._progress[model] = p.model_copy(update=changes)

    def _run(self, d: cm.Download) -> None:
        from shardline.models.registry import materialize

        log.info("downloading %s from %s for the cluster", d.model, d.source)
        try:
            materialize(
                d.source,
                self.models_root,
                d.model,
                progress=False,
                on_bytes=lambda done, total: self._set(d.model, done_bytes=done, total_bytes=total),
                on_phase=lambda phase: self._set(d.model, phase=phase),
            )
        except Exception as exc:  # one line for the client that waits; the node lives on
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("download of %s from %s failed: %s", d.model, d.source, why)
            self._set(d.model, phase="failed", error=why)
        else:
            self._set(d.model, phase="done")
            log.info("downloaded %s from %s", d.model, d.source)
            self._on_done()
        finally:
            with self._lock:
                self._running.pop(d.model, None)
