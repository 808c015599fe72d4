"""The cluster a soak runs against, as every part of the soak reaches it: each node's HTTP API (from the
client host, in a lab), its /state and health, and the run's clock and ends (t0, stop, load_over)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import httpx

from shardline.testing.cluster import LabCluster, LocalCluster, NodeProc
from shardline.testing.namespaces import NETNS_DIR
from shardline.testing.netns import Host, NetLab


def get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


class SoakCluster:
    def __init__(
        self,
        cluster: LocalCluster,
        model: str,
        lab: NetLab | None = None,
        client_host: Host | None = None,
    ) -> None:
        self.cluster = cluster
        self.model = model
        self.lab = lab
        self.client_host = client_host
        # The client host's namespace (its nsfs inode), where every HTTP request to the nodes must start.
        self.client_ns = os.stat(NETNS_DIR / client_host.name).st_ino if client_host else None
        self.ids = list(cluster.nodes)
        self.apis: dict[str, str] = {}
        self.api_lock = threading.Lock()
        self.stop = threading.Event()  # Ctrl-C or the end of the run: every thread returns soon after
        self.load_over = threading.Event()
        self.t0 = time.monotonic()

    def api(self, node_id: str) -> str:
        """The node's HTTP base URL; every request to a node asks for it first, so it checks where from."""
        self._check_netns()
        with self.api_lock:
            return self.apis[node_id]

    def _check_netns(self) -> None:
        """In a lab, HTTP to the nodes only from inside the client host: in the root namespace the lab's
        addresses follow the default route out of the machine."""
        if self.client_ns is not None and os.stat("/proc/thread-self/ns/net").st_ino != self.client_ns:
            raise RuntimeError(f"HTTP to the lab's nodes from outside {self.client_host}: not sent")

    def inside_lab(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread, and the threads it starts, in the client host (no lab: where it is)."""
        if self.lab is None or self.client_host is None:
            return contextlib.nullcontext()
        return self.lab.inside(self.client_host)

    def read_api(self, n: NodeProc, timeout: float) -> str:
        path = n.data_dir / "api-url"
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if time.monotonic() > deadline or (n.proc is not None and n.proc.poll() is not None):
                raise RuntimeError(f"node {n.node_id} serves no HTTP API:\n{n.tail()}")
            self.stop.wait(0.1)
        return path.read_text().strip()

    def state(self, node_id: str | None = None) -> dict[str, Any]:
        for nid in [node_id] if node_id else self.ids:
            r = get(self.api(nid) + "/state", 3.0)
            if r is not None and r.status_code == 200:
                return r.json()
        return {}

    def state_in(self, nid: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """The node's /state asked from inside its own host (in a lab): heard whichever side of a cut it is
        on. Without a lab, from here."""
        if self.lab is None or not isinstance(self.cluster, LabCluster):
            r = get(self.api(nid) + "/state", timeout)
        else:
            with self.api_lock:
                url = self.apis[nid]
            with self.lab.inside(self.cluster.hosts[nid]):
                r = get(url + "/state", timeout)
        return r.json() if r is not None and r.status_code == 200 else None

    def healthy(self) -> bool:
        """Every node answers /health, sees every node alive, and the instance is ready."""
        for nid in self.ids:
            r = get(self.api(nid) + "/health", 2.0)
            if r is None or r.status_code != 200:
                return False
        s = self.state()
        alive = sum(n.get("alive", False) for n in s.get("nodes", []))
        ready = [
            i for i in s.get("instances", []) if i.get("model") == self.model and i.get("phase") == "ready"
        ]
        return alive == len(self.ids) and bool(ready)

    def wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.healthy():
                return True
            self.stop.wait(0.5)
        return False

    def setup(self) -> None:
        for nid, n in self.cluster.nodes.items():
            self.apis[nid] = self.read_api(n, 120)
        first = self.ids[0]
        deadline = time.monotonic() + 120
        while sum(n.get("alive", False) for n in self.state(first).get("nodes", [])) < len(self.ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every node joined:\n{self.cluster.logs()}")
            self.stop.wait(0.5)
        r = httpx.post(self.api(first) + "/instances", json={"model": self.model}, timeout=120)
        if r.status_code != 201:
            raise RuntimeError(f"placing {self.model}: {r.status_code} {r.text}")
        if not self.wait_healthy(600):
            raise RuntimeError(f"the instance never became ready:\n{self.cluster.logs()}")
