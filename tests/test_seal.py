"""Who said a cluster message (trust/seal.py): a report, view or ballot is folded in only when its seal shows
it is the speaker's: on TLS clusters a node certificate named as the node it speaks for, not a client's, not
revoked; on keyed clusters the key. The node's real handlers, and two TLS daemons that still meet."""

from __future__ import annotations

import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardline.cluster import messages as cm
from shardline.cluster import state as cs
from shardline.cluster.client import ClusterClient
from shardline.cluster.placement import PlacementRequest
from shardline.dataplane import messages as m
from shardline.dataplane.frame import encode
from shardline.dataplane.transport import Outbox, open_session
from shardline.node.agent import NodeAgent
from shardline.node.daemon import Node
from shardline.testing.cluster import LocalCluster
from shardline.trust import ca, refusals
from shardline.trust.credentials import Credentials
from shardline.trust.seal import Checker, Sealer, certificate_name, register

pytestmark = pytest.mark.timeout(60)
RES = cm.Resources(memory_total=1, memory_available=1, compute_score=1.0, device="cpu", cpus=1)


def report(node: str, digest: str = "1" * 64, at: float = 1e9) -> cm.NodeReport:
    model = cm.LocalModel(full=True, end=4, digest=digest, imported_at=at)
    return cm.NodeReport(
        node_id=node,
        name=node,
        endpoint="tls/127.0.0.1:1",
        started_at=0.0,
        resources=RES,
        models={"m": model},
    )


@pytest.fixture
def cluster_ca(tmp_path: Path) -> Path:
    ca.init(tmp_path, ["n1", "n2", "n3"])
    return tmp_path


def tls(root: Path, name: str) -> Credentials:
    return Credentials(None, root / "nodes" / name)


def test_a_node_certificate_speaks_only_as_its_own_name(cluster_ca: Path) -> None:
    data = encode(report("n1"))
    checker = Checker(tls(cluster_ca, "n2"))
    seal = Sealer.of(tls(cluster_ca, "n1")).seal(data)
    assert certificate_name(cluster_ca / "nodes" / "n1") == "n1"
    assert checker.check("n1", data, seal) is None
    assert "speaking as 'n3'" in (
        checker.check("n3", data, seal) or ""
    )  # node ids are no longer self-declared
    assert "signature" in (checker.check("n1", data + b" ", seal) or "")
    assert checker.check("n1", data, None) == "no seal"
    assert "a seal of" in (checker.check("n1", data, b"x" * 9000) or "")


def test_a_client_or_foreign_or_revoked_certificate_cannot_act_as_a_node(
    cluster_ca: Path, tmp_path: Path
) -> None:
    data = encode(report("client"))
    checker = Checker(tls(cluster_ca, "n2"))
    assert "client" in (checker.check("client", data, Sealer.of(tls(cluster_ca, "client")).seal(data)) or "")
    ca.init(tmp_path / "other", ["n1"])
    foreign = Sealer.of(Credentials(None, tmp_path / "other" / "nodes" / "n1")).seal(encode(report("n1")))
    assert "did not issue" in (checker.check("n1", encode(report("n1")), foreign) or "")
    # Revoked: n2's folder predates the list; the master's view carries it, and n2 adopts it (and keeps it).
    n3_before = encode(report("n3"))
    assert checker.check("n3", n3_before, Sealer.of(tls(cluster_ca, "n3")).seal(n3_before)) is None
    ca.revoke(cluster_ca, "n3")
    # A list an operator copies into a running node's folder is read at its next report, no restart.
    assert checker.crl_der() and "revoked" in (
        checker.check("n3", n3_before, Sealer.of(tls(cluster_ca, "n3")).seal(n3_before)) or ""
    )
    master = Checker(tls(cluster_ca, "n1"))
    assert master.crl_der()
    n3 = encode(report("n3"))
    n3_seal = Sealer.of(tls(cluster_ca, "n3")).seal(n3)
    assert "revoked" in (master.check("n3", n3, n3_seal) or "")
    late = tmp_path / "late"
    late.mkdir()
    for f in ("ca.pem", "node.pem", "node.key"):
        (late / f).write_bytes((cluster_ca / "nodes" / "n2" / f).read_bytes())
    stale = Checker(Credentials(None, late))
    assert stale.check("n3", n3, n3_seal) is None
    view = encode(cm.ClusterView(term=1, master="n1"))
    view_seal = Sealer.of(tls(cluster_ca, "n1")).seal(view, master.crl_der())
    assert stale.check("n1", view, view_seal) is None and stale.adopt_crl(view_seal)
    assert "revoked" in (stale.check("n3", n3, n3_seal) or "")
    assert "revoked" in (Checker(Credentials(None, late)).check("n3", n3, n3_seal) or "")  # kept on disk
    assert not stale.adopt_crl(view_seal)  # not newer


def test_keyed_and_open_clusters() -> None:
    data = encode(report("k1"))
    keyed = Checker(Credentials("right-secret-0123"))
    assert keyed.check("k1", data, Sealer.of(Credentials("right-secret-0123")).seal(data)) is None
    assert (
        keyed.check("k1", data, Sealer.of(Credentials("wrong-secret-0123")).seal(data))
        == "a wrong key's seal"
    )
    assert keyed.check("k1", data, None) == "no seal"
    assert (
        Sealer.of(Credentials()).seal(data) is None and Checker(Credentials()).check("k1", data, None) is None
    )


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


def sample(key: str, data: bytes, seal: bytes | None) -> Any:
    return types.SimpleNamespace(
        key_expr=key, payload=_Bytes(data), attachment=None if seal is None else _Bytes(seal)
    )


