"""Named network namespaces, below any lab: `ip` itself, the processes in a namespace (and emptying it), its
deletion, the networks the root namespace routes, and moving one thread into a namespace (`inside`)."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

IP = "ip"
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_CMD_TIMEOUT = 15.0


class NetnsError(RuntimeError):
    pass


def run_ip(*args: str, check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(
            [IP, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise NetnsError(f"`{IP}` (iproute2) is not installed") from exc
    if check and res.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def ip_json(*args: str) -> list[dict[str, Any]]:
    out = run_ip("-j", *args).stdout.strip()
    return json.loads(out) if out else []


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def ns_inode(name: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return None


def netns_pids(names: Sequence[str]) -> dict[str, list[int]]:
    """The processes of each named namespace, from one /proc scan: those living in it (what ``ip netns
    pids`` reports) and those still on their way in (an ``ip netns exec NAME ...`` not yet switched)."""
    inodes = {ino: name for name in names if (ino := ns_inode(name)) is not None}
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


def start_time_of(pid: int) -> int | None:
    """The process start time in clock ticks (field 22 of /proc/PID/stat), to survive pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def killpg_quietly(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_until(cond: Any, timeout: float, interval: float = 0.02) -> bool:
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


def empty_namespaces(names: Sequence[str], grace: float) -> list[int]:
    """TERM, then KILL, every process in the namespaces; returns the pids not exited at the end."""
    signalled: dict[int, int | None] = {}
    me = os.getpid()  # never ourselves: a thread of ours may be in a lab host (see inside())

    def settled() -> bool:
        for ps in netns_pids(names).values():
            for pid in ps:
                if pid != me:
                    signalled.setdefault(pid, start_time_of(pid))
        return all(_exited(p, t) for p, t in signalled.items())

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if settled():
            break
        for ps in netns_pids(names).values():
            for pid in ps:
                if pid != me:
                    _kill(pid, sig)
        wait_until(settled, wait)
    return sorted(p for p, t in signalled.items() if not _exited(p, t))


def delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete the namespaces (their veths and bridges go with them); returns the ones that failed."""
    failed = []
    for name in names:
        if (NETNS_DIR / name).exists():
            res = run_ip("netns", "del", name, check=False)
            if res.returncode != 0 and (NETNS_DIR / name).exists():
                failed.append(f"{name}: {res.stderr.strip()}")
    return failed


def root_networks() -> list[ipaddress.IPv4Network]:
    """Networks already routed or addressed in the root namespace (read only)."""
    nets = []
    with contextlib.suppress(NetnsError, ValueError):
        for r in ip_json("-4", "route", "show", "table", "all"):
            dst = r.get("dst", "default")
            if dst != "default":
                nets.append(ipaddress.ip_network(dst, strict=False))
    with contextlib.suppress(NetnsError, ValueError):
        for link in ip_json("-4", "addr", "show"):
            for a in link.get("addr_info", []):
                nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


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
