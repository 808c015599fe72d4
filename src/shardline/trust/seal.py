"""Who said a cluster message: node reports, the master's views and election ballots carry a seal in their
zenoh attachment, checked where they are received, before anything is folded in.

zenoh authenticates links, not messages: a sample says nothing about the certificate of the session that put
it (its source id is the sender's own claim), so any holder of a cluster credential could speak as any node.
The seal binds the message to a speaker:

- TLS clusters: an ECDSA signature over the frame by the node's certificate key, with the certificate. The
  receiver checks that the CA issued it, that it is a node's (a client's certificate never speaks as a
  node), not revoked, and named as the node the message speaks for (a report's node_id, a view's master, a
  claim's candidate, a vote's voter). The CA's revocation list (signed by the CA, so anyone may carry it)
  rides every report and view: copied into any one node's TLS folder, it reaches every node within a
  report period, and each keeps it in its own folder.
- Shared-key clusters: an HMAC over the frame under the key. It proves a key holder, not which one: every
  key holder is a full node, and may speak as any node. Use TLS where that matters.
- Open clusters: no seal; anyone who reaches a node is a node (hence `--insecure` off loopback).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shardline.trust import roles
from shardline.trust.credentials import CA_FILE, CERT_FILE, KEY_FILE, Credentials, CredentialsError

_DOMAIN = b"shardline seal v1\x00"  # a seal is never valid as any other HMAC or signature of the key
MAX_SEAL = 8192  # a seal is a certificate and a signature (about 700 bytes): more is refused unread
_CACHE = 64  # certificates checked against the CA, by their bytes


# Sessions whose sealed outboxes (commands to node agents) seal with a node's credentials: registered by
# the node for its session's life. By id: zenoh sessions take no weak references.
_SEALERS: dict[int, Sealer] = {}


def register(session: object, sealer: Sealer | None) -> None:
    """Seal what sealed outboxes of `session` send with `sealer` (None: forget the session)."""
    if sealer is None:
        _SEALERS.pop(id(session), None)
    else:
        _SEALERS[id(session)] = sealer


def sealer_of(session: object) -> Sealer | None:
    return _SEALERS.get(id(session))


def certificate_name(tls_dir: Path) -> str:
    """The node name in a TLS folder's certificate: a TLS node's id (what its seals are checked against)."""
    try:
        return roles.name_of(x509.load_pem_x509_certificate((tls_dir / CERT_FILE).read_bytes()))
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"unreadable certificate in {tls_dir}: {exc}") from exc


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Sealer:
    """Seals what this node puts (None: an open cluster, nothing to seal with)."""

    key: str | None = field(default=None, repr=False)
    private: ec.EllipticCurvePrivateKey | None = field(default=None, repr=False)
    cert_der: bytes = b""

    @classmethod
    def of(cls, creds: Credentials) -> Sealer:
        if creds.tls_dir is None:
            return cls(key=creds.key)
        d = creds.tls_dir
        private = serialization.load_pem_private_key((d / KEY_FILE).read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        cert = x509.load_pem_x509_certificate((d / CERT_FILE).read_bytes())
        return cls(creds.key, private, cert.public_bytes(serialization.Encoding.DER))

    def seal(self, data: bytes, crl: bytes = b"") -> bytes | None:
        """The seal of `data`; `crl`: the revocation list (DER) a master's view carries to every node."""
        if self.private is not None:
            sig = self.private.sign(_DOMAIN + data, ec.ECDSA(hashes.SHA256()))
            out = {"cert": _b64(self.cert_der), "sig": _b64(sig)}
            if crl:
                out["crl"] = _b64(crl)
            return json.dumps(out).encode()
        if self.key is not None:
            mac = hmac.new(self.key.encode(), _DOMAIN + data, hashlib.sha256).hexdigest()
            return json.dumps({"mac": mac}).encode()
        return None


