"""What a cluster certificate may do: its role (a node, or a client such as the CLI), its name, and whether
the cluster revoked it.

The role is the certificate's organizational unit (OU=node or OU=client), set by `shardline cluster init` and
`cluster add-node [--client]`; a node's name is its common name (CN). Revocation is a CRL signed by the CA
(`shardline cluster revoke`), kept as crl.pem in each TLS folder: a CRL needs no trust in whoever carries it,
so every node passes it on with its reports (trust/seal.py keeps the newest by its CRL number).
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from shardline.trust.credentials import CA_FILE, CredentialsError

NODE, CLIENT = "node", "client"
ROLES = (NODE, CLIENT)
CRL_FILE = "crl.pem"


def role_of(cert: x509.Certificate) -> str | None:
    """The certificate's role; None for one issued before roles (or by someone else)."""
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = str(units[0].value) if units else None
    return role if role in ROLES else None


def name_of(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def refusal(cert: bytes | x509.Certificate, want: str, revoked: frozenset[int]) -> str | None:
    """Why a peer showing `cert` (already verified against the cluster CA) may not act as `want`; None
    when it may. A client certificate never acts as a node; a revoked one acts as nothing."""
    if isinstance(cert, bytes):
        try:
            cert = x509.load_der_x509_certificate(cert)
        except ValueError:
            return "an unreadable certificate"
    name = name_of(cert)
    if cert.serial_number in revoked:
        return f"certificate of {name!r} is revoked"
    role = role_of(cert)
    if role is None:
        return f"certificate of {name!r} has no role (older than roles: sign it again)"
    if role != want:
        return f"certificate of {name!r} is a {role}'s, not a {want}'s"
    return None


def load_crl(tls_dir: Path) -> x509.CertificateRevocationList | None:
    """The folder's CRL, checked against its CA; None when it has none. A CRL that is not the CA's is an
    error (refused at start, never silently ignored)."""
    path = tls_dir / CRL_FILE
    if not path.is_file():
        return None
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
        ca = x509.load_pem_x509_certificate((tls_dir / CA_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"unreadable revocation list {path}: {exc}") from exc
    if crl.issuer != ca.subject or not crl.is_signature_valid(ca.public_key()):  # type: ignore[arg-type]
        raise CredentialsError(f"revocation list {path} is not signed by the cluster CA")
    return crl


def serials(crl: x509.CertificateRevocationList | None) -> frozenset[int]:
    return frozenset() if crl is None else frozenset(r.serial_number for r in crl)


def revoked_serials(tls_dir: Path) -> frozenset[int]:
    return serials(load_crl(tls_dir))
