"""Who may be part of a cluster: the key and TLS for every session (nodes, runners, clients), commands that
no master may give, names that cannot escape, and what an intruder without the key can do (nothing).
Real node daemons on loopback with a tiny model; the default model in test_api_recovery.py (a keyed cluster
surviving a node kill)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from conftest import assert_no_runner_left, random_prompt
from pydantic import ValidationError

from shardline.cluster import messages as cm
from shardline.cluster.client import ClusterError
from shardline.cluster.keys import ClusterKeys
from shardline.cluster.placement import PlacementRequest
from shardline.dataplane import messages as m
from shardline.dataplane.frame import encode
from shardline.dataplane.transport import Link, open_session
from shardline.instance.spec import Fault, RunnerSpec
from shardline.testing.cluster import LocalCluster
from shardline.testing.reference import Reference
from shardline.trust import ca
from shardline.trust.credentials import (
    KEY_ENV,
    Credentials,
    CredentialsError,
    read_key_file,
    resolve,
)

KEY = "right-secret-0123"
SMALL = PlacementRequest(sequences=2, reserve_tokens=512, hop_cost_fraction=0.0, max_stages=2)


# ---- credentials, without a cluster ----------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_key_file_others_can_read_is_refused_and_a_private_one_is_read(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(CredentialsError, match=r"readable by others.*chmod 600"):
        read_key_file(path)
    os.chmod(path, 0o600)
    assert read_key_file(path) == KEY
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(CredentialsError, match="shorter than 8"):
        read_key_file(short)
    # The flag wins over the environment; the environment alone works too.
    assert resolve(path, None, {KEY_ENV: "from-the-env-1"}).key == KEY
    assert resolve(None, None, {KEY_ENV: "from-the-env-1"}).key == "from-the-env-1"
    assert KEY not in repr(Credentials(KEY))  # never in a log line by accident


@pytest.mark.timeout(20)
def test_cluster_init_writes_private_keys_and_refuses_to_overwrite_its_ca(tmp_path):
    folders = ca.init(tmp_path / "tls", ["a", "b"])
    assert [f.name for f in folders] == ["a", "b", "client"]
    for key in [*(f / "node.key" for f in folders), tmp_path / "tls" / "ca" / "ca.key"]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    with pytest.raises(CredentialsError, match="holds a CA already"):
        ca.init(tmp_path / "tls", ["c"])
    with pytest.raises(CredentialsError, match="node name"):
        ca.add_node(tmp_path / "tls", "../evil")
    assert ca.add_node(tmp_path / "tls", "c").name == "c"


@pytest.mark.timeout(30)
def test_sessions_meet_only_with_the_same_key_or_the_same_ca(tmp_path):
    ca.init(tmp_path / "one", ["a", "b"])
    ca.init(tmp_path / "two", ["x"])
    cases = [
        (Credentials(KEY), Credentials(KEY), True),
        (Credentials(KEY), Credentials("another-secret"), False),
        (Credentials(KEY), Credentials(), False),
        (Credentials(), Credentials(KEY), False),  # a keyed initiator does not join an open listener either
        (Credentials(None, tmp_path / "one/nodes/a"), Credentials(None, tmp_path / "one/nodes/b"), True),
        (Credentials(None, tmp_path / "one/nodes/a"), Credentials(None, tmp_path / "two/nodes/x"), False),
    ]
    for i, (server, client, meet) in enumerate(cases):
        port = _free_port()
        a = open_session([f"tcp/127.0.0.1:{port}"], [], Link(credentials=server))
        try:
            got: list[str] = []
            a.declare_subscriber("t/**", lambda s, got=got: got.append(str(s.key_expr)))
            b = open_session([], [f"tcp/127.0.0.1:{port}"], Link(credentials=client))
            try:
                if meet:
                    _wait(lambda b=b: list(b.info.peers_zid()), 10, f"case {i}: peers")
                    pub = b.declare_publisher("t/x")
                    _wait(lambda p=pub, got=got: (p.put(b"x"), got)[1], 10, f"case {i}: a sample")
                else:
                    # A refused link never comes up: both sides still see no peer after several attempts.
                    deadline = time.monotonic() + 3
                    while time.monotonic() < deadline:
                        assert not list(b.info.peers_zid()) and not list(a.info.peers_zid()), f"case {i}"
                        b.put("t/x", b"x")
                        _wait_quiet(0.2)
                    assert got == [], f"case {i}"
            finally:
                b.close()
        finally:
            a.close()


@pytest.mark.timeout(10)
def test_names_that_could_escape_are_malformed():
    base = dict(generation=1, slot=0, stages=1, model_dir="", layer_start=0, layer_end=1, layer_total=1)
    for bad in ("../x", "a/b", "", "x" * 200, "a b", "*"):
        with pytest.raises(ValidationError):
            RunnerSpec(instance=bad, connect=[], **base)
        with pytest.raises(ValidationError):
            cm.Place(model=bad)
    RunnerSpec(instance="smollm2-135m-instruct-c52828", model="Qwen3-0.6B-4bit", connect=[], **base)


# ---- a keyed cluster of real daemons ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(models, tmp_path_factory) -> Iterator[LocalCluster]:
    """Two keyed nodes; k2 holds no model, so its stage's weights are copied from k1 over keyed links."""
    empty = tmp_path_factory.mktemp("empty-models")
    cluster = LocalCluster(tmp_path_factory.mktemp("keyed"), ["k1"], models, key=KEY).start()
    cluster.add("k2", models_dir=empty)
    try:
        yield cluster
    finally:
        pids = cluster.all_pids()
        cluster.close()
        assert_no_runner_left(pids)


