"""A small lab of simulated machines built from Linux network namespaces, for multi-machine tests.

Layout of one lab with prefix ``P`` and ``count`` hosts (nothing is created in the root namespace)::

    netns P-br :  lo, br0 (bridge, no address, STP off, multicast snooping off), p0 .. p{n-1} (bridge ports)
    netns P-i  :  lo, lab0 (veth, peer = p{i} in P-br), address = i+1-th address of the lab subnet,
                  route 224.0.0.0/4 dev lab0 (so multicast scouting has a route)

Every veth pair is created with both ends directly inside lab namespaces, so no device of the lab ever
exists in the host's root namespace, and no packet of the lab can reach the host's real interfaces: the
lab is an isolated L2 segment. Deleting the namespaces deletes the veths and the bridge with them.

Interface names do not depend on the prefix (``lab0``, ``br0``, ``p<i>``): they are unique inside their own
namespace, and always within the 15-character limit of the kernel.

Each lab records its owner (pid and process start time) and subnet in a state file under
``/run/shardline-netlab``; :func:`cleanup_stale` uses it to tell a crashed run's leftovers from a lab that
another live test process is still using, and new labs use it to pick a subnet no other live lab uses.
Labs are isolated from each other anyway, so even a clash of subnets between two labs would be harmless.

Here: the lab itself. Below it: namespaces.py (`ip`, a namespace's processes, `inside`), lab_state.py (the
state files), leak_monitor.py (the root namespace watched for the lab's frames).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardline.testing.lab_state import live_subnets, owner_alive, read_state, state_dir
from shardline.testing.leak_monitor import LeakMonitor
from shardline.testing.namespaces import (
    IP,
    NetnsError,
    delete_namespaces,
    empty_namespaces,
    inside,
    ip_json,
    killpg_quietly,
    list_netns,
    ns_inode,
    root_networks,
    run_ip,
    start_time_of,
    wait_until,
)

HOST_IF = "lab0"
BRIDGE_IF = "br0"
MULTICAST_NET = "224.0.0.0/4"
LAB_RANGE = ipaddress.ip_network("10.77.0.0/16")  # one /24 per lab: 10.77.X.0/24, X in 1..254
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
_MAX_PREFIX = 24


@dataclass(frozen=True)
class Host:
    name: str  # network namespace name, ``{prefix}-{index}``
    address: str  # IPv4 address on ``interface``
    interface: str  # the veth inside the namespace
    index: int
    port: str  # the veth's other end, a port of the bridge inside ``{prefix}-br``


def _lab_namespaces(prefix: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(prefix)}-(?:br|\d+)$")
    return [n for n in list_netns() if pattern.match(n)]


def _pick_subnet(prefix: str) -> str:
    taken = live_subnets() | {lab.subnet for lab in list(_OPEN_LABS.values())}
    root = root_networks()
    start = zlib.crc32(prefix.encode()) % 254
    for k in range(254):
        net = ipaddress.ip_network(f"10.77.{(start + k) % 254 + 1}.0/24")
        if str(net) in taken or any(net.overlaps(r) for r in root if r.prefixlen > 0):
            continue
        return str(net)
    raise NetnsError("no free /24 left in 10.77.0.0/16")


# ------------------------------------------------------------------------------------- process cleanup

_OPEN_LABS: dict[int, NetLab] = {}
_HOOKS_LOCK = threading.Lock()
_hooks_installed = False


def _close_all() -> None:
    for lab in list(_OPEN_LABS.values()):
        with contextlib.suppress(Exception):
            lab.close()


def _install_hooks() -> None:
    global _hooks_installed
    with _HOOKS_LOCK:
        if _hooks_installed:
            return
        _hooks_installed = True
        atexit.register(_close_all)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still covers normal exits
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            _close_all()
            if callable(previous):
                previous(signum, frame)
            else:  # default action: die of SIGTERM, as if we had never caught it
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)


# ----------------------------------------------------------------------------------------------- public


_UNPROBED = "<not probed>"
_availability: str | None = _UNPROBED


def netns_available() -> str | None:
    """None if this process can build labs; otherwise why not (for ``pytest.skip``). The probe is cached."""
    global _availability
    if _availability is _UNPROBED:
        _availability = _probe()
    return _availability


REQUIRE_ROOT_TESTS = "SHARDLINE_REQUIRE_ROOT_TESTS"


def netns_skip_reason() -> str | None:
    """Why the tests that build labs skip in this process, or None to run them. Where the environment sets
    SHARDLINE_REQUIRE_ROOT_TESTS=1 (CI, which runs as root) they never skip: a skip there would hide that the
    suite did not test what it claims, so each runs and fails on NetLab's own check, which says why."""
    if os.environ.get(REQUIRE_ROOT_TESTS) == "1":
        return None
    return netns_available()


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if shutil.which(IP) is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    a, b = f"slprobe{os.getpid()}a", f"slprobe{os.getpid()}b"
    try:
        run_ip("netns", "add", a)
        run_ip("netns", "add", b)
        run_ip("-n", a, "link", "add", BRIDGE_IF, "type", "bridge")
        run_ip("link", "add", "v0", "netns", a, "type", "veth", "peer", "name", "v1", "netns", b)
        run_ip("-n", a, "link", "set", "v0", "master", BRIDGE_IF)
        run_ip("-n", b, "addr", "add", "10.77.0.1/24", "dev", "v1")
        run_ip("-n", b, "link", "set", "v1", "up")
        run_ip("-n", b, "route", "add", MULTICAST_NET, "dev", "v1")
    except (NetnsError, subprocess.TimeoutExpired) as exc:
        return f"the kernel refuses a network namespace lab: {exc}"
    finally:
        delete_namespaces([a, b])
    return None


