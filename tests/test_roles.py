"""Who a certificate lets act (trust/roles.py, trust/ca.py) and when a node may run an open cluster
(trust/exposure.py): cheap tests, the CLI's refusals as a user sees them (one line, non-zero exit)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from shardline.trust import ca, roles
from shardline.trust.credentials import CERT_FILE, CredentialsError
from shardline.trust.exposure import exposure, is_loopback, open_refusal

pytestmark = pytest.mark.timeout(120)


def cert(folder: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shardline", "node", "--no-api", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=100, env={**clean, **(env or {})})


def test_cluster_init_mints_node_certificates_and_a_client_one_that_is_no_node(tmp_path: Path) -> None:
    folders = ca.init(tmp_path, ["n1", "n2"])
    by_name = {f.name: cert(f) for f in folders}
    assert roles.role_of(by_name["n1"]) == roles.NODE and roles.name_of(by_name["n1"]) == "n1"
    assert roles.role_of(by_name["client"]) == roles.CLIENT
    assert roles.refusal(by_name["n2"], roles.NODE, frozenset()) is None
    assert "client" in (roles.refusal(by_name["client"], roles.NODE, frozenset()) or "")
    extra = ca.add_node(tmp_path, "ops", role=roles.CLIENT)
    assert roles.role_of(cert(extra)) == roles.CLIENT
    with pytest.raises(CredentialsError):
        ca.init(tmp_path / "other", ["client"])  # the name of the commands' certificate is no node's


def test_a_revoked_certificate_is_listed_in_every_folder_and_refused(tmp_path: Path) -> None:
    ca.init(tmp_path, ["n1", "n2", "n3"])
    serial = ca.revoke(tmp_path, "n2")
    ca.revoke(tmp_path, "n3")
    for name in ("n1", "n2", "n3", "client"):
        assert roles.revoked_serials(tmp_path / "nodes" / name) >= {
            serial,
            cert(tmp_path / "nodes" / "n3").serial_number,
        }
    assert "revoked" in (
        roles.refusal(
            cert(tmp_path / "nodes" / "n2"), roles.NODE, roles.revoked_serials(tmp_path / "nodes" / "n1")
        )
        or ""
    )
    late = ca.add_node(tmp_path, "n4")  # a folder made after a revocation gets the list too
    assert serial in roles.revoked_serials(late)
    # A list signed by another CA is refused, never silently used or ignored.
    ca.init(tmp_path / "other", ["x"])
    ca.revoke(tmp_path / "other", "x")
    (late / roles.CRL_FILE).write_bytes((tmp_path / "other" / "ca" / roles.CRL_FILE).read_bytes())
    with pytest.raises(CredentialsError, match="not signed by the cluster CA"):
        roles.revoked_serials(late)


def test_open_clusters_stay_on_loopback_unless_insecure() -> None:
    assert (
        is_loopback("tcp/127.0.0.1:7447") and is_loopback("tcp/[::1]:7447") and is_loopback("tcp/localhost:1")
    )
    assert (
        not is_loopback("tcp/0.0.0.0:7447")
        and not is_loopback("tcp/[::]:1")
        and not is_loopback("tcp/10.0.0.2:1")
    )
    assert exposure("tcp/127.0.0.1:7447", [], None) is None
    assert exposure("tcp/127.0.0.1:7447", ["tcp/10.0.0.3:7447"], None) == "it connects to tcp/10.0.0.3:7447"
    assert exposure("tcp/127.0.0.1:7447", [], "eth0") == "it scouts on interface eth0"
    assert open_refusal("tcp/0.0.0.0:7447", [], None, keyed=False, insecure=False) is not None
    assert open_refusal("tcp/0.0.0.0:7447", [], None, keyed=True, insecure=False) is None
    assert open_refusal("tcp/0.0.0.0:7447", [], None, keyed=False, insecure=True) is None


def test_an_open_node_off_loopback_exits_with_one_line(tmp_path: Path) -> None:
    run = node_cli("--listen", f"tcp/0.0.0.0:{free_port()}", "--data-dir", str(tmp_path / "d"))
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "open cluster" in lines[0] and "--insecure" in lines[0], run.stderr


def test_a_client_certificate_cannot_run_a_node(tmp_path: Path) -> None:
    ca.init(tmp_path / "c", ["n1"])
    run = node_cli(
        "--listen",
        f"tcp/127.0.0.1:{free_port()}",
        "--tls",
        str(tmp_path / "c" / "nodes" / "client"),
        "--data-dir",
        str(tmp_path / "d"),
    )
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "client" in lines[0] and "cannot run a node" in lines[0], run.stderr
