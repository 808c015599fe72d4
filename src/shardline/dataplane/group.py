"""A tensor-parallel stage's link: its face (member 0) and each other member, one TCP stream each.

Star-shaped: members connect to the face, which they find by a zenoh query on the stage's group key (the
face answers with its address). On each stream, in order, the face sends every ring message it obeys (steps
with their input, releases, evictions, stop) and, inside a step, the group's sums; a member sends its
partial sums. Each sum is tagged with its step and its index within the step, and checked.

The face adds the partials in member order, ((p0 + p1) + p2) + ..., and returns that total to every
member: every member holds the same bits, and a run is reproducible. A group of two exchanges its partials
both ways at once (full duplex) and each side adds p0 + p1: the same bits, in one trip instead of two.
Every wait has the step's deadline (work-scaled, as every step's): a member that is stopped, killed or cut
off is named within it (DeadlineExceeded, or TransportError when its stream breaks) and the stage fails like
any other. Idle waits (a member between steps) have none; a face that vanishes breaks the stream.

A member proves itself with an HMAC of the face's nonce under the cluster key (when there is one), so a
process that is not one of the group's members cannot join it or feed it sums. The face spends little on a
stranger before that proof: each incoming connection is handled on its own thread (at most MAX_HANDSHAKES at
once), within HANDSHAKE_S seconds (TLS handshake included) and HELLO_MAX bytes, and nothing sized by the peer
is allocated before the hello's MAC checks. A connection that holds its slot cannot keep a member out: the
member is admitted beside it, and is told so (one ACK byte); a member refused or crowded out tries again until
its deadline. On a TLS cluster the peer's certificate must also be a node's, not revoked (trust/roles.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import zenoh

from shardline.compute import quantized
from shardline.dataplane import frame
from shardline.dataplane import messages as m
from shardline.dataplane.transport import DeadlineExceeded, Keys, TransportError
from shardline.instance.deadline import SMALL_STEP
from shardline.instance.spec import runner_name
from shardline.trust import roles
from shardline.trust.credentials import CA_FILE, CERT_FILE, KEY_FILE

# What a non-blocking read or write raises when it would wait (a TLS stream says it in its own words).
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_KIND = struct.Struct("<B")
_MESSAGE = struct.Struct("<Q")  # frame length
_SUM = struct.Struct("<qiQ")  # step seq, index within the step, payload bytes
MESSAGE, SUM = 0, 1
NONCE_BYTES = 16
MAX_FRAME = 1 << 34  # far above any step's input, below what a length field could claim to wedge us
# What the face spends on a connection before it is proven a member: a hello is ~200 bytes of JSON; a member
# on a loaded machine answers within a second. Both are fixed: a stranger cannot make the face wait or
# allocate more, whatever its length field says.
HELLO_MAX = 4096
HANDSHAKE_S = 3.0
MAX_HANDSHAKES = 16  # connections being proven at once; more are closed at accept (a member retries)
ACK = b"\x06"  # the face's word that a member was admitted
log = logging.getLogger("shardline.group")
SPIN_S = 1e-3  # a read polls this long before it sleeps in poll(): see _Stream
# Sums as an MLX op (csrc/qmm/group_sum.h) where the streams are plain TCP and the device the CPU: a step's
# layers are then one graph. TLS streams (Python's ssl) and other devices sum here, in Python, on the same
# frames. SHARDLINE_GROUP_SUM=python forces Python's (to compare the two).
NATIVE_SUMS = os.environ.get("SHARDLINE_GROUP_SUM", "native") != "python"


def group_key(keys: Keys, stage: int) -> str:
    return f"{keys.root}/group/{stage}"


def _mac(key: str | None, nonce: bytes, hello: m.GroupHello) -> str:
    if key is None:
        return ""
    ident = f"{hello.instance}/{hello.generation}/{hello.stage}/{hello.member}".encode()
    return hmac.new(key.encode(), nonce + ident, hashlib.sha256).hexdigest()


class _Stream:
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
        self.send([_KIND.pack(MESSAGE), _MESSAGE.pack(len(data)), data], deadline, f"sending {msg.kind}")

    def send_sum(self, seq: int, index: int, x: np.ndarray, deadline: float) -> None:
        payload = memoryview(np.ascontiguousarray(x, dtype=np.float32)).cast("B")
        head = _KIND.pack(SUM) + _SUM.pack(seq, index, payload.nbytes)
        self.send([head, payload], deadline, f"sending sum {index} of step {seq}")

    def read_kind(self, deadline: float | None, what: str) -> int:
        return _KIND.unpack(self.read(_KIND.size, deadline, what))[0]

    def read_message(self, deadline: float | None) -> tuple[Any, np.ndarray | None]:
        (n,) = _MESSAGE.unpack(self.read(_MESSAGE.size, deadline, "reading a message"))
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


class _Sums:
    """The part face and members share: the current step's tag, deadline and sum counter, and timings.

    on_lost(slot) is called before an error on a peer's stream propagates: the runner says which runner it
    lost (the controller blames that one, and placement avoids its machine when it looks cut off)."""

    def __init__(self, on_lost: Callable[[int], None] = lambda slot: None) -> None:
        self.on_lost = on_lost
        self.seq = -1
        self.index = 0
        self.deadline_s = 60.0
        self.deadline = 0.0
        # This process's wall time inside each recent sum, apart for decode steps and prefill chunks (the
        # heartbeat reports them; `bench tp` too).
        self.timings_us: dict[bool, deque[float]] = {True: deque(maxlen=4096), False: deque(maxlen=4096)}
        self.count = 0
        self.native: Any = None  # a _qmm.SumLink over `_streams`, once the group met (_go_native)
        self._streams: list[_Stream] = []
        self._clock = 0.0  # time.monotonic() minus the op's clock (they may differ in origin)

    def _go_native(self, streams: list[_Stream], face: bool, pair: bool) -> None:
        """Sum with the MLX op from now on, where it can (plain sockets, the CPU device, the op built)."""
        qmm = quantized.native()
        plain = not any(isinstance(s.sock, ssl.SSLSocket) for s in streams)
        built = qmm is not None and hasattr(qmm, "SumLink")
        if not (NATIVE_SUMS and plain and built and mx.default_device() == mx.cpu):
            why = "asked" if not NATIVE_SUMS else "TLS" if not plain else "no op" if not built else "device"
            log.info("group sums in Python (%s)", why)
            return
        log.info("group sums as an MLX op")
        self._streams = streams
        self.native = qmm.SumLink([s.sock.fileno() for s in streams], face, pair, SPIN_S)
        self._clock = time.monotonic() - qmm.monotonic()

    def _native_sum(self, x: mx.array) -> mx.array | None:
        """The sum as a lazy op (None where this sum goes through Python)."""
        if self.native is None or x.dtype != mx.float32:
            return None
        positions = x.size // max(1, x.shape[-1])
        return quantized.native().group_sum(  # type: ignore[union-attr]
            x, self.native, self.seq, self._next(), self.deadline - self._clock, positions <= SMALL_STEP
        )

    def check(self) -> None:
        """After a step's evaluation, before anything of it leaves this runner: the op's sums' timings, and
        their failure raised here as Python's sums raise it (the peer named and reported lost)."""
        if self.native is None:
            return
        for small, us in self.native.drain():
            self.timings_us[small].append(us)
            self.count += 1
        kind, k, message = self.native.error()
        if kind == 0:
            return
        stream = self._streams[k]
        self.on_lost(stream.slot)
        error = DeadlineExceeded if kind == 1 else TransportError if kind == 2 else frame.FrameError
        raise error(f"{stream.peer} {message}" if kind != 3 else f"{stream.peer}: {message}")

    @contextmanager
    def _blame(self, stream: _Stream) -> Iterator[None]:
        try:
            yield
        except (TransportError, DeadlineExceeded):
            self.on_lost(stream.slot)
            raise

    def begin(self, seq: int, deadline_s: float) -> None:
        """A step starts: its sums are tagged with seq, each waits at most deadline_s from now."""
        self.seq, self.index = seq, 0
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s

    def _next(self) -> int:
        index, self.index = self.index, self.index + 1
        return index

    def _partial(self, x: mx.array) -> tuple[int, float, np.ndarray]:
        """A sum starts: its index, its start time (after the partial is computed: that is not the sum's
        time) and the partial as float32 numpy."""
        index = self._next()
        mx.eval(x)
        self.check()  # the op's sums that x depends on ran just now
        started = time.perf_counter()
        return index, started, np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))

    def _took(self, x: mx.array, started: float) -> None:
        self.count += 1
        positions = x.size // max(1, x.shape[-1])
        self.timings_us[positions <= SMALL_STEP].append((time.perf_counter() - started) * 1e6)

    def percentiles(self, decode: bool) -> tuple[float, float]:
        """(p50, p99) in microseconds of the recent sums of decode steps (or prefill chunks)."""
        xs = sorted(self.timings_us[decode])
        if not xs:
            return (0.0, 0.0)
        return (xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))])