def open_lab(base: str, count: int, tries: int = 9) -> NetLab:
    """A NetLab named ``base`` or, while a live process uses that, ``base2``, ``base3``...; a crashed run's
    leftovers under the name chosen are removed first."""
    for k in range(1, tries + 1):
        prefix = base if k == 1 else f"{base}{k}"
        if owner_alive(read_state(prefix)) or any(lab.name_prefix == prefix for lab in _OPEN_LABS.values()):
            continue
        cleanup_stale(prefix)
        return NetLab(prefix, count)
    raise NetnsError(f"labs {base} to {base}{tries} are all in use by live processes")


def cleanup_stale(prefix: str, force: bool = False) -> list[str]:
    """Remove what a crashed run left with this prefix: its processes, namespaces (with their veths and
    bridge) and state file. A lab whose owner process is still alive is left alone unless ``force``.
    Returns the namespaces removed."""
    _check_prefix(prefix)
    state = read_state(prefix)
    if not force and owner_alive(state):
        return []
    names = _lab_namespaces(prefix)
    empty_namespaces(names, grace=1.0)
    failed = delete_namespaces(names)
    if failed:
        raise NetnsError(f"could not delete stale namespaces: {failed}")
    with contextlib.suppress(OSError):
        (state_dir() / f"{prefix}.json").unlink()
    return names


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix) or len(prefix) > _MAX_PREFIX or prefix.startswith("slprobe"):
        raise ValueError(
            f"bad lab prefix {prefix!r}: lowercase letters, digits and inner dashes, at most {_MAX_PREFIX}"
        )


