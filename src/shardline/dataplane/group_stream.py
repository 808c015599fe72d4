"""One stream of a tensor-parallel group (dataplane/group.py): framed writes, deadline-bounded reads, TLS.

A frame is a kind byte, then a message (its length and its JSON and tensor, dataplane/frame.py) or a sum (its
step, its index within the step, its payload). Every read has a deadline, or none for an idle wait; a read
that would allocate more than MAX_FRAME, or a sum tagged for another step, is a FrameError.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardline.dataplane import frame
from shardline.dataplane import messages as m
from shardline.dataplane.transport import DeadlineExceeded, TransportError
from shardline.trust import roles
from shardline.trust.credentials import CA_FILE, CERT_FILE, KEY_FILE

# What a non-blocking read or write raises when it would wait (a TLS stream says it in its own words).
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_KIND = struct.Struct("<B")
LENGTH = struct.Struct("<Q")  # a message's frame length
_SUM = struct.Struct("<qiQ")  # step seq, index within the step, payload bytes
MESSAGE, SUM = 0, 1
MAX_FRAME = 1 << 34  # far above any step's input, below what a length field could claim to wedge us
SPIN_S = 1e-3  # a read polls this long before it sleeps in poll(): see Stream


class Stream:
    """One TCP stream with framed writes and deadline-bounded reads.

    The socket is non-blocking: a read first polls the socket in a loop for up to SPIN_S (a sum's partner is
    usually a round trip away, and waking a blocked thread costs ~40 us on a VM, which two sums a layer pay
    many times a token), then waits in poll() until the deadline. A wait longer than the spin sleeps: the
    core is never held for more than SPIN_S."""

    def __init__(self, sock: socket.socket, peer: str, slot: int = -1) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.slot = slot  # the peer's runner slot: what a loss blames
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLPRI)
        self._wpoll = select.poll()
        self._wpoll.register(sock, select.POLLOUT)

    def _wait(self, poller: select.poll, deadline: float | None, what: str, stalled: str) -> None:
        """Until the socket is ready (poller's events), or DeadlineExceeded at the deadline."""
        if deadline is None:
            poller.poll()
            return
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise DeadlineExceeded(f"{self.peer} stalled: {stalled} while {what}")

    def send(self, parts: list[Any], deadline: float | None, what: str) -> None:
        data = b"".join(p if isinstance(p, bytes) else bytes(p) for p in parts)
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except WOULD_BLOCK:
                    self._wait(self._wpoll, deadline, what, "took nothing")
        except (TransportError, DeadlineExceeded):  # DeadlineExceeded is an OSError too (TimeoutError)
            raise
        except OSError as exc:
            raise TransportError(f"{self.peer} vanished: link broken while {what}: {exc}") from exc

    def read(self, n: int, deadline: float | None, what: str) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        spin_until = time.perf_counter() + SPIN_S
        try:
            while got < n:
                try:
                    k = self.sock.recv_into(view[got:])
                except WOULD_BLOCK:
                    if time.perf_counter() < spin_until:
                        continue
                    self._wait(self._poll, deadline, what, "sent nothing")
                    continue
                if k == 0:
                    raise TransportError(f"{self.peer} vanished: it closed the group link while {what}")
                got += k
        except (TransportError, DeadlineExceeded):  # DeadlineExceeded is an OSError too (TimeoutError)
            raise
        except OSError as exc:
            raise TransportError(f"{self.peer} vanished: link broken while {what}: {exc}") from exc
        return buf

    def exchange(self, seq: int, index: int, x: np.ndarray, deadline: float) -> np.ndarray:
        """Send our sum (seq, index) and read the peer's at once, full duplex: neither side waits for the
        other's whole frame before sending its own, so partials larger than the sockets' buffers cannot
        deadlock, and a small one costs one trip, not a round trip."""
        payload = memoryview(np.ascontiguousarray(x, dtype=np.float32)).cast("B")
        out = memoryview(_KIND.pack(SUM) + _SUM.pack(seq, index, payload.nbytes) + payload.tobytes())
        what = f"exchanging sum {index} of step {seq}"
        head = _KIND.size + _SUM.size
        buf = bytearray(head + payload.nbytes)
        view, got = memoryview(buf), 0
        both = select.poll()
        both.register(self.sock, select.POLLIN | select.POLLOUT)
        spin_until = time.perf_counter() + SPIN_S
        try:
            while out or got < len(buf):
                moved = False
                if out:
                    try:
                        out = out[self.sock.send(out) :]
                        moved = True
                    except WOULD_BLOCK:
                        pass
                if got < len(buf):
                    try:
                        k = self.sock.recv_into(view[got:])
                        if k == 0:
                            raise TransportError(f"{self.peer} vanished: it closed the link while {what}")
                        got += k
                        moved = True
                    except WOULD_BLOCK:
                        pass
                if moved or time.perf_counter() < spin_until:
                    continue
                wanted = (select.POLLIN if got < len(buf) else 0) | (select.POLLOUT if out else 0)
                both.modify(self.sock, wanted)
                left = deadline - time.monotonic()
                if left <= 0 or not both.poll(left * 1000):
                    raise DeadlineExceeded(f"{self.peer} stalled: nothing moved while {what}")
        except OSError as exc:
            if isinstance(exc, TransportError | DeadlineExceeded):
                raise
            raise TransportError(f"{self.peer} vanished: link broken while {what}: {exc}") from exc
        return self._parse_sum(buf, seq, index, x)

    def send_message(self, msg: Any, tensor: Any, generation: int, deadline: float | None) -> None:
        data = frame.encode(msg, tensor, generation)
        self.send([_KIND.pack(MESSAGE), LENGTH.pack(len(data)), data], deadline, f"sending {msg.kind}")

    def send_sum(self, seq: int, index: int, x: np.ndarray, deadline: float) -> None:
        payload = memoryview(np.ascontiguousarray(x, dtype=np.float32)).cast("B")
        head = _KIND.pack(SUM) + _SUM.pack(seq, index, payload.nbytes)
        self.send([head, payload], deadline, f"sending sum {index} of step {seq}")

    def read_kind(self, deadline: float | None, what: str) -> int:
        return _KIND.unpack(self.read(_KIND.size, deadline, what))[0]

    def read_message(self, deadline: float | None) -> tuple[Any, np.ndarray | None]:
        (n,) = LENGTH.unpack(self.read(LENGTH.size, deadline, "reading a message"))
        if n > MAX_FRAME:
            raise frame.FrameError(f"group frame of {n} bytes")
        return frame.decode(bytes(self.read(n, deadline, "reading a message")), m.GROUP)

    def read_sum(self, seq: int, index: int, like: np.ndarray, deadline: float) -> np.ndarray:
        """The sum (seq, index), shaped like `like`: header and payload in one read (the size is known)."""
        what = f"waiting for sum {index} of step {seq}"
        buf = self.read(_KIND.size + _SUM.size + like.nbytes, deadline, what)
        return self._parse_sum(buf, seq, index, like)

    def _parse_sum(self, buf: bytearray, seq: int, index: int, like: np.ndarray) -> np.ndarray:
        head = _KIND.size + _SUM.size
        kind = buf[0]
        got_seq, got_index, n = _SUM.unpack_from(buf, _KIND.size)
        if kind != SUM or (got_seq, got_index) != (seq, index) or n != like.nbytes:
            raise frame.FrameError(
                f"{self.peer}: a frame of kind {kind}, sum {got_index} of step {got_seq} ({n} bytes), where "
                f"sum {index} of step {seq} ({like.nbytes} bytes) was due"
            )
        return np.frombuffer(buf, dtype=np.float32, offset=head).reshape(like.shape)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def tls_context(tls_dir: Path | None, server: bool) -> ssl.SSLContext | None:
    """Mutual TLS with the node's certificate from the cluster CA (the same files zenoh's tls/ links use):
    on a TLS cluster the group's streams are encrypted too, and each side proves it is a node of it."""
    if tls_dir is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # members reach faces by address; the CA is what vouches for the peer
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(str(tls_dir / CA_FILE))
    ctx.load_cert_chain(str(tls_dir / CERT_FILE), str(tls_dir / KEY_FILE))
    ctx.shardline_revoked = roles.revoked_serials(tls_dir)  # type: ignore[attr-defined]
    return ctx


def secure(sock: socket.socket, ctx: ssl.SSLContext | None, server: bool, timeout: float) -> socket.socket:
    if ctx is None:
        return sock
    sock.settimeout(timeout)  # the handshake blocks, within the bring-up's deadline
    secured = ctx.wrap_socket(sock, server_side=server)
    peer = secured.getpeercert(binary_form=True)
    if peer is not None and (why := roles.refusal(peer, roles.NODE, ctx_revoked(ctx))):
        secured.close()
        raise ssl.SSLError(f"peer certificate refused: {why}")
    return secured


def ctx_revoked(ctx: ssl.SSLContext) -> frozenset[int]:
    """The serial numbers the cluster revoked, as the context was made with (tls_context)."""
    return getattr(ctx, "shardline_revoked", frozenset())
