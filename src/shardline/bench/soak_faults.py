"""The faults a soak draws (node kills and stops, runner stops, link flaps, partitions), and the record of
when each happened, which tells a request a fault cut from a lost one."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from shardline.bench.chaos import partition_sides
from shardline.bench.soak_cluster import SoakCluster
from shardline.testing.cluster import LabCluster
from shardline.testing.netns import netns_available

FAULT_INTERVAL_S = 60.0  # mean seconds between node kills and stops (shorter runs: a sixth of the run)
FAULT_KINDS = ("node_kill", "node_stop", "runner_stop", "abusive_client")
NETNS_FAULT_KINDS = (*FAULT_KINDS, "link_flap", "partition")  # a cable to pull, a switch to cut: a lab
NETNS_ONLY = ("link_flap", "partition")
CONTINUOUS_FAULTS = ("abusive_client",)  # runs the whole soak; the chaos thread draws the others
LINK_DOWN_S = (1.0, 6.0)  # a link flap keeps the cable out this long (seeded, uniform)
PARTITION_HOLD_S = (10.0, 20.0)  # 5-10 leases (--lease-ms 2000 in the test clusters): a new master is due
PARTITION_MIN_NODES = 3  # fewer, and neither side holds a majority


def use_netns(netns: bool | None) -> bool:
    """--netns: on, or an error that says why it cannot be; --no-netns: off; neither: on where it works."""
    if netns is False:
        return False
    why = netns_available()
    if netns and why is not None:
        raise RuntimeError(f"--netns: {why}")
    return why is None


def fault_kinds(faults: Sequence[str] | None, netns: bool, nodes: int | None = None) -> tuple[str, ...]:
    """The fault kinds to draw from: `faults` (in that order) or every kind this mode (and this many nodes:
    a partition needs 3, so that one side holds a majority) can do."""
    allowed = NETNS_FAULT_KINDS if netns else FAULT_KINDS
    few = nodes is not None and nodes < PARTITION_MIN_NODES
    if faults is None:
        return tuple(k for k in allowed if not (few and k == "partition"))
    kinds = tuple(dict.fromkeys(faults))
    bad = [k for k in kinds if k not in allowed]
    if bad or not kinds:
        need = [k for k in NETNS_ONLY if k in bad]
        hint = f" ({' and '.join(need)} {'needs' if len(need) == 1 else 'need'} --netns)" if need else ""
        raise ValueError(f"fault kinds {bad or '(none)'}: choose from {', '.join(allowed)}{hint}")
    if few and "partition" in kinds:
        raise ValueError(f"partition needs --nodes >= {PARTITION_MIN_NODES} (a majority on one side)")
    return kinds


class FaultRecord:
    """The faults done, and when: a request that fails is judged against it (cut by a fault, or lost)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = {"kills": 0, "stops": 0, "link_flaps": 0, "partitions": 0}
        self.kill_times: dict[str, list[float]] = defaultdict(list)  # node -> when it was SIGKILLed
        self.flaps: dict[str, list[tuple[float, float]]] = defaultdict(list)  # node -> (down, up) times
        self.restarts: dict[str, list[float]] = defaultdict(list)  # node -> when it was restarted
        # Partitions: [cut at, healed at (None while cut), the minority's nodes].
        self.partitions: list[tuple[float, float | None, frozenset[str]]] = []

    def count(self, what: str) -> None:
        with self.lock:
            self.done[what] += 1

    def refused_after_flap(self, node_id: str, start: float, cause: BaseException | None) -> bool:
        """A request that found its pooled connection to a node closed by the node while the node's link
        was down: the server's keep-alive timer (5 s) ran out during the flap, and its FIN reached the
        client only after the request went out on that connection. The node never received the request
        ("Server disconnected without sending a response": no byte of an answer), so it is not lost; a
        client retries it as it would any request refused on a stale connection."""
        if type(cause).__name__ != "RemoteProtocolError" or "without sending a response" not in str(cause):
            return False
        return any(down <= start and start - up <= 30.0 for down, up in self.flaps.get(node_id, []))

    def partitioned_during(self, node_id: str, start: float) -> bool:
        """The node was on the minority side of a partition at some moment since `start`."""
        now = time.monotonic()
        return any(
            node_id in cut and down <= now and (up is None or start <= up)
            for down, up, cut in self.partitions
        )

    def stale_after_cut(self, node_id: str, start: float, cause: BaseException | None) -> bool:
        """As refused_after_flap, for a node a partition cut off from the clients."""
        if type(cause).__name__ != "RemoteProtocolError" or "without sending a response" not in str(cause):
            return False
        return any(
            node_id in cut and down <= start and (up is None or start - up <= 30.0)
            for down, up, cut in self.partitions
        )

    def killed_during(self, node_id: str, start: float) -> bool:
        now = time.monotonic()
        return any(start - 0.5 <= t <= now for t in self.kill_times.get(node_id, []))