@dataclass(eq=False)
class NetLab:
    """``count`` simulated machines on one private switch. A context manager; see the module docstring."""

    name_prefix: str
    count: int
    subnet: str | None = None  # default: a free 10.77.X.0/24, X derived from the prefix
    hosts: list[Host] = field(default_factory=list, init=False)
    bridge_ns: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if (why := netns_available()) is not None:
            raise NetnsError(f"no network-namespace lab can be built here: {why}")
        _check_prefix(self.name_prefix)
        if not 1 <= self.count <= 250:
            raise ValueError("count must be in 1..250")
        self._lock = threading.RLock()
        self._procs: list[subprocess.Popen[Any]] = []
        self._bridges: set[str] = set()  # extra bridges of split()
        self._closed = False
        self.bridge_ns = f"{self.name_prefix}-br"
        state = read_state(self.name_prefix)
        if owner_alive(state) or self.name_prefix in {lab.name_prefix for lab in _OPEN_LABS.values()}:
            raise NetnsError(f"lab {self.name_prefix!r} is in use by live pid {state and state.get('pid')}")
        if _lab_namespaces(self.name_prefix):
            raise NetnsError(
                f"namespaces of a previous lab {self.name_prefix!r} exist: call cleanup_stale() first"
            )
        self.subnet = str(ipaddress.ip_network(self.subnet or _pick_subnet(self.name_prefix)))
        net = ipaddress.ip_network(self.subnet)
        addresses = [str(a) for _, a in zip(range(self.count), net.hosts(), strict=False)]
        if len(addresses) < self.count:
            raise ValueError(f"subnet {self.subnet} has room for fewer than {self.count} hosts")
        self.hosts = [
            Host(f"{self.name_prefix}-{i}", addresses[i], HOST_IF, i, f"p{i}") for i in range(self.count)
        ]
        _install_hooks()
        _OPEN_LABS[id(self)] = self
        try:
            self._write_state()
            self._build()
        except BaseException:
            self.close()
            raise

    # -- construction

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "start_time": start_time_of(os.getpid()),
            "subnet": self.subnet,
            "count": self.count,
        }
        (state_dir() / f"{self.name_prefix}.json").write_text(json.dumps(state))

    def _build(self) -> None:
        br = self.bridge_ns
        run_ip("netns", "add", br)
        run_ip("-n", br, "link", "set", "lo", "up")
        # STP off and forward delay 0: a port forwards as soon as it is up. Snooping off: multicast is
        # flooded to every port, whatever IGMP state was lost across link_down/link_up.
        run_ip(
            "-n", br, "link", "add", BRIDGE_IF, "type", "bridge",
            "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0",
        )  # fmt: skip
        run_ip("-n", br, "link", "set", BRIDGE_IF, "up")
        prefixlen = ipaddress.ip_network(self.subnet).prefixlen  # type: ignore[arg-type]
        for h in self.hosts:
            run_ip("netns", "add", h.name)
            veth = ("type", "veth", "peer", "name", h.port, "netns", br)
            run_ip("link", "add", h.interface, "netns", h.name, *veth)
            run_ip("-n", br, "link", "set", h.port, "master", BRIDGE_IF)
            run_ip("-n", br, "link", "set", h.port, "up")
            run_ip("-n", h.name, "link", "set", "lo", "up")
            run_ip("-n", h.name, "addr", "add", f"{h.address}/{prefixlen}", "dev", h.interface)
            run_ip("-n", h.name, "link", "set", h.interface, "up")
            run_ip("-n", h.name, "route", "add", MULTICAST_NET, "dev", h.interface)
        for h in self.hosts:
            self._wait_carrier(h, up=True)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hosts and processes

    def host(self, which: Host | int | str) -> Host:
        if isinstance(which, Host):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        for h in self.hosts:
            if which in (h.name, h.address):
                return h
        raise KeyError(which)

    def exec_prefix(self, host: Host | int | str) -> list[str]:
        return [IP, "netns", "exec", self.host(host).name]

    def popen(self, host: Host | int | str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace, as the leader of its own process group (and session).
        close() kills its group, and anything else still alive in the lab's namespaces."""
        with self._lock:
            if self._closed:
                raise NetnsError(f"lab {self.name_prefix!r} is closed")
            kw.pop("process_group", None)
            kw["start_new_session"] = True
            h = self.host(host)
            proc = subprocess.Popen([*self.exec_prefix(h), *argv], **kw)
            self._procs.append(proc)
        # Return once the child is inside the namespace (or already gone), so that its pid, from now on,
        # is found by any sweep of the namespace, even one by another process after we crash.
        want = ns_inode(h.name)

        def inside() -> bool:
            try:
                return os.stat(f"/proc/{proc.pid}/ns/net").st_ino == want
            except OSError:
                return True

        if not wait_until(lambda: proc.poll() is not None or inside(), 10.0, interval=0.001):
            raise NetnsError(f"{argv[0]} did not enter {h.name} within 10s")
        return proc

    def inside(self, host: Host | int | str) -> contextlib.AbstractContextManager[None]:
        """The calling thread (and the threads it starts meanwhile) in the host's namespace: see inside()."""
        return inside(self.host(host).name)

    def run(
        self, host: Host | int | str, argv: Sequence[str], timeout: float, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """popen + communicate with a deadline (the process is killed if it overruns), text output."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("text", True)
        proc = self.popen(host, argv, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            killpg_quietly(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        with self._lock, contextlib.suppress(ValueError):
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- faults

    def link_down(self, host: Host | int | str) -> None:
        """Unplug the host's cable: its bridge port goes down, the veth inside loses carrier. Packets to or
        from the host are dropped silently (no error reaches the other hosts); its address stays."""
        h = self.host(host)
        run_ip("-n", self.bridge_ns, "link", "set", h.port, "down")
        self._wait_carrier(h, up=False)

    def link_up(self, host: Host | int | str) -> None:
        """Plug the cable back; returns once the host's interface has carrier again."""
        h = self.host(host)
        run_ip("-n", self.bridge_ns, "link", "set", h.port, "up")
        self._wait_carrier(h, up=True)

    def split(self, groups: Sequence[Sequence[Host | int | str]]) -> None:
        """Partition the switch: each group's ports move to a bridge of its own (group 0 stays on br0), so
        hosts reach only their own group. Carrier stays up: nothing tells a host that it was cut off."""
        with self._lock:
            for g, members in enumerate(groups):
                bridge = BRIDGE_IF if g == 0 else f"br{g}"
                if g and bridge not in self._bridges:
                    run_ip("-n", self.bridge_ns, "link", "add", bridge, "type", "bridge",
                        "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0")  # fmt: skip
                    run_ip("-n", self.bridge_ns, "link", "set", bridge, "up")
                    self._bridges.add(bridge)
                for which in members:
                    run_ip("-n", self.bridge_ns, "link", "set", self.host(which).port, "master", bridge)

    def heal(self) -> None:
        """Undo split(): every port back on br0."""
        self.split([self.hosts])

    @contextlib.contextmanager
    def partitioned(self, groups: Sequence[Sequence[Host | int | str]]) -> Iterator[None]:
        """split(groups) for the block, healed however it ends (an exception, a Ctrl-C): a test or bench
        never leaves the switch cut. Hosts in no group keep their port where it is (br0 in a healed lab)."""
        try:
            self.split(groups)
            yield
        finally:
            self.heal()

    def _wait_carrier(self, h: Host, up: bool, timeout: float = 5.0) -> None:
        def ok() -> bool:
            links = ip_json("-n", h.name, "link", "show", h.interface)
            flags = links[0].get("flags", []) if links else []
            return ("LOWER_UP" in flags) == up

        if not wait_until(ok, timeout):
            raise NetnsError(f"{h.interface} in {h.name} did not go {'up' if up else 'down'} in {timeout}s")

    # -- checks

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(h.name for h in self.hosts)]

    def isolation_problems(self) -> list[str]:
        """Reasons the lab might not be sealed off from the root namespace (empty when it is): a root-ns
        device whose veth peer lives in the lab, or a lab namespace with a device the lab did not make."""
        problems = []
        ids = {e["id"] for e in ip_json("netns", "list-id") if e.get("name") in self.namespaces()}
        for link in ip_json("-d", "link", "show"):
            if link.get("link_netnsid") in ids:
                problems.append(f"root-ns device {link['ifname']} is linked into the lab")
        expected = {self.bridge_ns: {"lo", BRIDGE_IF, *(h.port for h in self.hosts)}}
        expected.update({h.name: {"lo", h.interface} for h in self.hosts})
        for ns, want in expected.items():
            links = ip_json("-n", ns, "-d", "link", "show")
            have = {link["ifname"] for link in links}
            if have != want:
                problems.append(f"{ns} has devices {sorted(have)}, expected {sorted(want)}")
            for link in links:
                master = link.get("master")
                if ns == self.bridge_ns and link["ifname"].startswith("p") and master != BRIDGE_IF:
                    problems.append(f"{ns}/{link['ifname']} is not a port of {BRIDGE_IF}")
        return problems

    def leak_monitor(self) -> LeakMonitor:
        return LeakMonitor(self.subnet)  # type: ignore[arg-type]

    # -- teardown

    def close(self, grace: float = 2.0) -> None:
        """Kill what the lab runs (process groups, then anything left in its namespaces), delete its
        namespaces (which deletes veths and bridge). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        names = self.namespaces()
        try:
            live = [p for p in procs if p.poll() is None]  # not reaped: the pid (= pgid) is still ours
            for p in live:
                killpg_quietly(p.pid, signal.SIGTERM)
            wait_until(lambda: all(p.poll() is not None for p in live), grace)
            for p in live:
                if p.poll() is None:
                    killpg_quietly(p.pid, signal.SIGKILL)
            left = empty_namespaces(names, grace)
            for p in procs:  # reap; their pipes are left to the caller (a reader thread may be on them)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            failed = delete_namespaces(names)
            if left or failed:
                raise NetnsError(f"lab {self.name_prefix!r} not fully removed: pids {left}, {failed}")
        finally:
            _OPEN_LABS.pop(id(self), None)
            with contextlib.suppress(OSError, NetnsError):
                (state_dir() / f"{self.name_prefix}.json").unlink()


@contextlib.contextmanager
def lab(name_prefix: str, count: int, subnet: str | None = None) -> Iterator[NetLab]:
    """cleanup_stale(prefix) then a NetLab, closed on exit."""
    cleanup_stale(name_prefix)
    with NetLab(name_prefix, count, subnet) as built:
        yield built
