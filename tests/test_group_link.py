"""The tensor-parallel group's streams (dataplane/group_stream.py, group_sums.py): sums exchanged and
checked, every wait bounded by its deadline, a broken stream named at once, and on a TLS cluster encrypted
and mutually authenticated."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from shardline.dataplane.frame import FrameError
from shardline.dataplane.group_stream import Stream, secure, tls_context
from shardline.dataplane.group_sums import Sums
from shardline.dataplane.transport import DeadlineExceeded, TransportError
from shardline.trust import ca

pytestmark = pytest.mark.timeout(60)


def pair(tls: tuple[Path, Path] | None = None) -> tuple[Stream, Stream]:
    """Two ends of one loopback TCP stream (TLS when given the two sides' node folders)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        sock, _ = server.accept()
        try:
            accepted.append(secure(sock, tls_context(tls[0], True) if tls else None, True, 10))
        except OSError:  # a refused handshake: the client side raises too, and the test looks there
            sock.close()

    t = threading.Thread(target=accept)
    t.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    client = secure(client, tls_context(tls[1], False) if tls else None, False, 10)
    t.join(timeout=10)
    server.close()
    # (the face's stream, whose peer is the member; the member's, whose peer is the face)
    return Stream(accepted[0], "member", slot=1), Stream(client, "face", slot=0)


def exchange_both(a: Stream, b: Stream, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    got: dict[str, np.ndarray] = {}
    t = threading.Thread(target=lambda: got.update(b=b.exchange(3, 0, y, time.monotonic() + 10)))
    t.start()
    got["a"] = a.exchange(3, 0, x, time.monotonic() + 10)
    t.join(timeout=10)
    return got["a"], got["b"]


@pytest.mark.parametrize("floats", [2048, 256 * 2048])  # a decode step's sum; a prefill chunk's (2 MB)
def test_a_pair_exchanges_partials_both_ways_at_once(floats: int) -> None:
    a, b = pair()
    x, y = np.arange(floats, dtype=np.float32), -np.ones(floats, dtype=np.float32)
    at_a, at_b = exchange_both(a, b, x, y)
    assert np.array_equal(at_a, y) and np.array_equal(at_b, x)
    # Both sides add p0 + p1: the same bits.
    assert np.array_equal(x + at_a, at_b + y)


def test_a_silent_peer_is_named_at_the_deadline_and_a_closed_one_at_once() -> None:
    a, b = pair()
    like = np.zeros(2048, dtype=np.float32)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="member stalled"):  # the member sends nothing
        a.read_sum(5, 0, like, time.monotonic() + 0.5)
    assert 0.4 < time.monotonic() - started < 3.0
    b.close()
    started = time.monotonic()
    with pytest.raises(TransportError, match="member vanished"):
        a.exchange(5, 1, like, time.monotonic() + 30)
    assert time.monotonic() - started < 2.0


def test_a_sum_of_another_step_is_refused() -> None:
    a, b = pair()
    like = np.zeros(16, dtype=np.float32)
    b.send_sum(8, 0, like, time.monotonic() + 5)
    with pytest.raises(FrameError, match="sum 0 of step 8"):
        a.read_sum(7, 0, like, time.monotonic() + 5)


def test_on_a_tls_cluster_the_stream_is_encrypted_and_a_stranger_is_refused(tmp_path: Path) -> None:
    face, member = ca.init(tmp_path / "cluster", ["face", "member"])[:2]
    a, b = pair((face, member))
    assert isinstance(a.sock, ssl.SSLSocket) and a.sock.version() is not None
    x = np.full(4096, 2.5, dtype=np.float32)
    at_a, at_b = exchange_both(a, b, x, x * 2)
    assert np.array_equal(at_a, x * 2) and np.array_equal(at_b, x)
    # A node of another cluster (another CA) cannot join the group.
    stranger = ca.init(tmp_path / "other", ["stranger"])[0]
    with pytest.raises((ssl.SSLError, OSError, IndexError)):
        pair((face, stranger))


def native_side(stream: Stream, face: bool, pair: bool = True) -> Sums:
    sums = Sums()
    sums._go_native([stream], face=face, pair=pair)
    assert sums.native is not None, "the op is built on this CPU machine"
    return sums


@pytest.mark.parametrize("floats", [2048, 256 * 2048])
def test_the_op_and_python_sum_the_same_frames_to_the_same_bits(floats: int) -> None:
    a, b = pair()
    face = native_side(a, face=True)
    x, y = np.arange(floats, dtype=np.float32) / 7, -np.ones(floats, dtype=np.float32) / 3
    got: dict[str, np.ndarray] = {}
    t = threading.Thread(target=lambda: got.update(b=b.exchange(4, 0, y, time.monotonic() + 10)))
    t.start()
    face.begin(4, 10.0)
    total = face._native_sum(mx.array(x).reshape(1, -1, 2048))  # a step of floats / 2048 positions
    assert total is not None
    mx.eval(total)
    t.join(timeout=10)
    face.check()
    assert np.array_equal(got["b"], x)  # the Python member read the op's frame
    assert np.array_equal(np.asarray(total).ravel(), got["b"] + y)  # and both hold p0 + p1
    assert face.count == 1 and len(face.timings_us[floats == 2048]) == 1  # timed as decode or prefill


def test_the_op_names_a_silent_peer_at_the_deadline_a_closed_one_at_once_and_a_wrong_frame() -> None:
    a, b = pair()
    lost: list[int] = []
    face = native_side(a, face=True)
    face.on_lost = lost.append
    face.begin(5, 0.5)
    first = face._native_sum(mx.ones((1, 1, 64)))
    assert first is not None
    second = face._native_sum(first * 2)  # after a failure the step's other sums wait for nothing
    started = time.monotonic()
    mx.eval(second)
    assert 0.4 < time.monotonic() - started < 3.0
    with pytest.raises(
        DeadlineExceeded, match=r"member stalled: nothing moved while exchanging sum 0 of step 5$"
    ):
        face.check()
    assert lost == [1]

    a, b = pair()
    member = native_side(b, face=False)
    a.close()
    member.begin(6, 30.0)
    started = time.monotonic()
    mx.eval(member._native_sum(mx.ones(64)))  # type: ignore[arg-type]
    assert time.monotonic() - started < 2.0
    with pytest.raises(TransportError, match="face vanished"):
        member.check()

    a, b = pair()
    member = native_side(b, face=False)
    a.send_sum(8, 0, np.zeros(16, dtype=np.float32), time.monotonic() + 5)
    member.begin(7, 5.0)
    mx.eval(member._native_sum(mx.zeros(16)))  # type: ignore[arg-type]
    with pytest.raises(FrameError, match="sum 0 of step 8"):
        member.check()


def test_the_op_adds_a_larger_groups_partials_in_member_order_and_returns_the_total() -> None:
    (a1, b1), (a2, b2) = pair(), pair()
    face = Sums()
    face._go_native([a1, a2], face=True, pair=False)
    parts = [np.random.default_rng(k).standard_normal(2048).astype(np.float32) for k in range(3)]
    got: dict[int, np.ndarray] = {}

    def member(k: int, stream: Stream) -> None:
        stream.send_sum(9, 0, parts[k], time.monotonic() + 10)
        got[k] = stream.read_sum(9, 0, parts[k], time.monotonic() + 10)

    threads = [threading.Thread(target=member, args=(k, s)) for k, s in ((1, b1), (2, b2))]
    for t in threads:
        t.start()
    face.begin(9, 10.0)
    total = face._native_sum(mx.array(parts[0]))
    assert total is not None
    mx.eval(total)
    for t in threads:
        t.join(timeout=10)
    face.check()
    expected = (parts[0] + parts[1]) + parts[2]
    assert np.array_equal(np.asarray(total), expected)
    assert np.array_equal(got[1], expected) and np.array_equal(got[2], expected)