class Chaos:
    """The chaos thread: at seeded random intervals, one fault of `kinds` on a node, then the wait for the
    cluster to be healthy again; each fault's entry goes to `log`."""

    def __init__(
        self,
        nodes: SoakCluster,
        record: FaultRecord,
        seed: int,
        seconds: float,
        interval_s: float,
        recover_s: float,
        kinds: tuple[str, ...] = FAULT_KINDS,
    ) -> None:
        self.nodes = nodes
        self.record = record
        self.seed = seed
        self.seconds = seconds
        self.interval_s = interval_s
        self.recover_s = recover_s
        self.kinds = kinds
        self.log: list[dict[str, Any]] = []

    def _pause(self, pid: int, seconds: float) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        try:
            self.nodes.stop.wait(seconds)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _flap(self, nid: str, down_s: float) -> float:
        """Pull the node's cable for `down_s`, then plug it back (also when the run is stopped meanwhile);
        returns when it was back."""
        lab, cluster = self.nodes.lab, self.nodes.cluster
        assert lab is not None and isinstance(cluster, LabCluster)
        host = cluster.hosts[nid]
        self.record.count("link_flaps")
        down = time.monotonic()
        lab.link_down(host)
        try:
            self.nodes.stop.wait(down_s)
        finally:
            lab.link_up(host)
            self.record.flaps[nid].append((down, time.monotonic()))
        return time.monotonic()

    def partition(self, rng: random.Random, entry: dict[str, Any]) -> None:
        """Cut the master and one other node off from the rest (the clients stay with the rest) for a hold
        of several leases; watch the majority elect; heal."""
        nodes, lab, cluster = self.nodes, self.nodes.lab, self.nodes.cluster
        assert lab is not None and isinstance(cluster, LabCluster) and nodes.client_host is not None
        before = nodes.state()
        master, term = before.get("master"), int(before.get("term", 0))
        if master not in nodes.ids:
            raise RuntimeError(f"no master to cut off (the cluster says {master!r})")
        minority, majority = partition_sides(nodes.ids, master, rng)
        hold = rng.uniform(*PARTITION_HOLD_S)
        entry.update(node=master, term=term, minority=minority, majority=majority, clients_with="majority")
        entry["hold_s"] = round(hold, 2)
        hosts = cluster.hosts
        self.record.count("partitions")
        down = time.monotonic()
        partitions = self.record.partitions
        partitions.append((down, None, frozenset(minority)))
        try:
            with lab.partitioned(
                [[*(hosts[n] for n in majority), nodes.client_host], [hosts[n] for n in minority]]
            ):
                while not nodes.stop.is_set() and time.monotonic() < down + hold:
                    if "new_master" not in entry:
                        for nid in majority:
                            s = nodes.state(nid)
                            if int(s.get("term", 0)) > term and s.get("master") in majority:
                                entry["new_master"], entry["new_term"] = s["master"], int(s["term"])
                                entry["elected_after_s"] = round(time.monotonic() - down, 1)
                                break
                    nodes.stop.wait(0.5)
                # What the cut-off side believes at the end of the hold: a master that lost its quorum for a
                # lease has stepped down (None), or follows its old term.
                views = {nid: nodes.state_in(nid) for nid in minority}
                entry["minority_views"] = {
                    nid: None if v is None else {"term": v.get("term"), "master": v.get("master")}
                    for nid, v in views.items()
                }
        finally:
            partitions[-1] = (down, time.monotonic(), frozenset(minority))

    def fault(self, rng: random.Random) -> None:
        nodes = self.nodes
        kind = rng.choice([k for k in self.kinds if k not in CONTINUOUS_FAULTS])
        nid = rng.choice(nodes.ids)
        n = nodes.cluster.nodes[nid]
        at = time.monotonic()
        up: float | None = None  # when a flapped link was back
        entry: dict[str, Any] = {"kind": kind, "node": nid}
        if kind == "runner_stop":
            pids = n.runner_pids()
            if not pids:
                kind = entry["kind"] = "node_stop"
            else:
                pause = rng.uniform(0.5, 2.0)
                entry["pause_s"] = round(pause, 2)
                self.record.count("stops")
                self._pause(rng.choice(pids), pause)
        if kind == "node_stop":
            pause = rng.uniform(0.5, 2.5)
            entry["pause_s"] = round(pause, 2)
            self.record.count("stops")
            self._pause(n.pid, pause)
        elif kind == "node_kill":
            self.record.kill_times[nid].append(time.monotonic())
            self.record.count("kills")
            n.kill(signal.SIGKILL)
            nodes.stop.wait(rng.uniform(1.0, 4.0))
            if nodes.stop.is_set():
                return
            n.start()
            self.record.restarts[nid].append(time.monotonic())
            url = nodes.read_api(n, 120)
            with nodes.api_lock:
                nodes.apis[nid] = url
        elif kind == "link_flap":
            down = rng.uniform(*LINK_DOWN_S)
            entry["down_s"] = round(down, 2)
            up = self._flap(nid, down)
        elif kind == "partition":
            self.partition(rng, entry)
            up = time.monotonic()
        entry["recovered"] = nodes.wait_healthy(self.recover_s)
        if up is not None:
            entry["ready_after_up_s"] = round(time.monotonic() - up, 1)
        entry["at_s"] = round(at - nodes.t0, 1)
        entry["recovery_s"] = round(time.monotonic() - at, 1)
        self.log.append(entry)
        print(f"soak: {entry}", file=sys.stderr)

    def run(self) -> None:
        rng = random.Random(self.seed)
        # Gaps of 0.75-1.5x the interval: the controller's restart budget (3 in 120 s by default) holds
        # for faults a minute apart, and one fault may cost two restarts (a node stop: a leave and a rejoin).
        lo, hi = 0.75 * self.interval_s, 1.5 * self.interval_s
        end = self.nodes.t0 + self.seconds - 5.0  # none in the last seconds: each gets its recovery
        if not [k for k in self.kinds if k not in CONTINUOUS_FAULTS]:
            return
        while not self.nodes.load_over.wait(rng.uniform(lo, hi)):
            if time.monotonic() >= end:
                return
            try:
                self.fault(rng)
            except Exception as exc:  # a fault that could not be done is reported, not fatal
                self.log.append({"kind": "error", "error": repr(exc)[:300]})
