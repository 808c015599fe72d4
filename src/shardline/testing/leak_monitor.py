"""A passive watch on the root namespace's interfaces for frames of a lab's subnet: any one means the lab
leaked onto the host's real network."""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading


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