@pytest.mark.timeout(330)
def test_a_keyed_cluster_copies_weights_places_and_serves_exact_text(keyed, models):
    client = keyed.client("k1")
    client.wait(lambda v: {n.node_id for n in v.nodes if n.alive} == {"k1", "k2"}, 30, "both nodes")
    reply = client.place("tiny-llama", SMALL)
    assert reply.instance is not None
    # One generation may fail to bring its ring up: runners meet by gossip, both dial at once, and two keyed
    # handshakes can collide so that neither link comes up (5 of 190 keyed pairs here; zenoh's one-dialer
    # strategy avoids it but leaves a three-node mesh unmade). The next generation is the recovery.
    rec = client.wait_ready(reply.instance.instance, 240)
    assert {s.node_id for s in rec.stages} == {"k1", "k2"}  # k2 copied its stage from k1
    prompt = random_prompt(20, seed=3)
    expected = Reference(models / "tiny-llama").greedy(prompt, 12)[0]
    assert client.front(rec.instance).submit(prompt, max_tokens=12).tokens(timeout=60) == expected
    # The runners joined with the key from their environment; it is on no command line.
    for node in keyed.nodes.values():
        for pid in [node.pid, *node.runner_pids()]:
            assert KEY not in " ".join(psutil.Process(pid).cmdline())


@pytest.mark.timeout(120)
def test_a_keyless_process_can_neither_join_nor_publish_nor_reach_a_runner(keyed):
    client = keyed.client("k1")
    view = client.wait(lambda v: any(r.phase == "ready" for r in v.instances), 120, "a ready instance")
    term = view.term
    k1 = keyed.nodes["k1"]
    runner_ports = [c.laddr.port for p in k1.runner_pids() for c in psutil.Process(p).net_connections("tcp")]
    runner_ports = sorted({p for p in runner_ports if p})
    assert runner_ports
    keys = ClusterKeys(keyed.namespace)
    targets = [k1.endpoint, *(f"tcp/127.0.0.1:{p}" for p in runner_ports)]
    intruder = open_session([], targets, Link())
    try:
        forged = cm.ClusterView(term=term + 1000, seq=1, master="k0", nodes=[], instances=[])
        start = m.StartRunner(
            spec=RunnerSpec(
                instance="evil", generation=1 << 40, slot=0, stages=1, model_dir="/", layer_start=0,
                layer_end=1, layer_total=1, connect=[],
            ),
            term=term + 1000,
        )  # fmt: skip
        deadline = time.monotonic() + 4  # several report periods and lease checks
        while time.monotonic() < deadline:
            assert not list(intruder.info.peers_zid()), "a keyless session was let in"
            intruder.put(keys.view, encode(forged))
            intruder.put(keys.agent("k1"), encode(start))
            _wait_quiet(0.2)
    finally:
        intruder.close()
    fresh = client.wait(lambda v: v.seq > view.seq + 2, 10, "fresh views")
    assert fresh.term == term and fresh.master == view.master
    assert "evil" not in k1.tail(400)


