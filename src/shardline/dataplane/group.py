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

Here: the face's admission and forwarding, and each side's sums. The framed stream and its TLS are
dataplane/group_stream.py; the step's tag, deadline, native op and timings both sides share, group_sums.py.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import zenoh

from shardline.dataplane import frame
from shardline.dataplane import messages as m
from shardline.dataplane.group_stream import LENGTH, MESSAGE, Stream, secure, tls_context
from shardline.dataplane.group_sums import Sums, sum_like
from shardline.dataplane.transport import DeadlineExceeded, Keys, TransportError
from shardline.instance.spec import runner_name

NONCE_BYTES = 16
# What the face spends on a connection before it is proven a member: a hello is ~200 bytes of JSON; a member
# on a loaded machine answers within a second. Both are fixed: a stranger cannot make the face wait or
# allocate more, whatever its length field says.
HELLO_MAX = 4096
HANDSHAKE_S = 3.0
MAX_HANDSHAKES = 16  # connections being proven at once; more are closed at accept (a member retries)
ACK = b"\x06"  # the face's word that a member was admitted
log = logging.getLogger("shardline.group")


def group_key(keys: Keys, stage: int) -> str:
    return f"{keys.root}/group/{stage}"


def _mac(key: str | None, nonce: bytes, hello: m.GroupHello) -> str:
    if key is None:
        return ""
    ident = f"{hello.instance}/{hello.generation}/{hello.stage}/{hello.member}".encode()
    return hmac.new(key.encode(), nonce + ident, hashlib.sha256).hexdigest()


def _host_of(listen: list[str]) -> str:
    """The address this runner's zenoh listens on (its node's): where its members can reach it."""
    for endpoint in listen:
        proto, _, rest = endpoint.partition("/")
        if proto in ("tcp", "tls"):
            host = rest.rsplit(":", 1)[0].strip("[]")
            return host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return "127.0.0.1"


class GroupFace(Sums):
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
        self.members: list[Stream] = []
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
        found: dict[int, Stream] = {}
        proven: queue.Queue[tuple[int, Stream] | None] = queue.Queue()
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

    def _take_proven(self, proven: queue.Queue[tuple[int, Stream] | None], found: dict[int, Stream]) -> None:
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
    def _drain(proven: queue.Queue[tuple[int, Stream] | None]) -> None:
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
        proven: queue.Queue[tuple[int, Stream] | None],
        slots: threading.BoundedSemaphore,
        done: threading.Event,
    ) -> None:
        """One connection's handshake, on its own thread, within `deadline` (TLS included)."""
        try:
            try:
                sock = secure(sock, self.tls, True, max(0.01, deadline - time.monotonic()))
                stream = Stream(sock, f"member at {addr[0]}:{addr[1]}")
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

    def _handshake(self, stream: Stream, deadline: float) -> int:
        """The member this stream proves to be. Reads at most HELLO_MAX bytes: a longer hello is refused by
        its length field, before anything of that length is read or allocated."""
        nonce = os.urandom(NONCE_BYTES)
        stream.send([nonce], deadline, "greeting")
        if stream.read_kind(deadline, "waiting for a hello") != MESSAGE:
            raise ValueError("no hello")
        (n,) = LENGTH.unpack(stream.read(LENGTH.size, deadline, "reading a hello"))
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
            out = sum_like(own + other, x)
            self._took(x, started)
            return out
        total = own.copy()  # added to
        for s in self.members:  # member order: the same bits on every run
            with self._blame(s):
                total += s.read_sum(self.seq, index, total, self.deadline)
        for s in self.members:
            with self._blame(s):
                s.send_sum(self.seq, index, total, self.deadline)
        out = sum_like(total, x)
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


class GroupMember(Sums):
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
    ) -> Stream:
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
                sock = secure(sock, ctx, False, max(0.1, deadline - time.monotonic()))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"stage {stage} member {member}: face at {address} unreachable"
                    ) from exc
                abort()
                time.sleep(0.05)  # a retry period, not a synchronisation
                continue
            face = Stream(sock, f"stage {stage}'s face (runner {stage})", slot=stage)
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
        out = sum_like(total, x)
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
