"""A cluster's certificate authority: `shardline cluster init DIR` and `shardline cluster add-node DIR NAME`.

DIR/ca/ holds the CA's certificate and private key: keep it on the machine that admits nodes. Each
DIR/nodes/NAME/ holds what one machine needs (the CA certificate, its own certificate and key); copy that
folder to the machine and start `shardline node --tls FOLDER`. A peer is trusted when its certificate is
signed by the CA, in both directions (mutual TLS).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shardline.trust.credentials import CA_FILE, CERT_FILE, KEY_FILE, CredentialsError

CA_KEY = "ca.key"  # the CA's private key: it stays on the machine that admits nodes
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
CA_DAYS, NODE_DAYS = 3650, 825
_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def init(folder: Path, nodes: list[str], cluster: str = "shardline") -> list[Path]:
    """A new CA in folder/ca and a folder per node (and one named `client` for CLI use); refuses to
    overwrite an existing CA. Returns the node folders."""
    ca_dir = folder / "ca"
    if (ca_dir / CA_KEY).exists():
        raise CredentialsError(f"{ca_dir} holds a CA already: add nodes with `shardline cluster add-node`")
    for n in nodes:
        _check_name(n)
    ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster} cluster CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_private(ca_dir / CA_KEY, _key_pem(key))
    (ca_dir / CA_FILE).write_bytes(_cert_pem(cert))
    return [add_node(folder, n) for n in dict.fromkeys([*nodes, "client"])]


def add_node(folder: Path, node: str, addresses: list[str] | None = None) -> Path:
    """folder/nodes/NODE: the CA certificate, and a certificate and key for NODE signed by the CA."""
    _check_name(node)
    ca_dir = folder / "ca"
    try:
        ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"no usable CA in {ca_dir} (make one with `shardline cluster init`)") from exc
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(node), x509.DNSName("localhost")]
    for a in addresses or ["127.0.0.1"]:
        names.append(x509.IPAddress(ipaddress.ip_address(a)))
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=NODE_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = folder / "nodes" / node
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_private(out / KEY_FILE, _key_pem(key))
    (out / CERT_FILE).write_bytes(_cert_pem(cert))
    (out / CA_FILE).write_bytes(_cert_pem(ca_cert))
    return out


def _check_name(node: str) -> None:
    if not NAME.match(node):
        raise CredentialsError(f"node name {node!r}: letters, digits, '.', '_' and '-' only (at most 63)")
