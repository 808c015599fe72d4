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
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IP = "ip"
HOST_IF = "lab0"
BRIDGE_IF = "br0"
MULTICAST_NET = "224.0.0.0/4"
LAB_RANGE = ipaddress.ip_network("10.77.0.0/16")  # one /24 per lab: 10.77.X.0/24, X in 1..254
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
_MAX_PREFIX = 24
_CMD_TIMEOUT = 15.0


class NetnsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Host:
    name: str  # network namespace name, ``{prefix}-{index}``
    address: str  # IPv4 address on ``interface``
    interface: str  # the veth inside the namespace
    index: int
    port: str  # the veth's other end, a port of the bridge inside ``{prefix}-br``


# ---------------------------------------------------------------------------------------------- helpers


def _ip(*args: str, check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(
            [IP, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise NetnsError(f"`{IP}` (iproute2) is not installed") from exc
    if check and res.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _ip_json(*args: str) -> list[dict[str, Any]]:
    out = _ip("-j", *args).stdout.strip()
    return json.loads(out) if out else []


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def _ns_inode(name: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return None


def netns_pids(names: Sequence[str]) -> dict[str, list[int]]:
    """The processes of each named namespace, from one /proc scan: those living in it (what ``ip netns
    pids`` reports) and those still on their way in (an ``ip netns exec NAME ...`` not yet switched)."""
    inodes = {ino: name for name in names if (ino := _ns_inode(name)) is not None}
    found: dict[str, list[int]] = {name: [] for name in names}
    if not names:
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
        except OSError:
            continue  # gone, or a zombie
        if ino in inodes:
            found[inodes[ino]].append(int(entry.name))
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0", 4)
        except OSError:
            continue
        if len(argv) >= 4 and argv[0].endswith(b"ip") and argv[1:3] == [b"netns", b"exec"]:
            name = argv[3].decode(errors="replace")
            if name in found:
                found[name].append(int(entry.name))
    return found


def _start_time(pid: int) -> int | None:
    """The process start time in clock ticks (field 22 of /proc/PID/stat), to survive pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_until(cond: Any, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _exited(pid: int, start_time: int | None) -> bool:
    """Gone, a zombie, or its pid reused. A dying process leaves its namespaces before it becomes a
    zombie, so an empty namespace alone does not mean its processes have finished exiting."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in ("Z", "X", "x") or int(fields[19]) != start_time


def _empty_namespaces(names: Sequence[str], grace: float) -> list[int]:
    """TERM, then KILL, every process in the namespaces; returns the pids not exited at the end."""
    signalled: dict[int, int | None] = {}
    me = os.getpid()  # never ourselves: a thread of ours may be in a lab host (see inside())

    def settled() -> bool:
        for ps in netns_pids(names).values():
            for pid in ps:
                if pid != me:
                    signalled.setdefault(pid, _start_time(pid))
        return all(_exited(p, t) for p, t in signalled.items())

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if settled():
            break
        for ps in netns_pids(names).values():
            for pid in ps:
                if pid != me:
                    _kill(pid, sig)
        _wait_until(settled, wait)
    return sorted(p for p, t in signalled.items() if not _exited(p, t))


def _lab_namespaces(prefix: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(prefix)}-(?:br|\d+)$")
    return [n for n in list_netns() if pattern.match(n)]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete the namespaces (their veths and bridges go with them); returns the ones that failed."""
    failed = []
    for name in names:
        if (NETNS_DIR / name).exists():
            res = _ip("netns", "del", name, check=False)
            if res.returncode != 0 and (NETNS_DIR / name).exists():
                failed.append(f"{name}: {res.stderr.strip()}")
    return failed


# ------------------------------------------------------------------------------------------ state files


def _state_dir() -> Path:
    for base in (Path("/run"), Path("/tmp")):
        d = base / "shardline-netlab"
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            return d
        except OSError:
            continue
    raise NetnsError("no writable directory for netlab state files")


def _read_state(prefix: str) -> dict[str, Any] | None:
    try:
        return json.loads((_state_dir() / f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None


def _owner_alive(state: dict[str, Any] | None) -> bool:
    if not state:
        return False
    pid = state.get("pid")
    return isinstance(pid, int) and _start_time(pid) == state.get("start_time")


def _live_subnets() -> set[str]:
    subnets = set()
    with contextlib.suppress(OSError):
        for f in _state_dir().glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(f.read_text())
                if _owner_alive(state):
                    subnets.add(state.get("subnet"))
    return subnets


def _root_networks() -> list[ipaddress.IPv4Network]:
    """Networks already routed or addressed in the root namespace (read only)."""
    nets = []
    with contextlib.suppress(NetnsError, ValueError):
        for r in _ip_json("-4", "route", "show", "table", "all"):
            dst = r.get("dst", "default")
            if dst != "default":
                nets.append(ipaddress.ip_network(dst, strict=False))
    with contextlib.suppress(NetnsError, ValueError):
        for link in _ip_json("-4", "addr", "show"):
            for a in link.get("addr_info", []):
                nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def _pick_subnet(prefix: str) -> str:
    taken = _live_subnets() | {lab.subnet for lab in list(_OPEN_LABS.values())}
    root = _root_networks()
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
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("-n", a, "link", "add", BRIDGE_IF, "type", "bridge")
        _ip("link", "add", "v0", "netns", a, "type", "veth", "peer", "name", "v1", "netns", b)
        _ip("-n", a, "link", "set", "v0", "master", BRIDGE_IF)
        _ip("-n", b, "addr", "add", "10.77.0.1/24", "dev", "v1")
        _ip("-n", b, "link", "set", "v1", "up")
        _ip("-n", b, "route", "add", MULTICAST_NET, "dev", "v1")
    except (NetnsError, subprocess.TimeoutExpired) as exc:
        return f"the kernel refuses a network namespace lab: {exc}"
    finally:
        _delete_namespaces([a, b])
    return None


def _setns(fd: int) -> None:
    """Move the calling thread (only it) into the network namespace open as ``fd``."""
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """Run the calling thread inside the named network namespace until the block ends, then bring it back.

    Network namespaces are per thread: sockets this thread opens meanwhile live in the namespace (for their
    whole life), and so do the threads it starts meanwhile (a thread is born in its creator's namespace).
    Processes it starts are born there too; files and /proc read the same from any network namespace.
    """
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)  # this thread's, not the process leader's
    try:
        target = os.open(NETNS_DIR / namespace, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(back)
    finally:
        os.close(back)


def open_lab(base: str, count: int, tries: int = 9) -> NetLab:
    """A NetLab named ``base`` or, while a live process uses that, ``base2``, ``base3``...; a crashed run's
    leftovers under the name chosen are removed first."""
    for k in range(1, tries + 1):
        prefix = base if k == 1 else f"{base}{k}"
        if _owner_alive(_read_state(prefix)) or any(lab.name_prefix == prefix for lab in _OPEN_LABS.values()):
            continue
        cleanup_stale(prefix)
        return NetLab(prefix, count)
    raise NetnsError(f"labs {base} to {base}{tries} are all in use by live processes")


def cleanup_stale(prefix: str, force: bool = False) -> list[str]:
    """Remove what a crashed run left with this prefix: its processes, namespaces (with their veths and
    bridge) and state file. A lab whose owner process is still alive is left alone unless ``force``.
    Returns the namespaces removed."""
    _check_prefix(prefix)
    state = _read_state(prefix)
    if not force and _owner_alive(state):
        return []
    names = _lab_namespaces(prefix)
    _empty_namespaces(names, grace=1.0)
    failed = _delete_namespaces(names)
    if failed:
        raise NetnsError(f"could not delete stale namespaces: {failed}")
    with contextlib.suppress(OSError):
        (_state_dir() / f"{prefix}.json").unlink()
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
        state = _read_state(self.name_prefix)
        if _owner_alive(state) or self.name_prefix in {lab.name_prefix for lab in _OPEN_LABS.values()}:
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
            "start_time": _start_time(os.getpid()),
            "subnet": self.subnet,
            "count": self.count,
        }
        (_state_dir() / f"{self.name_prefix}.json").write_text(json.dumps(state))

    def _build(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        # STP off and forward delay 0: a port forwards as soon as it is up. Snooping off: multicast is
        # flooded to every port, whatever IGMP state was lost across link_down/link_up.
        _ip(
            "-n", br, "link", "add", BRIDGE_IF, "type", "bridge",
            "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0",
        )  # fmt: skip
        _ip("-n", br, "link", "set", BRIDGE_IF, "up")
        prefixlen = ipaddress.ip_network(self.subnet).prefixlen  # type: ignore[arg-type]
        for h in self.hosts:
            _ip("netns", "add", h.name)
            veth = ("type", "veth", "peer", "name", h.port, "netns", br)
            _ip("link", "add", h.interface, "netns", h.name, *veth)
            _ip("-n", br, "link", "set", h.port, "master", BRIDGE_IF)
            _ip("-n", br, "link", "set", h.port, "up")
            _ip("-n", h.name, "link", "set", "lo", "up")
            _ip("-n", h.name, "addr", "add", f"{h.address}/{prefixlen}", "dev", h.interface)
            _ip("-n", h.name, "link", "set", h.interface, "up")
            _ip("-n", h.name, "route", "add", MULTICAST_NET, "dev", h.interface)
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
        want = _ns_inode(h.name)

        def inside() -> bool:
            try:
                return os.stat(f"/proc/{proc.pid}/ns/net").st_ino == want
            except OSError:
                return True

        if not _wait_until(lambda: proc.poll() is not None or inside(), 10.0, interval=0.001):
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
            _killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        with self._lock, contextlib.suppress(ValueError):
            self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- faults

    def link_down(self, host: Host | int | str) -> None:
        """Unplug the host's cable: its bridge port goes down, the veth inside loses carrier. Packets to or
        from the host are dropped silently (no error reaches the other hosts); its address stays."""
        h = self.host(host)
        _ip("-n", self.bridge_ns, "link", "set", h.port, "down")
        self._wait_carrier(h, up=False)

    def link_up(self, host: Host | int | str) -> None:
        """Plug the cable back; returns once the host's interface has carrier again."""
        h = self.host(host)
        _ip("-n", self.bridge_ns, "link", "set", h.port, "up")
        self._wait_carrier(h, up=True)

    def split(self, groups: Sequence[Sequence[Host | int | str]]) -> None:
        """Partition the switch: each group's ports move to a bridge of its own (group 0 stays on br0), so
        hosts reach only their own group. Carrier stays up: nothing tells a host that it was cut off."""
        with self._lock:
            for g, members in enumerate(groups):
                bridge = BRIDGE_IF if g == 0 else f"br{g}"
                if g and bridge not in self._bridges:
                    _ip("-n", self.bridge_ns, "link", "add", bridge, "type", "bridge",
                        "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0")  # fmt: skip
                    _ip("-n", self.bridge_ns, "link", "set", bridge, "up")
                    self._bridges.add(bridge)
                for which in members:
                    _ip("-n", self.bridge_ns, "link", "set", self.host(which).port, "master", bridge)

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
            links = _ip_json("-n", h.name, "link", "show", h.interface)
            flags = links[0].get("flags", []) if links else []
            return ("LOWER_UP" in flags) == up

        if not _wait_until(ok, timeout):
            raise NetnsError(f"{h.interface} in {h.name} did not go {'up' if up else 'down'} in {timeout}s")

    # -- checks

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(h.name for h in self.hosts)]

    def isolation_problems(self) -> list[str]:
        """Reasons the lab might not be sealed off from the root namespace (empty when it is): a root-ns
        device whose veth peer lives in the lab, or a lab namespace with a device the lab did not make."""
        problems = []
        ids = {e["id"] for e in _ip_json("netns", "list-id") if e.get("name") in self.namespaces()}
        for link in _ip_json("-d", "link", "show"):
            if link.get("link_netnsid") in ids:
                problems.append(f"root-ns device {link['ifname']} is linked into the lab")
        expected = {self.bridge_ns: {"lo", BRIDGE_IF, *(h.port for h in self.hosts)}}
        expected.update({h.name: {"lo", h.interface} for h in self.hosts})
        for ns, want in expected.items():
            links = _ip_json("-n", ns, "-d", "link", "show")
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
                _killpg(p.pid, signal.SIGTERM)
            _wait_until(lambda: all(p.poll() is not None for p in live), grace)
            for p in live:
                if p.poll() is None:
                    _killpg(p.pid, signal.SIGKILL)
            left = _empty_namespaces(names, grace)
            for p in procs:  # reap; their pipes are left to the caller (a reader thread may be on them)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            failed = _delete_namespaces(names)
            if left or failed:
                raise NetnsError(f"lab {self.name_prefix!r} not fully removed: pids {left}, {failed}")
        finally:
            _OPEN_LABS.pop(id(self), None)
            with contextlib.suppress(OSError, NetnsError):
                (_state_dir() / f"{self.name_prefix}.json").unlink()


class LeakMonitor:
    """Passive capture on every interface of the root namespace (AF_PACKET, not promiscuous; sends
    nothing): counts frames to or from the lab's subnet. Any such frame would mean the lab leaked."""

    def __init__(self, subnet: str) -> None:
        self.net = ipaddress.ip_network(subnet)
        self.leaks: list[str] = []
        self.frames = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._thread = threading.Thread(target=self._loop, name="netns-leak-monitor", daemon=True)

    def _loop(self) -> None:
        lo, hi = int(self.net.network_address), int(self.net.broadcast_address)
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.1)
            if not ready:
                continue
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while True:
                    data, addr = self._sock.recvfrom(2048, socket.MSG_DONTWAIT)
                    self.frames += 1
                    if len(data) < 34 or data[12:14] != b"\x08\x00":
                        continue
                    src = int.from_bytes(data[26:30], "big")
                    dst = int.from_bytes(data[30:34], "big")
                    if lo <= src <= hi or lo <= dst <= hi:
                        self.leaks.append(
                            f"{addr[0]}: {ipaddress.ip_address(src)} -> {ipaddress.ip_address(dst)}"
                        )

    def __enter__(self) -> LeakMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@contextlib.contextmanager
def lab(name_prefix: str, count: int, subnet: str | None = None) -> Iterator[NetLab]:
    """cleanup_stale(prefix) then a NetLab, closed on exit."""
    cleanup_stale(name_prefix)
    with NetLab(name_prefix, count, subnet) as built:
        yield built
