"""The network-namespace lab: simulated machines really are cut off and reconnected, zenoh multicast
scouting finds peers inside the lab only, and nothing of a lab outlives close() or a crashed run."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from shardline.testing.namespaces import NETNS_DIR, list_netns
from shardline.testing.netns import NetLab, cleanup_stale, netns_skip_reason, open_lab

pytestmark = pytest.mark.skipif(netns_skip_reason() is not None, reason=f"netns: {netns_skip_reason()}")

PY = sys.executable


class Child:
    """A process in the lab whose stdout lines are collected by a thread, so the test can wait on them."""

    def __init__(self, lab: NetLab, host: Any, code: str, *args: str) -> None:
        self.proc = lab.popen(
            host,
            [PY, "-u", "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new = threading.Condition()
        self.err: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: [self.err.put(x) for x in self.proc.stderr], daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self.lines.append("<EOF>")
            self._new.notify_all()

    def wait_for(self, pred: Callable[[list[str]], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self._new:
            while not (found := pred(self.lines)):
                left = deadline - time.monotonic()
                if left <= 0 or (self.lines and self.lines[-1] == "<EOF>"):
                    raise AssertionError(f"{what}: not seen in {timeout}s; output {self.lines[-20:]}, "
                                         f"stderr {self.stderr()[-2000:]}")  # fmt: skip
                self._new.wait(left)
            return found

    def line(self, prefix: str, timeout: float) -> str:
        return self.wait_for(lambda ls: next((x for x in ls if x.startswith(prefix)), None), timeout, prefix)

    def stderr(self) -> str:
        parts = []
        while not self.err.empty():
            parts.append(self.err.get_nowait())
        return "".join(parts)

    def finish(self, timeout: float) -> list[str]:
        """Close stdin (the child's signal to end) and wait for it to exit on its own."""
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
        self.wait_for(lambda ls: ls and ls[-1] == "<EOF>", timeout, "end of output")
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}: {self.stderr()[-2000:]}"
        return self.lines[:-1]


# ------------------------------------------------------------------------------------------------ TCP

TCP_SERVER = r"""
import select, socket, sys, time
addr, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, port))
srv.listen()
print("LISTENING", flush=True)
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    ready, _, _ = select.select([srv, sys.stdin], [], [], 0.2)
    if sys.stdin in ready and not sys.stdin.readline():
        break
    if srv in ready:
        conn, _ = srv.accept()
        conn.sendall(b"pong")
        conn.close()
"""

TCP_CLIENT = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print("OK" if c.recv(4) == b"pong" else "BAD", flush=True)
except OSError as exc:
    print("FAIL", type(exc).__name__, exc, flush=True)
    sys.exit(1)
"""


def tcp_attempt(lab: NetLab, src: Any, dst_addr: str, port: int, timeout: float) -> str:
    res = lab.run(src, [PY, "-c", TCP_CLIENT, dst_addr, str(port), str(timeout)], timeout=timeout + 10)
    return res.stdout.strip() or f"rc={res.returncode} {res.stderr.strip()[-500:]}"


@pytest.mark.timeout(90)
def test_tcp_between_hosts_and_link_down_up() -> None:
    cleanup_stale("sltcp")
    with NetLab("sltcp", 2) as lab:
        h0, h1 = lab.hosts
        assert h0.address != h1.address and h0.interface == h1.interface == "lab0"
        server = Child(lab, h1, TCP_SERVER, h1.address, "5555", "80")
        server.line("LISTENING", timeout=20)

        assert tcp_attempt(lab, h0, h1.address, 5555, timeout=5) == "OK"

        lab.link_down(h1)
        cut = tcp_attempt(lab, h0, h1.address, 5555, timeout=1.0)
        assert cut.startswith("FAIL"), cut  # a timeout (dropped at the bridge) or unreachable, never OK
        assert tcp_attempt(lab, h1, h0.address, 5555, timeout=1.0).startswith("FAIL")  # cut both ways

        lab.link_up(h1)
        deadline = time.monotonic() + 20
        attempts = []
        while not attempts or attempts[-1] != "OK":
            assert time.monotonic() < deadline, f"no connection after link_up: {attempts}"
            attempts.append(tcp_attempt(lab, h0, h1.address, 5555, timeout=1.0))

        server.finish(timeout=10)


# ---------------------------------------------------------------------------------------------- zenoh

ZENOH_NODE = r"""
import json, sys, threading, time
import zenoh

role, iface, addr, prefix, limit = sys.argv[1:6]
deadline = time.monotonic() + float(limit)
conf = zenoh.Config()
conf.insert_json5("mode", '"peer"')
conf.insert_json5("scouting/multicast/enabled", "true")
conf.insert_json5("scouting/multicast/interface", json.dumps(iface))
conf.insert_json5("listen/endpoints", json.dumps([f"tcp/{addr}:0"]))
session = zenoh.open(conf)
print("READY", session.zid(), flush=True)

