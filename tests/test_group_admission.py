"""A tensor-parallel face's admission (dataplane/group.py): a stranger costs it a small, fixed budget of bytes
and time before the member's proof is checked, connections are proven concurrently, and on a TLS cluster only
a node's certificate, not revoked, joins."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from shardline.dataplane import group, group_stream
from shardline.dataplane.group import GroupFace, GroupMember
from shardline.dataplane.transport import DeadlineExceeded, Keys, TransportError
from shardline.trust import ca

pytestmark = pytest.mark.timeout(120)
KEY = "group-admission-key"


class _Payload:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.ok = type("Sample", (), {"payload": _Payload(data)})()


class _Queryable:
    def undeclare(self) -> None:
        pass


class FakeSession:
    """What the group needs of zenoh: the face answers on its key with its address; members ask."""

    def __init__(self) -> None:
        self.face: GroupFace | None = None

    def declare_queryable(self, key: str, handler: Any) -> _Queryable:
        return _Queryable()

    def get(self, key: str, timeout: float) -> list[_Reply]:
        return [_Reply(self.face.address.encode())] if self.face is not None else []


def face_of(size: int = 2, tls: Path | None = None) -> tuple[FakeSession, GroupFace]:
    session = FakeSession()
    face = GroupFace(session, Keys("inst", 5), 0, size, ["tcp/127.0.0.1:0"], KEY, tls_dir=tls)  # type: ignore[arg-type]
    session.face = face
    return session, face


def join(
    session: FakeSession, member: int, size: int = 2, tls: Path | None = None, timeout: float = 60
) -> Any:
    """A member joining in a thread: its GroupMember, or the error it raised, in the returned dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["member"] = GroupMember(session, Keys("inst", 5), 0, member, size, KEY, timeout, tls_dir=tls)  # type: ignore[arg-type]
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def admitting(face: GroupFace, timeout: float = 60) -> threading.Thread:
    """The face admitting its members in a thread (join it before closing the face)."""
    t = threading.Thread(target=lambda: _admit(face, timeout), daemon=True)
    t.start()
    return t


def _admit(face: GroupFace, timeout: float) -> None:
    try:
        face.admit(timeout)
    except DeadlineExceeded:
        pass


def raw(face: GroupFace) -> socket.socket:
    host, port = face.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def test_a_hello_claiming_2_to_the_34_bytes_is_refused_by_its_length_without_reading_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []
    read = group_stream.Stream.read

    def budgeted(self: group_stream.Stream, n: int, deadline: float | None, what: str) -> bytearray:
        asked.append(n)
        if n > 1 << 20:  # what the old face did: a zeroed buffer of the claimed size (16 GiB here)
            raise MemoryError(f"asked to read {n} bytes")
        return read(self, n, deadline, what)

    monkeypatch.setattr(group_stream.Stream, "read", budgeted)
    session, face = face_of()
    admitted = admitting(face)
    s = raw(face)
    assert len(s.recv(group.NONCE_BYTES)) == group.NONCE_BYTES
    s.sendall(struct.pack("<B", group.MESSAGE) + struct.pack("<Q", 1 << 34))
    assert s.recv(1) == b""  # refused: the face closed it
    assert max(asked) <= group.HELLO_MAX
    member = join(session, 1)
    member["thread"].join(60)
    assert "member" in member, member.get("error")
    assert face.refused >= 1
    admitted.join(60)
    member["member"].close()
    face.close()


def test_held_connections_do_not_keep_a_member_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # Strangers that connect and say nothing hold their handshakes for as long as the face lets them (here
    # longer than the bring-up's deadline): the member still joins beside them.
    monkeypatch.setattr(group, "HANDSHAKE_S", 600.0, raising=False)
    session, face = face_of()
    held = [raw(face) for _ in range(4)]
    member = join(session, 1)
    face.admit(30)  # four held connections proven one at a time at 10 s each would pass this deadline
    member["thread"].join(30)
    assert "member" in member, member.get("error")
    for s in held:
        s.close()
    member["member"].close()
    face.close()


def test_a_crowd_beyond_the_bound_is_closed_at_accept_and_the_member_still_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(group, "HANDSHAKE_S", 600.0)
    monkeypatch.setattr(group, "MAX_HANDSHAKES", 2)
    session, face = face_of()
    admitted = admitting(face)
    held = [raw(face) for _ in range(2)]
    for s in held:  # both slots taken: the face greeted them
        assert len(s.recv(group.NONCE_BYTES)) == group.NONCE_BYTES
    extra = raw(face)
    assert extra.recv(1) == b""  # no slot left: closed at once, nothing read from it
    for s in held:
        s.close()  # their slots free up; the member, refused while they were held, tries again
    member = join(session, 1)
    member["thread"].join(60)
    admitted.join(60)
    assert "member" in member, member.get("error")
    member["member"].close()
    face.close()


def test_a_member_with_a_wrong_key_is_refused_until_its_deadline() -> None:
    session, face = face_of()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            GroupMember(session, Keys("inst", 5), 0, 1, 2, "not-the-key", 3.0)  # type: ignore[arg-type]
        except (DeadlineExceeded, TransportError) as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    with pytest.raises(DeadlineExceeded):
        face.admit(3.0)
    t.join(30)
    assert "error" in out and face.refused >= 1
    face.close()


def test_on_a_tls_cluster_a_client_or_revoked_certificate_cannot_join_a_group(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    face_dir, member_dir, other_dir = ca.init(root, ["face", "member", "other"])[:3]
    client_dir = root / "nodes" / "client"
    session, face = face_of(tls=face_dir)
    admitted = admitting(face)
    # The CLI's certificate is signed by the same CA, but it is a client's: it never acts as a node.
    refused = join(session, 1, tls=client_dir, timeout=3)
    refused["thread"].join(30)
    assert isinstance(refused.get("error"), DeadlineExceeded | TransportError)
    assert face.refused >= 1
    member = join(session, 1, tls=member_dir)
    member["thread"].join(60)
    assert "member" in member, member.get("error")
    admitted.join(60)
    member["member"].close()
    face.close()
    # A revoked node certificate is refused by a face that holds the revocation list.
    ca.revoke(root, "other")
    session, face = face_of(tls=face_dir)
    admitted = admitting(face)
    revoked = join(session, 1, tls=other_dir, timeout=3)
    revoked["thread"].join(30)
    assert isinstance(revoked.get("error"), DeadlineExceeded | TransportError)
    member = join(session, 1, tls=member_dir)
    member["thread"].join(60)
    assert "member" in member, member.get("error")
    admitted.join(60)
    member["member"].close()
    face.close()
