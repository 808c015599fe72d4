"""Real node daemons on loopback (or in network namespaces), for tests and benches.

Each node is a `shardline node` process with its own data directory; its id is written there first, so
tests name nodes (and so who is master: the lowest live id) instead of drawing them at random.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from shardline.cluster.client import ClusterClient
from shardline.cluster.messages import ClusterView

# Overrides of InstanceSettings (controller/settings.py): short liveness settings, so failures are found
# (and tests end) in seconds. Plain dicts: they travel as `--runner-settings` JSON and as Engine keywords.
FAST_RUNNERS: dict[str, float] = {
    "heartbeat_s": 0.2,
    "heartbeat_timeout": 1.5,
    "step_deadline_floor": 1.0,
    "step_timeout": 10.0,
    "backoff_s": 0.05,
    "load_timeout": 60.0,
}


# The real default model: its steps take longer than a tiny one's; heartbeats may wait behind a long prefill.
MODEL_RUNNERS: dict[str, float] = {
    **FAST_RUNNERS,
    "step_timeout": 30.0,
    "step_deadline_floor": 2.0,
    "heartbeat_timeout": 4.0,
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NodeProc:
    node_id: str
    data_dir: Path
    argv: list[str]
    endpoint: str
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def api(self) -> str:
        """The node's HTTP API (http://127.0.0.1:PORT), once it listens (the node chose a free port)."""
        path = self.data_dir / "api-url"
        deadline = time.monotonic() + 60
        while not path.is_file():
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError(f"node {self.node_id} serves no HTTP API:\n{self.tail()}")
            threading.Event().wait(0.05)  # a poll period while waiting on a condition with a deadline
        return path.read_text().strip()

    def start(self, prefix: list[str] | None = None) -> NodeProc:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "node.json").write_text(json.dumps({"id": self.node_id}))
        (self.data_dir / "api-url").unlink(missing_ok=True)  # a previous run's
        self.log = self.data_dir / "node.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*(prefix or []), *self.argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while "listening on" not in self.tail(200):
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError(f"node {self.node_id} did not start:\n{self.tail()}")
            threading.Event().wait(0.05)  # a poll period while waiting on a condition with a deadline

    def runner_pids(self) -> list[int]:
        """The node's runner processes (its children)."""
        try:
            return [
                c.pid
                for c in psutil.Process(self.pid).children()
                if "shardline.runner" in " ".join(c.cmdline())
            ]
        except psutil.Error:
            return []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the node stops its runners), then SIGKILL of its whole group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log else ""
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """Nodes `ids` on loopback; the first one listens on a known port and the others name it as a peer."""

    root: Path
    ids: list[str]
    models_dir: Path
    extra: list[str] = field(default_factory=list)
    node_extra: dict[str, list[str]] = field(default_factory=dict)  # flags of one node only
    # node id -> what runs it instead of `-m shardline` (a test-only launcher: testing/tampering_node.py)
    launchers: dict[str, list[str]] = field(default_factory=dict)
    runners: dict = field(default_factory=lambda: dict(FAST_RUNNERS))
    namespace: str = "shardline"
    api: bool = False  # nodes serve HTTP (on ports they choose; NodeProc.api says which)
    nodes: dict[str, NodeProc] = field(default_factory=dict)
    clients: list[ClusterClient] = field(default_factory=list)
    _peers: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ports = [free_port() for _ in self.ids]
        first = f"tcp/127.0.0.1:{ports[0]}"
        for i, (node_id, port) in enumerate(zip(self.ids, ports, strict=True)):
            endpoint = f"tcp/127.0.0.1:{port}"
            # argv is made at start(): flags set on the cluster after it was made still count.
            self.nodes[node_id] = NodeProc(node_id, self.root / node_id, [], endpoint)
            self._peers[node_id] = [] if i == 0 else [first]

    def argv(self, node_id: str, listen: str, peers: list[str], models_dir: Path | None = None) -> list[str]:
        launcher = self.launchers.get(node_id, ["-m", "shardline"])
        argv = [sys.executable, *launcher, "-v", "node", "--listen", listen, "--name", node_id]
        argv += ["--api-port", "0"] if self.api else ["--no-api"]
        argv += ["--data-dir", str(self.root / node_id), "--models-dir", str(models_dir or self.models_dir)]
        argv += ["--namespace", self.namespace, "--threads", "1", "--prefill-step", "8", "--lease-ms", "2000"]
        argv += ["--runner-settings", json.dumps(self.runners), *self.extra]
        for p in peers:
            argv += ["--peer", p]
        return argv

    def start(self) -> LocalCluster:
        for i, (node_id, n) in enumerate(self.nodes.items()):
            n.argv = self.argv(node_id, n.endpoint, self._peers[node_id])
            n.argv += self.node_extra.get(node_id, [])
            n.start()
            if i == 0:
                # The others join a node that is up: on a loaded machine a late first node (the lowest id,
                # so the master tests expect) could otherwise miss the election it should win.
                n.wait_listening()
        return self

    def add(self, node_id: str, *extra: str, models_dir: Path | None = None) -> NodeProc:
        first = next(iter(self.nodes.values())).endpoint
        port = free_port()
        argv = [*self.argv(node_id, f"tcp/127.0.0.1:{port}", [first], models_dir), *extra]
        self.nodes[node_id] = NodeProc(node_id, self.root / node_id, argv, f"tcp/127.0.0.1:{port}").start()
        return self.nodes[node_id]

    def client(self, via: str | None = None) -> ClusterClient:
        node = self.nodes[via] if via else next(iter(self.nodes.values()))
        c = ClusterClient([node.endpoint], self.namespace)
        self.clients.append(c)
        return c

    def alive_ids(self, view: ClusterView) -> set[str]:
        return {n.node_id for n in view.nodes if n.alive}

    def all_pids(self) -> list[int]:
        pids = []
        for n in self.nodes.values():
            if n.proc is not None and n.proc.poll() is None:
                pids += [n.pid, *n.runner_pids()]
        return pids

    def logs(self) -> str:
        return "\n".join(f"--- {i}\n{n.tail()}" for i, n in self.nodes.items())

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for n in self.nodes.values():
            n.stop()