@pytest.mark.timeout(120)
def test_commands_no_master_may_give_are_refused_and_counted(models, tmp_path):
    """On an open cluster (anyone may send): a StartRunner naming a path, or injecting a fault, is refused
    by the node agent, counted in /metrics and logged once."""
    cluster = LocalCluster(tmp_path / "open", ["o1"], models, api=True).start()
    try:
        client = cluster.client()
        view = client.wait(lambda v: v.master == "o1", 30, "a master")
        o1 = cluster.nodes["o1"]
        spec = dict(generation=1 << 40, slot=0, stages=1, layer_start=0, layer_end=1, layer_total=1)
        bad = [
            RunnerSpec(instance="by-path", model_dir="/etc", model="tiny-llama", connect=[], **spec),
            RunnerSpec(
                instance="by-fault", model_dir="", model="tiny-llama", connect=[],
                fault=Fault(phase="load", action="exit"), **spec,
            ),
        ]  # fmt: skip
        pub = client.session.declare_publisher(ClusterKeys(cluster.namespace).agent("o1"))
        for s in bad:
            pub.put(encode(m.StartRunner(spec=s, term=view.term)))
        import httpx

        def refused() -> dict[str, float]:
            text = httpx.get(f"{o1.api}/metrics", timeout=10).text
            out = {}
            for line in text.splitlines():
                if line.startswith("shardline_refused_total{"):
                    out[line.split("{", 1)[1].split("}")[0]] = float(line.rsplit(" ", 1)[1])
            return out

        got = _wait(lambda: len(refused()) >= 2 and refused(), 20, "both refusals counted")
        assert any("names a path" in k for k in got) and any("fault injection is off" in k for k in got), got
        assert not o1.runner_pids()
        log = o1.tail(400)
        assert log.count("refused start_runner (names a path") == 1
    finally:
        cluster.close()


@pytest.mark.timeout(60)
def test_the_key_is_never_a_flag_and_a_readable_key_file_is_a_clear_error(tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    os.chmod(key, 0o644)
    argv = [sys.executable, "-m", "shardline", "node", "--cluster-key-file", str(key), "--no-api"]
    argv += ["--data-dir", str(tmp_path / "d"), "--listen", f"tcp/127.0.0.1:{_free_port()}"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=50)
    assert run.returncode != 0
    assert "readable by others" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    help_text = subprocess.run(
        [sys.executable, "-m", "shardline", "node", "--help"], capture_output=True, text=True, timeout=50
    ).stdout
    assert "--cluster-key-file" in help_text and "--cluster-key " not in help_text


@pytest.mark.timeout(60)
def test_a_bad_model_name_is_a_clear_client_error(keyed):
    client = keyed.client("k1")
    with pytest.raises(ClusterError, match="model name"):
        client.place("../etc", SMALL)


# ---- helpers --------------------------------------------------------------------------------------------


def _free_port() -> int:
    from shardline.testing.cluster import free_port

    return free_port()


def _wait(cond, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        _wait_quiet(0.05)
    raise AssertionError(f"no {what} within {timeout}s")


def _wait_quiet(seconds: float) -> None:
    """A poll period inside a loop that checks a condition against a deadline."""
    import threading

    threading.Event().wait(seconds)
