"""A cluster's certificate authority: `shardline cluster init DIR` and `shardline cluster add-node DIR NAME`.

DIR/ca/ holds the CA's certificate and private key: keep it on the machine that admits nodes. Each
DIR/nodes/NAME/ holds what one machine needs (the CA certificate, its own certificate and key); copy that
folder to the machine and start `shardline node --tls FOLDER`. A peer is trusted when its certificate is
signed by the CA, in both directions (mutual TLS), and acts only in its certificate's role (trust/roles.py):
DIR/nodes/client is a client's (commands), never a node's. `shardline cluster revoke DIR NAME` adds a
certificate to the CA's revocation list (DIR/ca/crl.pem, copied into every folder under DIR/nodes).
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
from shardline.trust.roles import CLIENT, CRL_FILE, NODE, load_crl, name_of

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
    """A new CA in folder/ca and a folder per node (and one named `client`, of the client role, for CLI
    use); refuses to overwrite an existing CA. Returns the folders."""
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
    if CLIENT in nodes:
        raise CredentialsError(f"{CLIENT!r} names the commands' certificate: name the nodes otherwise")
    return [*(add_node(folder, n) for n in dict.fromkeys(nodes)), add_node(folder, CLIENT, role=CLIENT)]


def _load_ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_dir = folder / "ca"
    try:
        ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"no usable CA in {ca_dir} (make one with `shardline cluster init`)") from exc
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    return ca_key, ca_cert


def add_node(folder: Path, node: str, addresses: list[str] | None = None, role: str = NODE) -> Path:
    """folder/nodes/NODE: the CA certificate, and a certificate and key for NODE signed by the CA, of
    `role` (a node's, or a client's: commands only). A name signed before is signed again (its old
    certificate stays valid until revoked)."""
    _check_name(node)
    ca_key, ca_cert = _load_ca(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(node), x509.DNSName("localhost")]
    for a in addresses or ["127.0.0.1"]:
        names.append(x509.IPAddress(ipaddress.ip_address(a)))
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.COMMON_NAME, node),
                ]
            )
        )
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
    if (crl := folder / "ca" / CRL_FILE).is_file():
        (out / CRL_FILE).write_bytes(crl.read_bytes())
    return out


def revoke(folder: Path, name: str) -> int:
    """Revoke the certificate in folder/nodes/NAME: a new CRL signed by the CA (its number one higher),
    written to folder/ca and copied into every folder under folder/nodes. Returns the serial revoked."""
    _check_name(name)
    ca_key, ca_cert = _load_ca(folder)
    try:
        cert = x509.load_pem_x509_certificate((folder / "nodes" / name / CERT_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"no certificate of {name!r} under {folder / 'nodes'}") from exc
    if name_of(cert) != name:
        raise CredentialsError(f"{folder / 'nodes' / name} holds the certificate of {name_of(cert)!r}")
    old = load_crl(folder / "ca")
    number = 1
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=CA_DAYS))
    )
    if old is not None:
        ext = old.extensions.get_extension_for_class(x509.CRLNumber)
        number = ext.value.crl_number + 1
        for r in old:
            builder = builder.add_revoked_certificate(r)
    if old is None or cert.serial_number not in {r.serial_number for r in old}:
        entry = (
            x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(now).build()
        )
        builder = builder.add_revoked_certificate(entry)
    crl = builder.add_extension(x509.CRLNumber(number), critical=False).sign(ca_key, hashes.SHA256())
    pem = crl.public_bytes(serialization.Encoding.PEM)
    (folder / "ca" / CRL_FILE).write_bytes(pem)
    for node_dir in sorted((folder / "nodes").iterdir()):
        if (node_dir / CA_FILE).is_file():
            (node_dir / CRL_FILE).write_bytes(pem)
    return cert.serial_number


def _check_name(node: str) -> None:
    if not NAME.match(node):
        raise CredentialsError(f"node name {node!r}: letters, digits, '.', '_' and '-' only (at most 63)")
