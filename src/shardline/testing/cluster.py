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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from shardline.cluster.client import ClusterClient
from shardline.cluster.messages import ClusterView
from shardline.testing.netns import HOST_IF, Host, NetLab
from shardline.trust.credentials import KEY_ENV, TLS_ENV, Credentials

# Overrides of InstanceSettings (instance/settings.py): short liveness settings, so failures are found
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
    env: dict[str, str] | None = None  # the node's environment (its cluster key); None: this process's
    popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen  # how it is started (a lab: in its host)

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
            self.proc = self.popen(
                [*(prefix or []), *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
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
    node_env_extra: dict[str, dict[str, str]] = field(default_factory=dict)  # environment of one node only
    node_models: dict[str, Path] = field(default_factory=dict)  # a models directory of one node's own
    # node id -> what runs it instead of `-m shardline` (a test-only launcher: tests/tampering_node.py)
    launchers: dict[str, list[str]] = field(default_factory=dict)
    runners: dict = field(default_factory=lambda: dict(FAST_RUNNERS))
    namespace: str = "shardline"
    api: bool = False  # nodes serve HTTP (on ports they choose; NodeProc.api says which)
    key: str | None = None  # the cluster key every node gets (in its environment)
    tls_root: Path | None = None  # `cluster init` folder: node X uses tls_root/nodes/X, clients .../client
    nodes: dict[str, NodeProc] = field(default_factory=dict)
    clients: list[ClusterClient] = field(default_factory=list)
    _peers: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ports = [free_port() for _ in self.ids]
        first = f"{self.scheme}/127.0.0.1:{ports[0]}"
        for i, (node_id, port) in enumerate(zip(self.ids, ports, strict=True)):
            endpoint = f"{self.scheme}/127.0.0.1:{port}"
            # argv is made at start(): flags set on the cluster after it was made still count.
            self.nodes[node_id] = NodeProc(node_id, self.root / node_id, [], endpoint)
            self._peers[node_id] = [] if i == 0 else [first]

    @property
    def scheme(self) -> str:
        return "tls" if self.tls_root is not None else "tcp"

    @property
    def credentials(self) -> Credentials:
        """What a client of this cluster joins with."""
        return Credentials(self.key, self.tls_root / "nodes" / "client" if self.tls_root else None)

    def node_env(self, key: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, TLS_ENV)}
        return {**env, KEY_ENV: key} if key is not None else env

    def argv(self, node_id: str, listen: str, peers: list[str], models_dir: Path | None = None) -> list[str]:
        launcher = self.launchers.get(node_id, ["-m", "shardline"])
        argv = [sys.executable, *launcher, "-v", "node", "--listen", listen, "--name", node_id]
        argv += ["--api-port", "0"] if self.api else ["--no-api"]
        argv += ["--data-dir", str(self.root / node_id), "--models-dir", str(models_dir or self.models_dir)]
        argv += ["--namespace", self.namespace, "--threads", "1", "--prefill-step", "8", "--lease-ms", "2000"]
        argv += ["--runner-settings", json.dumps(self.runners), *self.extra]
        if self.tls_root is not None and (self.tls_root / "nodes" / node_id).is_dir():
            argv += ["--tls", str(self.tls_root / "nodes" / node_id)]
        for p in peers:
            argv += ["--peer", p]
        return argv

    def start(self) -> LocalCluster:
        for i, (node_id, n) in enumerate(self.nodes.items()):
            n.argv = self.argv(node_id, n.endpoint, self._peers[node_id], self.node_models.get(node_id))
            n.argv += self.node_extra.get(node_id, [])
            n.env = {**self.node_env(self.key), **self.node_env_extra.get(node_id, {})}
            n.start()
            if i == 0:
                # The others join a node that is up: on a loaded machine a late first node (the lowest id,
                # so the master tests expect) could otherwise miss the election it should win.
                n.wait_listening()
        return self

    def add(
        self, node_id: str, *extra: str, models_dir: Path | None = None, key: str | bool | None = True
    ) -> NodeProc:
        """One more node joining the first; key=True: the cluster's key, else this key (None: none)."""
        first = next(iter(self.nodes.values())).endpoint
        endpoint = f"{self.scheme}/127.0.0.1:{free_port()}"
        argv = [*self.argv(node_id, endpoint, [first], models_dir), *extra]
        env = self.node_env(self.key if key is True else key or None)
        self.nodes[node_id] = NodeProc(node_id, self.root / node_id, argv, endpoint, env=env).start()
        return self.nodes[node_id]

    def client(self, via: str | None = None, credentials: Credentials | None = None) -> ClusterClient:
        node = self.nodes[via] if via else next(iter(self.nodes.values()))
        c = ClusterClient([node.endpoint], self.namespace, credentials or self.credentials)
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


LAB_PORT = 7447  # every node has a namespace, so an address, of its own: one fixed port for all


@dataclass
class LabCluster(LocalCluster):
    """Nodes `ids` each in its own host of `lab` (hosts 0..n-1 in order): zenoh on the host's lab address,
    every other node named as a peer, multicast scouting on the lab's interface only, HTTP (with `api`) on
    the lab address. Nothing listens in, or speaks from, the root namespace: only a thread or process inside
    a lab host reaches the nodes (`NetLab.inside`, `NetLab.popen`), so client() is of no use here."""

    lab: NetLab | None = None

    def __post_init__(self) -> None:
        assert self.lab is not None and len(self.lab.hosts) >= len(self.ids), "a lab with a host per node"
        self.hosts: dict[str, Host] = dict(zip(self.ids, self.lab.hosts, strict=False))
        endpoints = {nid: f"tcp/{h.address}:{LAB_PORT}" for nid, h in self.hosts.items()}
        for nid, endpoint in endpoints.items():
            launch = partial(self.lab.popen, self.hosts[nid])
            self.nodes[nid] = NodeProc(nid, self.root / nid, [], endpoint, popen=launch)
            # Every node names every other: a restarted or reconnected node finds them all again.
            self._peers[nid] = [e for other, e in endpoints.items() if other != nid]

    def argv(self, node_id: str, listen: str, peers: list[str], models_dir: Path | None = None) -> list[str]:
        argv = super().argv(node_id, listen, peers, models_dir)
        argv += ["--insecure"] if self.key is None and self.tls_root is None else []  # open, off loopback
        return [*argv, "--api-host", self.hosts[node_id].address, "--multicast-interface", HOST_IF]

    def add(self, node_id: str, *extra: str, **kw: Any) -> NodeProc:
        raise NotImplementedError("a LabCluster's nodes are fixed by its lab")
