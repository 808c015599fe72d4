"""What a soak watches while it runs: each node's master and term, instances said failed, the RSS of every
node daemon and runner process, runners left without their node, and the slots still held once idle."""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from typing import Any

import psutil

from shardline.bench.soak_cluster import SoakCluster, get
from shardline.bench.soak_faults import FaultRecord

MARKER = "SHARDLINE_SOAK_RUN"  # in every node's (so every runner's) environment: the run they belong to
ORPHAN_GRACE_S = 10.0  # a runner may outlive its node this long (it notices and exits) before it is an orphan
RESTART_EXCLUDE_S = 60.0  # RSS samples this soon after a node (re)started are not compared


class Watch:
    def __init__(self, nodes: SoakCluster, record: FaultRecord, run_id: str) -> None:
        self.nodes = nodes
        self.record = record  # when nodes were restarted: their RSS right after is not compared
        self.run_id = run_id
        self.rss: dict[str, list[tuple[float, int]]] = defaultdict(list)  # node daemon alone
        self.daemon_pid: dict[str, list[int]] = defaultdict(list)  # beside each sample of self.rss
        self.runner_rss: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)  # (node, pid)
        self.masters: dict[int, set[str]] = defaultdict(set)
        self.orphaned_since: dict[int, float] = {}  # runner pid -> when it was first seen without its node
        self.orphans: dict[int, str] = {}  # pid -> when it was found
        self.failed_instances: dict[str, str] = {}  # instance -> what said it failed, first seen

    def our_runners(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                runner = (
                    "shardline.runner" in cmd or "shardline runner" in cmd
                )  # not a node's --runner-settings
                if runner and p.environ().get(MARKER) == self.run_id:
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def check_orphans(self) -> None:
        """A runner of this run whose parent is no live node of the cluster, for longer than the grace."""
        nodes = {n.proc.pid for n in self.nodes.cluster.nodes.values() if n.proc and n.proc.poll() is None}
        now = time.monotonic()
        for p in self.our_runners():
            try:
                if p.status() == psutil.STATUS_ZOMBIE or p.ppid() in nodes:
                    continue
                # Its node is gone: it has the grace to notice and exit.
                if now - self.orphaned_since.setdefault(p.pid, now) > ORPHAN_GRACE_S:
                    self.orphans.setdefault(p.pid, "its node gone, during the run")
            except psutil.Error:
                pass

    def run(self) -> None:
        """Every second, each node's /state; every third, the RSS of each daemon and runner, and orphans."""
        k = 0
        while not self.nodes.stop.is_set():
            for nid in self.nodes.ids:  # the master and term each node follows (/state: open to any client)
                try:
                    h = self.nodes.state_in(nid)
                except OSError:  # its namespace gone: the lab is closing
                    h = None
                if h is not None:
                    self._note_state(h)
            if k % 3 == 0:
                now = time.monotonic()
                for nid, n in self.nodes.cluster.nodes.items():
                    if n.proc is None or n.proc.poll() is not None:
                        continue
                    # Apart: a node's runners move between nodes as stages are re-placed, so a node's total
                    # says where the stages are, not whether anything leaks.
                    try:
                        root = psutil.Process(n.proc.pid)
                        self.rss[nid].append((now, root.memory_info().rss))
                        self.daemon_pid[nid].append(root.pid)
                        for c in root.children(recursive=True):
                            self.runner_rss[(nid, c.pid)].append((now, c.memory_info().rss))
                    except psutil.Error:
                        continue
                self.check_orphans()
            k += 1
            self.nodes.stop.wait(1.0)

    def _note_state(self, h: dict[str, Any]) -> None:
        """One node's /state: the master it follows in its term, and any instance it says failed (with who
        said so, in which term, and when in the run it was first heard)."""
        if h.get("master") is not None:
            self.masters[int(h.get("term", 0))].add(h["master"])
        at = time.monotonic() - self.nodes.t0
        said = f"{h.get('node')} (term {h.get('term')}, master {h.get('master')}) at {at:.0f}s"
        for i in h.get("instances", []):
            if i.get("phase") == "failed":
                self.failed_instances.setdefault(str(i.get("instance")), f"{said}: {i.get('why', '')}")
        for e in h.get("events", []):
            if e.get("kind") == "failed":
                self.failed_instances.setdefault(str(e.get("instance")), f"{said}: {e.get('message', '')}")

    def rss_series(self) -> dict[str, list[float]]:
        """Each node daemon's RSS in MB, one sample a minute from the first: whether growth levels off."""
        out = {}
        for nid, samples in sorted(self.rss.items()):
            series, next_t = [], samples[0][0] if samples else 0.0
            for t, v in samples:
                if t >= next_t:
                    series.append(round(v / 2**20, 1))
                    next_t = t + 60.0
            out[nid] = series
        return out

    def runner_ratios(self, t_start: float, t_end: float) -> dict[str, float]:
        """Each runner process that lived through most of the run: the mean RSS of the last fifth of its
        samples over the first fifth (its first minute, warm-up and first allocations, left out)."""
        out = {}
        for (nid, pid), samples in sorted(self.runner_rss.items()):
            if not samples or samples[-1][0] - samples[0][0] < 0.6 * (t_end - t_start):
                continue
            steady = [
                (t, v)
                for t, v in samples
                if t - samples[0][0] >= min(RESTART_EXCLUDE_S, 0.2 * (t_end - t_start))
            ]
            fifth = max(1, len(steady) // 5)
            first, last = [v for _, v in steady[:fifth]], [v for _, v in steady[-fifth:]]
            if first and last:
                out[f"{nid}/{pid}"] = round(statistics.mean(last) / statistics.mean(first), 3)
        return out

    def daemon_rss_ratio(self, nid: str, t_start: float, t_end: float) -> float | None:
        """The growth of the node's daemon process: the mean RSS of the last fifth of its life in the run over
        the first fifth. A node the soak restarted runs a new process, which is measured over its own life
        (after its warm-up): the process before it was killed by the soak and cannot have leaked since, and
        comparing the two measures their different jobs (a restarted node copies its stage's weights back)."""
        pids = self.daemon_pid[nid]
        if not pids:
            return None
        last = pids[-1]
        restarted = any(p != last for p in pids)
        samples = [(t, v) for (t, v), p in zip(self.rss[nid], pids, strict=True) if p == last]
        if restarted:  # its warm-up, as after the run's start
            exclude = min(RESTART_EXCLUDE_S, (t_end - t_start) / 5)
            samples = [(t, v) for t, v in samples if t - samples[0][0] >= exclude]
        samples = [(t, v) for t, v in samples if t_start <= t <= t_end]
        if len(samples) < 2:
            return None
        t0, t1 = samples[0][0], samples[-1][0]
        fifth = (t1 - t0) / 5
        first = [v for t, v in samples if t <= t0 + fifth]
        tail = [v for t, v in samples if t >= t1 - fifth]
        return round(statistics.mean(tail) / statistics.mean(first), 3)

    def rss_ratio(self, nid: str, t_start: float, t_end: float) -> float | None:
        span = t_end - t_start
        exclude = min(RESTART_EXCLUDE_S, span / 5)
        restarts = self.record.restarts.get(nid, [])
        samples = [
            (t, v)
            for t, v in self.rss[nid]
            if t_start <= t <= t_end and not any(0 <= t - r < exclude for r in restarts)
        ]
        first = [v for t, v in samples if t <= t_start + span / 5]
        last = [v for t, v in samples if t >= t_end - span / 5]
        if not first or not last:
            return None
        return round(statistics.mean(last) / statistics.mean(first), 3)

    def pending(self) -> int | None:
        """Slots still held once idle: /health's `pending`, else /metrics' shardline_requests_pending."""
        total = 0
        for nid in self.nodes.ids:
            h = get(self.nodes.api(nid) + "/health", 3.0)
            if h is not None and h.status_code == 200 and "pending" in h.json():
                total += int(h.json()["pending"])
                continue
            m = get(self.nodes.api(nid) + "/metrics", 3.0)
            values = (
                re.findall(r"^shardline_requests_pending(?:\{[^}]*\})?\s+([0-9.eE+-]+)", m.text, re.M)
                if m is not None and m.status_code == 200
                else []
            )
            if not values:
                return None
            total += int(sum(float(v) for v in values))
        return total