ended = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), ended.set()), daemon=True).start()
keys = []

def on_sample(sample):
    keys.append(str(sample.key_expr))
    if len(keys) <= 3 or len(keys) % 10 == 0:
        print("GOT", len(keys), sample.key_expr, flush=True)

peers = set()
if role == "sub":
    sub = session.declare_subscriber(f"shardline/{prefix}/**", on_sample)
i = 0
while not ended.wait(0.05):  # a pacing loop (publish / peer poll), ended by the parent or the deadline
    if time.monotonic() > deadline:
        print("DEADLINE", flush=True)
        break
    if role == "pub":
        session.put(f"shardline/{prefix}/hello", str(i))
        session.put("shardline/labB/probe", str(i))  # the other lab's key: reaches only its subscriber
        i += 1
    now = {str(z) for z in session.info.peers_zid()}
    if now != peers:
        peers = now
        print("PEERS", " ".join(sorted(peers)), flush=True)
print("END", json.dumps(sorted(set(keys))), len(keys), flush=True)
session.close()
"""


@pytest.mark.timeout(120)
def test_zenoh_multicast_scouting_inside_the_lab() -> None:
    cleanup_stale("slzen")
    with NetLab("slzen", 3) as lab, lab.leak_monitor() as monitor:
        h0, h1, h2 = lab.hosts

        def node(host: Any, role: str, prefix: str) -> Child:
            return Child(lab, host, ZENOH_NODE, role, host.interface, host.address, prefix, "60")

        sub = node(h1, "sub", "labA")  # same key prefix as the publisher
        other = node(h2, "sub", "labB")  # another prefix: must never see labA's keys
        zid_sub = sub.line("READY", timeout=30).split()[1]
        zid_other = other.line("READY", timeout=30).split()[1]
        pub = node(h0, "pub", "labA")
        zid_pub = pub.line("READY", timeout=30).split()[1]
        t_pub = time.monotonic()

        sub.line("GOT 1 shardline/labA/hello", timeout=20)
        discovery_s = time.monotonic() - t_pub
        other.line("GOT 1 shardline/labB/probe", timeout=20)  # the other lab's node is connected and routed

        def sees(child: Child, zids: set[str]) -> Callable[[list[str]], bool]:
            return lambda ls: any(x.startswith("PEERS") and zids <= set(x.split()[1:]) for x in ls)

        # Found each other by multicast scouting alone (no connect endpoint anywhere).
        other.wait_for(sees(other, {zid_pub, zid_sub}), 20, "labB node connected to both labA nodes")
        sub.wait_for(sees(sub, {zid_pub, zid_other}), 20, "subscriber connected to both peers")

        # labA samples keep flowing to the subscriber while the labB node is connected.
        received = len([x for x in sub.lines if x.startswith("GOT")])
        sub.wait_for(
            lambda ls: len([x for x in ls if x.startswith("GOT")]) >= received + 3, 20, "more labA samples"
        )

        pub.finish(timeout=20)
        end_sub = sub.finish(timeout=20)[-1].split(maxsplit=2)
        end_other = other.finish(timeout=20)[-1].split(maxsplit=2)
        assert end_sub[0] == "END" and end_other[0] == "END"
        assert end_sub[1] == '["shardline/labA/hello"]' and int(end_sub[2]) >= 4, end_sub
        assert end_other[1] == '["shardline/labB/probe"]', end_other  # never a labA key
        print(f"multicast discovery: first sample {discovery_s:.3f}s after the publisher's session opened")

        assert lab.isolation_problems() == []
    assert monitor.leaks == [], monitor.leaks[:10]  # no frame of the lab's subnet on any root-ns device


# ------------------------------------------------------------------------------------------- teardown

STUBBORN = r"""
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("UP", flush=True)
sys.stdin.read()
"""

ESCAPER = r"""
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()  # leaves the lab's process group: only the namespace sweep can find it
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(600)
    os._exit(0)