def node_stub(creds: Credentials) -> tuple[Any, list[Any]]:
    """Node's real receive handlers over a stub of the rest: what they enqueue is what the node folds."""
    got: list[Any] = []
    stub = types.SimpleNamespace(_checker=Checker(creds), _enqueue=got.append)
    stub._unsealed = types.MethodType(Node._unsealed, stub)
    return stub, got


def test_the_node_folds_only_reports_and_ballots_whose_seal_names_their_speaker(cluster_ca: Path) -> None:
    stub, got = node_stub(tls(cluster_ca, "n1"))
    n2 = Sealer.of(tls(cluster_ca, "n2"))
    before = sum(v for (what, why), v in refusals.counts().items() if why == "seal")
    honest = encode(report("n2"))
    Node._on_report(stub, sample("shardline/node/n2/report", honest, n2.seal(honest)))
    # n2 speaking as n3 (its report names n3, on n3's key): refused. So is a client's report, and a claim
    # by n2 for candidate n3, and a report with an imported_at of 0 from a client certificate.
    forged = encode(report("n3", digest="2" * 64, at=0.0))
    Node._on_report(stub, sample("shardline/node/n3/report", forged, n2.seal(forged)))
    client = encode(report("client", digest="2" * 64, at=0.0))
    Node._on_report(
        stub,
        sample("shardline/node/client/report", client, Sealer.of(tls(cluster_ca, "client")).seal(client)),
    )
    claim = encode(cm.Claim(term=5, candidate="n3", members=["n1", "n2", "n3"]))
    Node._on_ballot(stub, sample("shardline/master/ballot", claim, n2.seal(claim)))
    # A report of n2 on n3's key is refused too.
    Node._on_report(stub, sample("shardline/node/n3/report", honest, n2.seal(honest)))
    assert [type(e) for e in got] == [cs.ReportIn] and got[0].report.node_id == "n2"
    after = sum(v for (what, why), v in refusals.counts().items() if why in ("seal", "key"))
    assert after - before >= 4


@pytest.fixture(scope="module")
def tls_cluster(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("tls-ca")
    ca.init(root, ["t1", "t2"])
    cluster = LocalCluster(tmp_path_factory.mktemp("tls"), ["t1", "t2"], models, tls_root=root).start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_tls_daemons_seal_their_reports_and_meet(tls_cluster: LocalCluster) -> None:
    client = tls_cluster.client()
    view = client.wait(lambda v: tls_cluster.alive_ids(v) == {"t1", "t2"}, 120, "both TLS nodes alive")
    assert view.master in {"t1", "t2"}
    # The master's commands to both agents are sealed and obeyed: the instance comes up on the two nodes.
    reply = client.place("tiny-llama", PlacementRequest(sequences=1, reserve_tokens=256, max_stages=2))
    assert reply.instance is not None
    rec = client.wait_ready(reply.instance.instance, 150)
    assert {st.node_id for st in rec.stages} <= {"t1", "t2"}


def test_a_node_agent_obeys_commands_sealed_by_a_node_only(cluster_ca: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"tcp/127.0.0.1:{sock.getsockname()[1]}"
    server = open_session([endpoint], [])
    sender = open_session([], [endpoint])
    agent = NodeAgent(server, "shardline/node/n1/agent", tmp_path / "logs", credentials=tls(cluster_ca, "n1"))
    agent.start()
    taken: list[Any] = []
    arrived = threading.Event()
    agent._inbox.watch("agent", lambda env: (taken.append(env.message), arrived.set()))
    try:
        for who, why in (("client", "a client's"), ("n3", "revoked")):  # a client; a revoked node
            if who == "n3":
                ca.revoke(cluster_ca, "n3")
                agent._checker = Checker(tls(cluster_ca, "n1"))  # as a view would bring the list
            register(sender, Sealer.of(tls(cluster_ca, who)))
            out = Outbox(sender, "shardline/node/n1/agent", sealed=True)
            out.wait_matched(30)
            dropped = agent._inbox.dropped
            out.send(m.StopGeneration(instance=f"from-{who}", term=1))
            deadline = time.monotonic() + 30
            while agent._inbox.dropped == dropped and time.monotonic() < deadline:
                arrived.wait(0.05)  # a poll period inside a loop with a deadline
            assert agent._inbox.dropped == dropped + 1 and why in agent._inbox.last_drop, (
                agent._inbox.last_drop
            )
            out.close()
        register(sender, Sealer.of(tls(cluster_ca, "n2")))  # any node may be the master
        out = Outbox(sender, "shardline/node/n1/agent", sealed=True)
        out.wait_matched(30)
        out.send(m.StopGeneration(instance="from-n2", term=1))
        assert arrived.wait(30) and [x.instance for x in taken] == ["from-n2"]
        out.close()
    finally:
        register(sender, None)
        agent.close()
        sender.close()
        server.close()


def test_a_client_believes_only_views_sealed_by_their_master(cluster_ca: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"tcp/127.0.0.1:{sock.getsockname()[1]}"
    session = open_session([endpoint], [])
    client = ClusterClient([], credentials=tls(cluster_ca, "client"), session=session)
    try:
        forged = encode(cm.ClusterView(term=99, master="n3"))
        client._on_view(
            sample("shardline/master/view", forged, Sealer.of(tls(cluster_ca, "n2")).seal(forged))
        )
        client._on_view(sample("shardline/master/view", forged, None))
        assert client.view is None
        view = encode(cm.ClusterView(term=2, master="n1"))
        client._on_view(sample("shardline/master/view", view, Sealer.of(tls(cluster_ca, "n1")).seal(view)))
        assert client.view is not None and client.view.master == "n1" and client.view.term == 2
    finally:
        client.close()
        session.close()