def _like(total: np.ndarray, x: mx.array) -> mx.array:
    """The sum as an MLX array of the partial's dtype (no cast op when it is float32 already)."""
    out = mx.array(total)
    return out if x.dtype == mx.float32 else out.astype(x.dtype)


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


def _secure(sock: socket.socket, ctx: ssl.SSLContext | None, server: bool, timeout: float) -> socket.socket:
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


def _host_of(listen: list[str]) -> str:
    """The address this runner's zenoh listens on (its node's): where its members can reach it."""
    for endpoint in listen:
        proto, _, rest = endpoint.partition("/")
        if proto in ("tcp", "tls"):
            host = rest.rsplit(":", 1)[0].strip("[]")
            return host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return "127.0.0.1"


class GroupFace(_Sums):
    """Member 0: listens, admits its members, forwards what it obeys, adds the partials."""

    def __init__(
        self,
        session: zenoh.Session,
        keys: Keys,
        stage: int,
        size: int,
        listen: list[str],
        key: str | None,
        member_slots: list[int] | None = None,
        on_lost: Callable[[int], None] = lambda slot: None,
        tls_dir: Path | None = None,
    ) -> None:
        super().__init__(on_lost)
        self.keys, self.stage, self.size, self.key = keys, stage, size, key
        self.tls = tls_context(tls_dir, server=True)
        self.member_slots = member_slots or [-1] * (size - 1)
        self.server = socket.create_server((_host_of(listen), 0))
        host, port = self.server.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.members: list[_Stream] = []
        self.refused = 0
        self._queryable = session.declare_queryable(group_key(keys, stage), self._on_query)

    def _on_query(self, query: zenoh.Query) -> None:
        try:
            query.reply(query.key_expr, self.address.encode())
        except zenoh.ZError:
            pass

    def admit(self, timeout: float, abort: Callable[[], None] = lambda: None) -> None:
        """Wait (bring-up, with a deadline) until every member connected and proved who it is. Each
        connection is proven on its own thread, at most MAX_HANDSHAKES at once, each within HANDSHAKE_S."""
        deadline = time.monotonic() + timeout
        found: dict[int, _Stream] = {}
        proven: queue.Queue[tuple[int, _Stream] | None] = queue.Queue()
        slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        done = threading.Event()
        self.server.settimeout(0.05)
        try:
            while len(found) < self.size - 1:
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(1, self.size)) - set(found))
                    raise DeadlineExceeded(f"group of stage {self.stage}: members {missing} never joined")
                abort()
                self._take_proven(proven, found)
                try:
                    sock, addr = self.server.accept()
                except TimeoutError:
                    continue
                if not slots.acquire(blocking=False):
                    sock.close()  # crowded: a member among the crowd tries again
                    self.refused += 1
                    continue
                threading.Thread(
                    target=self._prove,
                    args=(sock, addr, min(deadline, time.monotonic() + HANDSHAKE_S), proven, slots, done),
                    name=f"group-hello-{addr[1]}",
                    daemon=True,
                ).start()
        finally:
            done.set()  # handshakes still running close what they proved: nobody takes it now
            self._drain(proven)
        self.members = [found[j] for j in range(1, self.size)]
        self._queryable.undeclare()
        self._go_native(self.members, face=True, pair=self.size == 2)

    def _take_proven(
        self, proven: queue.Queue[tuple[int, _Stream] | None], found: dict[int, _Stream]
    ) -> None:
        while True:
            try:
                got = proven.get_nowait()
            except queue.Empty:
                return
            if got is None:
                self.refused += 1
                continue
            member, stream = got
            if member in found:  # one member, one stream: a second claim of the same place is refused
                self.refused += 1
                stream.close()
                continue
            try:
                stream.send([ACK], time.monotonic() + HANDSHAKE_S, "admitting a member")
            except (TransportError, DeadlineExceeded):
                self.refused += 1
                stream.close()
                continue
            stream.slot = self.member_slots[member - 1]
            stream.peer = runner_name(self.stage, member, stream.slot, self.size)
            found[member] = stream

    @staticmethod
    def _drain(proven: queue.Queue[tuple[int, _Stream] | None]) -> None:
        while True:
            try:
                got = proven.get_nowait()
            except queue.Empty:
                return
            if got is not None:
                got[1].close()

    def _prove(
        self,
        sock: socket.socket,
        addr: Any,
        deadline: float,
        proven: queue.Queue[tuple[int, _Stream] | None],
        slots: threading.BoundedSemaphore,
        done: threading.Event,
    ) -> None:
        """One connection's handshake, on its own thread, within `deadline` (TLS included)."""
        try:
            try:
                sock = _secure(sock, self.tls, True, max(0.01, deadline - time.monotonic()))
                stream = _Stream(sock, f"member at {addr[0]}:{addr[1]}")
                member = self._handshake(stream, deadline)
            except (TransportError, DeadlineExceeded, frame.FrameError, ValueError, OSError):
                sock.close()
                proven.put(None)
                return
            proven.put((member, stream))
            if done.is_set():  # admit ended meanwhile: nobody will take it
                self._drain(proven)
        finally:
            slots.release()

    def _handshake(self, stream: _Stream, deadline: float) -> int:
        """The member this stream proves to be. Reads at most HELLO_MAX bytes: a longer hello is refused by
        its length field, before anything of that length is read or allocated."""
        nonce = os.urandom(NONCE_BYTES)
        stream.send([nonce], deadline, "greeting")
        if stream.read_kind(deadline, "waiting for a hello") != MESSAGE:
            raise ValueError("no hello")
        (n,) = _MESSAGE.unpack(stream.read(_MESSAGE.size, deadline, "reading a hello"))
        if n > HELLO_MAX:
            raise ValueError(f"a hello of {n} bytes (at most {HELLO_MAX})")
        hello, _ = frame.decode(bytes(stream.read(n, deadline, "reading a hello")), m.GROUP)
        if not isinstance(hello, m.GroupHello):
            raise ValueError(f"{hello.kind} before hello")
        ok = (
            hello.instance == self.keys.instance
            and hello.generation == self.keys.generation
            and hello.stage == self.stage
            and 1 <= hello.member < self.size
            and hmac.compare_digest(hello.mac, _mac(self.key, nonce, hello))
        )
        if not ok:
            raise ValueError("hello refused")
        return hello.member

    def forward(self, msg: Any, tensor: Any = None, deadline_s: float | None = None) -> None:
        """Send one message the face obeys to every member, before the face computes it."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        x = None if tensor is None else (tensor if isinstance(tensor, mx.array) else mx.array(tensor))
        if x is not None:
            msg = msg.model_copy(update={"tensor": frame.tensor_meta(x)})
        for s in self.members:
            with self._blame(s):
                s.send_message(msg, x, self.keys.generation, deadline)

    def reduce(self, x: mx.array) -> mx.array:
        if (out := self._native_sum(x)) is not None:
            return out
        index, started, own = self._partial(x)
        if len(self.members) == 1:  # a pair: both send their partial, both add p0 + p1 (the same bits)
            with self._blame(self.members[0]):
                other = self.members[0].exchange(self.seq, index, own, self.deadline)
            out = _like(own + other, x)
            self._took(x, started)
            return out
        total = own.copy()  # added to
        for s in self.members:  # member order: the same bits on every run
            with self._blame(s):
                total += s.read_sum(self.seq, index, total, self.deadline)
        for s in self.members:
            with self._blame(s):
                s.send_sum(self.seq, index, total, self.deadline)
        out = _like(total, x)
        self._took(x, started)
        return out

    def gather(self, x: mx.array) -> mx.array:
        """A split head's logits: the face's rows, then each member's, in member order."""
        index, started, own = self._partial(x)
        parts = [own]
        for s in self.members:
            with self._blame(s):
                parts.append(s.read_sum(self.seq, index, own, self.deadline))
        out = mx.array(np.concatenate(parts, axis=-1))
        self._took(x, started)
        return out

    def close(self) -> None:
        try:
            self._queryable.undeclare()
        except zenoh.ZError:
            pass
        for s in self.members:
            s.close()
        self.server.close()