os.close(w)
print("GRANDCHILD", os.read(r, 32).decode(), flush=True)
sys.stdin.read()
"""


def assert_dead(procs: list[psutil.Process]) -> None:
    """psutil.Process objects taken while alive: is_running() also tells a reused pid from the original."""

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert not [p for p in procs if alive(p)], f"left alive: {[p for p in procs if alive(p)]}"


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.mark.timeout(60)
def test_close_leaves_nothing_behind() -> None:
    cleanup_stale("slclose")
    before = root_links()
    lab = NetLab("slclose", 3)
    names = lab.namespaces()
    assert set(names) <= set(list_netns())
    assert root_links() == before  # the lab never puts a device into the root namespace
    plain = Child(lab, 0, STUBBORN.replace("signal.SIG_IGN", "signal.SIG_DFL"))
    stubborn = Child(lab, 1, STUBBORN)
    escaper = Child(lab, 2, ESCAPER)
    plain.line("UP", 20)
    stubborn.line("UP", 20)
    grandchild = int(escaper.line("GRANDCHILD", 20).split()[1])
    procs = [psutil.Process(p) for p in (plain.proc.pid, stubborn.proc.pid, escaper.proc.pid, grandchild)]

    lab.close(grace=0.5)
    lab.close()  # idempotent

    assert_dead(procs)
    assert not set(names) & set(list_netns())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "slclose" not in listed
    assert root_links() == before
    with pytest.raises(RuntimeError):
        lab.popen(0, ["true"])


CRASHING_OWNER = r"""
import os, sys
from shardline.testing.netns import NetLab
lab = NetLab(sys.argv[1], 2)
p = lab.popen(0, ["sleep", "600"])
print("READY", p.pid, flush=True)
sys.stdin.read()
"""


def owner(prefix: str) -> tuple[subprocess.Popen[str], psutil.Process]:
    proc = subprocess.Popen(
        [PY, "-c", CRASHING_OWNER, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", line
    return proc, psutil.Process(int(line[1]))


@pytest.mark.timeout(60)
def test_cleanup_stale_after_a_crash() -> None:
    cleanup_stale("slcrash")
    proc, sleeper = owner("slcrash")
    try:
        assert cleanup_stale("slcrash") == []  # the owner is alive: its lab is not stale
        assert "slcrash-br" in list_netns()
        proc.kill()  # SIGKILL: no atexit, no handler; namespaces and the sleeper stay behind
        proc.wait(timeout=10)
        assert {"slcrash-br", "slcrash-0", "slcrash-1"} <= set(list_netns())
        assert sleeper.is_running()
        assert sorted(cleanup_stale("slcrash")) == ["slcrash-0", "slcrash-1", "slcrash-br"]
        assert not [n for n in list_netns() if n.startswith("slcrash-")]
        assert_dead([sleeper])
    finally:
        proc.kill()
        proc.wait()
        cleanup_stale("slcrash", force=True)


@pytest.mark.timeout(60)
def test_sigterm_of_the_owner_closes_its_lab() -> None:
    cleanup_stale("slterm")
    proc, sleeper = owner("slterm")
    try:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM  # the handler cleans up, then dies of SIGTERM
        assert not [n for n in list_netns() if n.startswith("slterm-")]
        assert_dead([sleeper])
    finally:
        proc.kill()
        proc.wait()
        cleanup_stale("slterm", force=True)


@pytest.mark.timeout(30)
def test_leak_monitor_sees_root_namespace_traffic() -> None:
    """The monitor behind the zenoh test's 'no leak' assertion does see root-ns frames (loopback here)."""
    from shardline.testing.leak_monitor import LeakMonitor

    with LeakMonitor("127.0.0.0/8") as monitor:
        deadline = time.monotonic() + 10
        while not monitor.leaks:
            assert time.monotonic() < deadline, "the monitor saw no loopback frame"
            with socket.create_server(("127.0.0.1", 0)) as srv:
                socket.create_connection(srv.getsockname(), timeout=1).close()
    assert any("127.0.0.1 -> 127.0.0.1" in leak for leak in monitor.leaks), monitor.leaks[:5]


def netns_of_this_thread() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def bind(address: str) -> None:
    """Binds only where the address exists: in its own host's namespace (sends nothing)."""
    with socket.socket() as s:
        s.bind((address, 0))


@pytest.mark.timeout(60)
def test_inside_moves_this_thread_and_the_threads_it_starts_then_brings_it_back() -> None:
    mine = netns_of_this_thread()
    with open_lab("slinside", 2) as lab:
        host = lab.hosts[0]
        want = os.stat(NETNS_DIR / host.name).st_ino
        with pytest.raises(OSError):
            bind(host.address)
        born: list[int] = []
        with lab.inside(host):
            assert netns_of_this_thread() == want
            bind(host.address)
            t = threading.Thread(target=lambda: born.append(netns_of_this_thread()))
            t.start()
            t.join(10)
            with open_lab("slinside", 1) as second:  # the name is in use: the next free one
                assert second.name_prefix == "slinside2"
        assert born == [want]
        assert netns_of_this_thread() == mine
        with pytest.raises(OSError):
            bind(host.address)


CLOSED_FROM_INSIDE = r"""
import sys
from shardline.testing.netns import NetLab
lab = NetLab(sys.argv[1], 1)
with lab.inside(0):
    lab.close()  # its sweep of the namespaces finds this process in it: never signalled
print("ALIVE", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_lab_closed_from_inside_one_of_its_hosts_spares_its_owner() -> None:
    cleanup_stale("slowner")
    run = subprocess.run(
        [PY, "-c", CLOSED_FROM_INSIDE, "slowner"], capture_output=True, text=True, timeout=50
    )
    assert run.returncode == 0 and "ALIVE" in run.stdout, run.stderr[-2000:]
    assert not [n for n in list_netns() if n.startswith("slowner-")]
