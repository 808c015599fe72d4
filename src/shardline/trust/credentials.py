"""A session's credentials: the cluster key (zenoh user/password authentication) and TLS with mutual
authentication (zenoh's tls/ links, certificates from one cluster CA).

The key never travels on a command line or lands in a file others can read: it comes from a 0600 file
(`--cluster-key-file`) or the environment (SHARDLINE_CLUSTER_KEY), reaches runners through their
environment, and zenoh reads it from an anonymous memory file (a private temporary file where memfd does not
exist, removed as soon as the session is open).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import zenoh

KEY_ENV = "SHARDLINE_CLUSTER_KEY"
TLS_ENV = "SHARDLINE_TLS_DIR"
USER = "shardline"  # zenoh's authentication wants a user name; the secret is the password
# What a node's TLS folder holds (`shardline cluster init` writes them): the cluster CA's certificate, and
# this node's certificate and private key, signed by that CA.
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "node.pem", "node.key"


class CredentialsError(ValueError):
    """A key or TLS folder that cannot be used; the message says why in one line."""


@dataclass(frozen=True)
class Credentials:
    key: str | None = field(default=None, repr=False)  # the shared secret; None: an open cluster
    tls_dir: Path | None = None  # None: plain tcp/ links

    @property
    def tls(self) -> bool:
        return self.tls_dir is not None

    def env(self) -> dict[str, str]:
        """What a child process (a runner) needs to join as this one does."""
        out = {}
        if self.key is not None:
            out[KEY_ENV] = self.key
        if self.tls_dir is not None:
            out[TLS_ENV] = str(self.tls_dir)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Credentials:
        environ = os.environ if environ is None else environ
        key = environ.get(KEY_ENV) or None
        tls = environ.get(TLS_ENV) or None
        return cls(check_key(key) if key is not None else None, check_tls_dir(Path(tls)) if tls else None)

    def endpoint(self, endpoint: str) -> str:
        """With TLS every link is tls/: a tcp/ endpoint names the same address and port."""
        if self.tls and endpoint.startswith("tcp/"):
            return "tls/" + endpoint[4:]
        return endpoint

    @contextmanager
    def applied(self, config: zenoh.Config) -> Iterator[zenoh.Config]:
        """`config` with authentication and TLS set, valid while zenoh opens the session (it reads the
        key's dictionary file then)."""
        if self.tls_dir is not None:
            d = self.tls_dir
            tls = {
                "root_ca_certificate": str(d / CA_FILE),
                "listen_certificate": str(d / CERT_FILE),
                "listen_private_key": str(d / KEY_FILE),
                "connect_certificate": str(d / CERT_FILE),
                "connect_private_key": str(d / KEY_FILE),
                "enable_mtls": True,  # both ends show a certificate of the cluster CA
                # Trust is "signed by the cluster CA", not a host name: machines change addresses.
                "verify_name_on_connect": False,
            }
            config.insert_json5("transport/link/tls", json.dumps(tls))
        if self.key is None:
            yield config
            return
        with _dictionary(f"{USER}:{self.key}\n") as path:
            auth = {"user": USER, "password": self.key, "dictionary_file": path}
            config.insert_json5("transport/auth/usrpwd", json.dumps(auth))
            yield config


@contextmanager
def _dictionary(text: str) -> Iterator[str]:
    """A path to `text` that nobody else can read, gone once the block ends."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardline-key", os.MFD_CLOEXEC)
        try:
            os.write(fd, text.encode())
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    folder = tempfile.mkdtemp(prefix="shardline-key-")  # 0700
    path = os.path.join(folder, "key")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield path
    finally:
        for p in (path, folder):
            try:
                os.remove(p) if p == path else os.rmdir(p)
            except OSError:
                pass


def check_key(key: str) -> str:
    key = key.strip()
    if len(key) < 8:
        raise CredentialsError("the cluster key is shorter than 8 characters")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise CredentialsError("the cluster key must be printable characters without spaces")
    return key


def read_key_file(path: Path) -> str:
    """The key in `path`, refused (like ssh refuses a private key) when others may read the file."""
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise CredentialsError(f"cannot read the cluster key file {path}: {exc.strerror}") from exc
    if os.name == "posix" and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        mode = stat.S_IMODE(st.st_mode)
        raise CredentialsError(
            f"the cluster key file {path} is readable by others (mode {mode:o}): chmod 600"
        )
    return check_key(text)


def check_tls_dir(path: Path) -> Path:
    missing = [n for n in (CA_FILE, CERT_FILE, KEY_FILE) if not (path / n).is_file()]
    if missing:
        raise CredentialsError(
            f"TLS folder {path} lacks {', '.join(missing)} (make one with `shardline cluster init`)"
        )
    return path.resolve()


def resolve(
    key_file: Path | None, tls_dir: Path | None, environ: Mapping[str, str] | None = None
) -> Credentials:
    """The credentials a command runs with: flags first, then the environment."""
    env = Credentials.from_env(environ)
    key = read_key_file(key_file) if key_file is not None else env.key
    tls = check_tls_dir(tls_dir) if tls_dir is not None else env.tls_dir
    return Credentials(key, tls)