class GroupMember(_Sums):
    """Member j > 0: finds its face, joins, obeys what it forwards, sends its partials."""

    def __init__(
        self,
        session: zenoh.Session,
        keys: Keys,
        stage: int,
        member: int,
        size: int,
        key: str | None,
        timeout: float,
        abort: Callable[[], None] = lambda: None,
        on_lost: Callable[[int], None] = lambda slot: None,
        tls_dir: Path | None = None,
    ) -> None:
        super().__init__(on_lost)
        self.generation = keys.generation
        self.pair = size == 2  # with one other member, sums are exchanged both ways at once
        deadline = time.monotonic() + timeout
        self.face = self._join(session, keys, stage, member, key, deadline, abort, tls_dir)
        self._go_native([self.face], face=False, pair=self.pair)

    def _join(
        self,
        session: zenoh.Session,
        keys: Keys,
        stage: int,
        member: int,
        key: str | None,
        deadline: float,
        abort: Callable[[], None],
        tls_dir: Path | None,
    ) -> _Stream:
        """A stream to the face that admitted this member (its ACK read): tried again until the deadline
        when the face refuses or closes it (a crowd of strangers may hold its handshake slots)."""
        ctx = tls_context(tls_dir, server=False)
        while True:
            address = self._find(session, group_key(keys, stage), deadline, abort)
            host, port = address.rsplit(":", 1)
            try:
                sock = socket.create_connection(
                    (host, int(port)), timeout=max(0.1, deadline - time.monotonic())
                )
                sock = _secure(sock, ctx, False, max(0.1, deadline - time.monotonic()))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"stage {stage} member {member}: face at {address} unreachable"
                    ) from exc
                abort()
                time.sleep(0.05)  # a retry period, not a synchronisation
                continue
            face = _Stream(sock, f"stage {stage}'s face (runner {stage})", slot=stage)
            try:
                nonce = bytes(face.read(NONCE_BYTES, deadline, "waiting for the face's greeting"))
                hello = m.GroupHello(
                    instance=keys.instance, generation=keys.generation, stage=stage, member=member
                )
                hello = hello.model_copy(update={"mac": _mac(key, nonce, hello)})
                face.send_message(hello, None, keys.generation, deadline)
                if bytes(face.read(len(ACK), deadline, "waiting to be admitted")) != ACK:
                    raise TransportError(f"stage {stage}'s face did not admit member {member}")
                return face
            except TransportError:
                face.close()
                if time.monotonic() >= deadline:
                    raise
                abort()
                time.sleep(0.05)  # a retry period, not a synchronisation

    @staticmethod
    def _find(session: zenoh.Session, key: str, deadline: float, abort: Callable[[], None]) -> str:
        while True:
            for reply in session.get(key, timeout=0.5):
                if reply.ok is not None:
                    return reply.ok.payload.to_bytes().decode()
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no face answered on {key}")
            abort()
            time.sleep(0.1)  # a retry period: the face may not have loaded yet

    def next_message(self) -> tuple[Any, np.ndarray | None]:
        """The next message the face forwarded (an idle wait: no deadline; a vanished face breaks it)."""
        with self._blame(self.face):
            kind = self.face.read_kind(None, "waiting for the next step")
        if kind != MESSAGE:
            raise frame.FrameError(f"a sum arrived between steps (kind {kind})")
        return self.face.read_message(time.monotonic() + 60.0)

    def reduce(self, x: mx.array) -> mx.array:
        if (out := self._native_sum(x)) is not None:
            return out
        index, started, part = self._partial(x)
        with self._blame(self.face):
            if self.pair:
                # p0 + p1, as the face adds them
                total = self.face.exchange(self.seq, index, part, self.deadline) + part
            else:
                self.face.send_sum(self.seq, index, part, self.deadline)
                total = self.face.read_sum(self.seq, index, part, self.deadline)
        out = _like(total, x)
        self._took(x, started)
        return out

    def gather(self, x: mx.array) -> mx.array:
        """Send this member's rows of a split head's logits to the face (which alone samples)."""
        index, _, part = self._partial(x)
        with self._blame(self.face):
            self.face.send_sum(self.seq, index, part, self.deadline)
        return x

    def close(self) -> None:
        self.face.close()