class Checker:
    """Checks seals against this node's credentials; thread-safe (zenoh calls from its own threads)."""

    def __init__(self, creds: Credentials) -> None:
        self.key = creds.key
        self.tls_dir = creds.tls_dir
        self._lock = threading.Lock()
        self._checked: OrderedDict[bytes, x509.Certificate] = OrderedDict()
        self.ca: x509.Certificate | None = None
        self.crl: x509.CertificateRevocationList | None = None
        self.revoked: frozenset[int] = frozenset()
        self._crl_file: tuple[int, int] | None = None  # (mtime, size) of the folder's list when last read
        if self.tls_dir is not None:
            self.ca = x509.load_pem_x509_certificate((self.tls_dir / CA_FILE).read_bytes())
            self._crl_file = _stamp(self.tls_dir / roles.CRL_FILE)
            self.crl = roles.load_crl(self.tls_dir)
            self.revoked = roles.serials(self.crl)

    @property
    def sealed(self) -> bool:
        """Whether this cluster seals its messages at all (a key or TLS)."""
        return self.key is not None or self.ca is not None

    def check(self, speaker: str | None, data: bytes, attachment: bytes | None) -> str | None:
        """Why the message `data`, said to be `speaker`'s (None: any node's), is refused; None when its seal
        holds."""
        if not self.sealed:
            return None
        if attachment is None:
            return "no seal"
        if len(attachment) > MAX_SEAL:
            return f"a seal of {len(attachment)} bytes"
        try:
            seal = json.loads(attachment)
            if not isinstance(seal, dict):
                return "a malformed seal"
            if self.ca is not None:
                return self._check_cert(speaker, data, seal)
            given = seal.get("mac")
            mac = hmac.new(self.key.encode(), _DOMAIN + data, hashlib.sha256).hexdigest()  # type: ignore[union-attr]
            return (
                None if isinstance(given, str) and hmac.compare_digest(given, mac) else "a wrong key's seal"
            )
        except (ValueError, TypeError) as exc:
            return f"a malformed seal ({str(exc)[:80]})"

    def _check_cert(self, speaker: str | None, data: bytes, seal: dict) -> str | None:
        der = base64.b64decode(seal.get("cert", ""), validate=True)
        sig = base64.b64decode(seal.get("sig", ""), validate=True)
        cert = self._issued(der)
        if cert is None:
            return "a certificate the cluster CA did not issue"
        now = datetime.datetime.now(datetime.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            return f"an expired certificate of {roles.name_of(cert)!r}"
        with self._lock:
            revoked = self.revoked
        if why := roles.refusal(cert, roles.NODE, revoked):
            return why
        if (name := roles.name_of(cert)) != speaker and speaker is not None:
            return f"the certificate of {name!r} speaking as {speaker!r}"
        try:
            cert.public_key().verify(sig, _DOMAIN + data, ec.ECDSA(hashes.SHA256()))  # type: ignore[call-arg,union-attr]
        except (InvalidSignature, TypeError, ValueError):
            return f"a signature that is not {name!r}'s"
        return None

    def _issued(self, der: bytes) -> x509.Certificate | None:
        with self._lock:
            if der in self._checked:
                self._checked.move_to_end(der)
                return self._checked[der]
        try:
            cert = x509.load_der_x509_certificate(der)
            cert.verify_directly_issued_by(self.ca)  # type: ignore[arg-type]
        except (ValueError, TypeError, InvalidSignature):
            return None
        with self._lock:
            self._checked[der] = cert
            while len(self._checked) > _CACHE:
                self._checked.popitem(last=False)
        return cert

    def crl_der(self) -> bytes:
        """This node's revocation list (DER; empty: none), carried by each report and view it publishes so
        that every node soon holds the newest. A list an operator copied into the TLS folder is read here
        (the node's report period): no restart needed."""
        self._refresh()
        with self._lock:
            crl = self.crl
        return b"" if crl is None else crl.public_bytes(serialization.Encoding.DER)

    def _refresh(self) -> None:
        if self.tls_dir is None or (stamp := _stamp(self.tls_dir / roles.CRL_FILE)) == self._crl_file:
            return
        self._crl_file = stamp
        try:
            crl = roles.load_crl(self.tls_dir)
        except CredentialsError:
            return  # not the CA's: the list held stays (the start refused such a file already)
        with self._lock:
            if crl is not None and _number(crl) > _number(self.crl):
                self.crl, self.revoked = crl, roles.serials(crl)

    def adopt_crl(self, attachment: bytes | None) -> bool:
        """Take the revocation list a (checked) view carries when the CA signed it and it is newer than this
        node's; kept in the TLS folder so a restart keeps it. True when adopted."""
        if self.ca is None or self.tls_dir is None or attachment is None:
            return False
        try:
            der = base64.b64decode(json.loads(attachment).get("crl", ""), validate=True)
            if not der:
                return False
            crl = x509.load_der_x509_crl(der)
        except (ValueError, TypeError, AttributeError):
            return False
        if crl.issuer != self.ca.subject or not crl.is_signature_valid(self.ca.public_key()):  # type: ignore[arg-type]
            return False
        with self._lock:
            if _number(crl) <= _number(self.crl):
                return False
            self.crl, self.revoked = crl, roles.serials(crl)
        path = self.tls_dir / roles.CRL_FILE
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
            os.replace(tmp, path)  # runners started from now on check their group links against it
            self._crl_file = _stamp(path)
        except OSError:
            pass  # held in memory; a restart reads the folder's older list until a peer's next report
        return True


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _number(crl: x509.CertificateRevocationList | None) -> int:
    if crl is None:
        return -1
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0
