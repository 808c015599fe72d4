"""A stand-in for the Hugging Face hub on loopback: the requests huggingface_hub 2.4 makes, answered the way
the hub answers them, from repositories held in memory.

Served: model info (`/api/models/{repo}[/revision/{rev}]`, `?blobs=true` adds sizes, blob ids and LFS
sha256s), the tree listing (`/api/models/{repo}/tree/{rev}[/{path}]`) and file resolution
(`/{repo}/resolve/{rev}/{path}`, HEAD and GET) with the hub's headers: X-Repo-Commit, ETag (the git blob
sha1), for LFS files X-Linked-Etag (their sha256) and X-Linked-Size and a 302 to a CDN path, as the hub
redirects them; Accept-Ranges and range requests (206) everywhere. Errors carry the hub's X-Error-Code
(RepoNotFound, RevisionNotFound, EntryNotFound), which huggingface_hub maps to its exception types.

Faults for tests: `corrupt` serves altered bytes under the original digests, `cut_after` drops the
connection mid-body, `hold_after` stalls mid-body until released (a client can be killed meanwhile).
Every request is recorded (`requests`, `count`), and `GET /_fake/requests` reports the counts to another
process. `python -m shardline.testing.fake_hub --port N --mlx org/name --gguf org/other` serves generated
repositories until it is stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".pt", ".pth", ".npz", ".onnx")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the hub's default .gitattributes also sends big files to LFS
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
_DATE = "2026-01-01T00:00:00.000Z"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


@dataclass(frozen=True)
class HubFile:
    """One file of a commit, with the digests the hub reports for it."""

    name: str
    data: bytes

    @property
    def lfs(self) -> bool:  # as the hub's default .gitattributes has it
        return self.name.endswith(LFS_SUFFIXES) or len(self.data) >= LFS_MIN_SIZE

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:  # git stores the pointer for an LFS file
        return git_blob_sha1(lfs_pointer(self.data) if self.lfs else self.data)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class _Repo:
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    token: str | None = None  # set: private, readable with this bearer token only
    gate: str | None = None  # set: gated, its files readable with this bearer token only


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # with its query
    client: str  # host:port of the connection
    user_agent: str
    range: str | None
    authorization: str | None


@dataclass
class _Fault:
    kind: str  # "cut" or "hold"
    nbytes: int
    times: int = 1
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class _Error(Exception):
    def __init__(self, status: int, code: str | None, message: str, **headers: str) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str | None] = {"X-Error-Code": code, "X-Error-Message": message}
        self.headers |= {k.replace("_", "-"): v for k, v in headers.items()}


class FakeHub:
    """The hub on 127.0.0.1 (port 0: any free one), a context manager. `url` is what HF_ENDPOINT takes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, redirect_lfs: bool = True) -> None:
        self.redirect_lfs = redirect_lfs
        self.requests: list[Request] = []
        self._repos: dict[str, _Repo] = {}
        self._corrupt: set[tuple[str, str]] = set()
        self._faults: dict[tuple[str, str], _Fault] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # LFS files redirect to a second origin, as the hub's go to its CDN: huggingface_hub reads their
        # metadata from the redirect itself and sends no credentials there.
        self._servers = [ThreadingHTTPServer((host, p), _handler_for(self)) for p in (port, 0)]
        for server in self._servers:
            server.daemon_threads = True
            server.block_on_close = False
        self._threads: list[threading.Thread] = []

    # --- life
    @property
    def url(self) -> str:
        return _origin(self._servers[0])

    @property
    def cdn_url(self) -> str:
        return _origin(self._servers[1])

    def start(self) -> FakeHub:
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            for fault in self._faults.values():
                fault.release.set()
        for server, thread in zip(self._servers, self._threads, strict=False):
            server.shutdown()
            thread.join(timeout=10)
        for server in self._servers:
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- repositories
    def add_repo(
        self, repo_id: str, files: dict[str, bytes], revision_name: str = "main", token: str | None = None
    ) -> str:
        """A commit of `files` (the whole tree) in `repo_id`, named `revision_name` (a branch or tag, moved if
        it exists); returns the commit sha. `token`: the repository is private, readable with it only."""
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            if token is not None:
                repo.token = token
            tree = {name: HubFile(name, data) for name, data in files.items()}
            seed = json.dumps([repo_id, revision_name, len(repo.commits), sorted(tree)])
            sha = hashlib.sha1(seed.encode()).hexdigest()
            repo.commits[sha] = tree
            repo.refs[revision_name] = sha
            return sha

    def gate(self, repo_id: str, token: str) -> None:
        """Gate `repo_id`: its files go to `token` only (who accepted its terms); others get 401 GatedRepo."""
        with self._lock:
            self._repos[repo_id].gate = token

    def commit(self, repo_id: str, revision: str = "main") -> str:
        return self._resolve(repo_id, revision)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, HubFile]:
        with self._lock:
            return dict(self._repos[repo_id].commits[self._resolve(repo_id, revision)])

    def sha256s(self, repo_id: str, revision: str = "main") -> dict[str, str]:
        """Each file's sha256, as the hub knows it (the original bytes, whatever `corrupt` serves)."""
        return {n: f.sha256 for n, f in self.files(repo_id, revision).items()}

    # --- faults and counts
    def corrupt(self, repo_id: str, filename: str) -> None:
        """Serve `filename` with altered bytes (same length) under its original digests."""
        with self._lock:
            self._corrupt.add((repo_id, filename))

    def restore(self, repo_id: str, filename: str) -> None:
        with self._lock:
            self._corrupt.discard((repo_id, filename))
            self._faults.pop((repo_id, filename), None)

    def cut_after(self, repo_id: str, filename: str, nbytes: int, times: int = 1) -> None:
        """The next `times` GETs of `filename` send `nbytes` of their body, then drop the connection."""
        with self._lock:
            self._faults[(repo_id, filename)] = _Fault("cut", nbytes, times)

    def hold_after(self, repo_id: str, filename: str, nbytes: int) -> threading.Event:
        """The next GET of `filename` sends `nbytes` of its body, sets the returned event, and waits for
        `release` (or close) before it drops the connection."""
        fault = _Fault("hold", nbytes)
        with self._lock:
            self._faults[(repo_id, filename)] = fault
        return fault.reached

    def release(self, repo_id: str, filename: str) -> None:
        with self._lock:
            fault = self._faults.pop((repo_id, filename), None)
        if fault is not None:
            fault.release.set()

    def count(self, contains: str = "", method: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if contains in r.path and method in (None, r.method))

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {
                "total": len(self.requests),
                "by_user_agent": dict(Counter(r.user_agent for r in self.requests)),
                "by_path": dict(Counter(f"{r.method} {r.path}" for r in self.requests)),
            }

    # --- serving
    def _resolve(self, repo_id: str, revision: str) -> str:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _Error(404, "RepoNotFound", "Repository not found")
        sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if sha is None:
            raise _Error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _authorized(self, repo_id: str, authorization: str | None) -> None:
        repo = self._repos.get(repo_id)
        if repo is None or (repo.token is not None and authorization != f"Bearer {repo.token}"):
            # The hub hides private repositories: 401 without credentials, 404 with wrong ones.
            raise _Error(401 if authorization is None else 404, "RepoNotFound", "Repository not found")

    def _info(self, repo_id: str, revision: str, blobs: bool) -> dict[str, Any]:
        sha = self._resolve(repo_id, revision)
        siblings = []
        for f in sorted(self._repos[repo_id].commits[sha].values(), key=lambda f: f.name):
            entry: dict[str, Any] = {"rfilename": f.name}
            if blobs:
                entry |= {"size": len(f.data), "blobId": f.blob_id}
                if f.lfs:
                    pointer = len(lfs_pointer(f.data))
                    entry["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": pointer}
            siblings.append(entry)
        info: dict[str, Any] = {"_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha}
        info |= {"author": repo_id.split("/")[0], "private": self._repos[repo_id].token is not None}
        info |= {"gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": []}
        return info | {"lastModified": _DATE, "createdAt": _DATE, "siblings": siblings}

    def _tree(self, repo_id: str, revision: str, under: str, recursive: bool) -> list[dict[str, Any]]:
        sha = self._resolve(repo_id, revision)
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        for f in sorted(self._repos[repo_id].commits[sha].values(), key=lambda f: f.name):
            if not f.name.startswith(prefix):
                continue
            rest = f.name[len(prefix) :]
            parents = rest.split("/")[:-1]
            for depth in range(1, len(parents) + 1 if recursive else min(len(parents), 1) + 1):
                folders.add(prefix + "/".join(parents[:depth]))
            if "/" in rest and not recursive:
                continue
            entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": len(f.data), "path": f.name}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(lfs_pointer(f.data))}
            out.append(entry)
        tree_id = hashlib.sha1(prefix.encode()).hexdigest()
        out += [{"type": "directory", "oid": tree_id, "size": 0, "path": p} for p in sorted(folders)]
        return out

    def _file(self, repo_id: str, revision: str, name: str) -> tuple[str, HubFile]:
        sha = self._resolve(repo_id, revision)
        f = self._repos[repo_id].commits[sha].get(name)
        if f is None:
            raise _Error(404, "EntryNotFound", f"{name} does not exist on {revision}", X_Repo_Commit=sha)
        return sha, f

    def _body(self, repo_id: str, f: HubFile) -> tuple[bytes, _Fault | None]:
        """What a GET of `f` sends (altered if corrupted) and the fault it meets, used up."""
        with self._lock:
            data = f.data
            if (repo_id, f.name) in self._corrupt:
                data = bytes(b ^ 0x5A for b in data[:64]) + data[64:]
            fault = self._faults.get((repo_id, f.name))
            if fault is not None:
                fault.times -= 1
                if fault.times <= 0 and fault.kind == "cut":
                    del self._faults[(repo_id, f.name)]
        return data, fault


def _origin(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "fake-hub"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            url = urlsplit(self.path)
            client = f"{self.client_address[0]}:{self.client_address[1]}"
            sent = [self.headers.get(h) for h in ("Range", "Authorization")]
            request = Request(self.command, self.path, client, self.headers.get("User-Agent", ""), *sent)
            if url.path != "/_fake/requests":
                with hub._lock:
                    hub.requests.append(request)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            query = parse_qs(url.query)
            try:
                self._route(parts, query, head)
            except _Error as error:
                body = json.dumps({"error": str(error)}).encode()
                self._send(error.status, body, "application/json", head, error.headers)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _route(self, parts: list[str], query: dict[str, list[str]], head: bool) -> None:
            auth = self.headers.get("Authorization")
            if parts == ["_fake", "requests"]:
                return self._json(hub.counts(), head)
            if len(parts) >= 4 and parts[:2] == ["api", "models"]:
                repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
                hub._authorized(repo_id, auth)
                with hub._lock:
                    if not rest or rest[0] == "revision":
                        revision = rest[1] if len(rest) > 1 else "main"
                        blobs = query.get("blobs", ["false"])[0].lower() == "true"
                        return self._json(hub._info(repo_id, revision, blobs), head)
                    if rest[0] == "tree" and len(rest) > 1:
                        recursive = query.get("recursive", ["false"])[0].lower() == "true"
                        return self._json(hub._tree(repo_id, rest[1], "/".join(rest[2:]), recursive), head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id = f"{parts[0]}/{parts[1]}"
                hub._authorized(repo_id, auth)
                if (gate := hub._repos[repo_id].gate) is not None and auth != f"Bearer {gate}":
                    raise _Error(401, "GatedRepo", "Access to this model is restricted")
                with hub._lock:
                    sha, f = hub._file(repo_id, parts[3], "/".join(parts[4:]))
                return self._resolve_file(repo_id, sha, f, head)
            if len(parts) >= 5 and parts[0] == "_cdn":
                repo_id = f"{parts[1]}/{parts[2]}"
                with hub._lock:
                    sha, f = hub._file(repo_id, parts[3], "/".join(parts[4:]))
                return self._content(repo_id, f, head, {"ETag": f'"{f.sha256}"'})
            raise _Error(404, None, f"no route for {self.path}")

        def _resolve_file(self, repo_id: str, sha: str, f: HubFile, head: bool) -> None:
            headers = {"X-Repo-Commit": sha, "ETag": f'"{f.blob_id}"'}
            if f.lfs:
                headers |= {"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data))}
                if hub.redirect_lfs:
                    cdn = f"{hub.cdn_url}/_cdn/{repo_id}/{sha}/{quote(f.name)}"
                    return self._send(302, b"", "text/plain", head, headers | {"Location": cdn})
            self._content(repo_id, f, head, headers)

        def _content(self, repo_id: str, f: HubFile, head: bool, headers: dict[str, str]) -> None:
            data, fault = (f.data, None) if head else hub._body(repo_id, f)
            size = len(data)
            start, end, status = 0, size - 1, 200
            if (wanted := self.headers.get("Range")) is not None:
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
                if match is None or int(match[1]) >= size:
                    raise _Error(416, None, "Range Not Satisfiable", Content_Range=f"bytes */{size}")
                start, end, status = int(match[1]), min(int(match[2] or size - 1), size - 1), 206
                headers = headers | {"Content-Range": f"bytes {start}-{end}/{size}"}
            body = data[start : end + 1]
            headers = headers | {"Accept-Ranges": "bytes"}
            if fault is None:
                return self._send(status, body, "application/octet-stream", head, headers)
            self._send_head(status, len(body), "application/octet-stream", headers)
            self.wfile.write(body[: fault.nbytes])
            self.wfile.flush()
            if fault.kind == "hold":
                fault.reached.set()
                while not (fault.release.wait(0.2) or hub._stopped.is_set()):
                    pass
            self.close_connection = True

        def _json(self, payload: object, head: bool) -> None:
            self._send(200, json.dumps(payload).encode(), "application/json", head, {})

        def _send_head(self, status: int, length: int, kind: str, headers: dict[str, str | None]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(length))
            for name, value in headers.items():
                if value is not None:
                    self.send_header(name, value)
            self.end_headers()

        def _send(self, status: int, body: bytes, kind: str, head: bool, headers: dict[str, Any]) -> None:
            self._send_head(status, len(body), kind, headers)
            if not head:
                self.wfile.write(body)

    return Handler


# --- generated repositories


def _read_tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def mlx_repo_files(
    arch: str = "llama", seed: int = 0, sizes: dict[str, Any] | None = None
) -> dict[str, bytes]:
    """A tiny random mlx-lm model (testing.arch_zoo) as a repository: config.json, model.safetensors, a
    tokenizer, a README and the hub's .gitattributes."""
    from shardline.testing import arch_zoo

    with tempfile.TemporaryDirectory() as tmp:
        files = _read_tree(arch_zoo.write(arch, Path(tmp) / "model", seed=seed, sizes=sizes))
    return files | {"README.md": f"# tiny {arch}\n".encode(), ".gitattributes": GITATTRIBUTES}


def gguf_repo_files(
    stem: str = "Tiny",
    quants: Iterable[str] = ("F32", "Q8_0", "Q4_0"),
    split: str | None = None,
    seed: int = 0,
) -> dict[str, bytes]:
    """Tiny random GGUFs (testing.tiny_gguf), one per quant, named `{stem}-{QUANT}.gguf`; `split`: one more
    quant written as a split GGUF (`{stem}-{QUANT}-00001-of-0000N.gguf`, ...)."""
    import gguf

    from shardline.testing.tiny_gguf import write_tiny_gguf

    files: dict[str, bytes] = {"README.md": f"# {stem} GGUF\n".encode(), ".gitattributes": GITATTRIBUTES}
    with tempfile.TemporaryDirectory() as tmp:
        wanted = [(q, 0) for q in quants] + ([(split, 4)] if split else [])
        for quant, parts in wanted:
            qtype = None if quant == "F32" else gguf.GGMLQuantizationType[quant]
            out = Path(tmp) / quant
            out.mkdir()
            path = out / f"{stem}-{quant}.gguf"
            write_tiny_gguf(path, hidden=32, ffn=64, qtype=qtype, seed=seed, split_max_tensors=parts)
            files |= _read_tree(out)
    return files


def _serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardline.testing.fake_hub", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mlx", action="append", default=[], metavar="ORG/NAME[=ARCH]")
    parser.add_argument("--gguf", action="append", default=[], metavar="ORG/NAME")
    args = parser.parse_args(argv)
    hub = FakeHub(args.host, args.port)
    for spec in args.mlx:
        repo, _, arch = spec.partition("=")
        hub.add_repo(repo, mlx_repo_files(arch or "llama"))
    for repo in args.gguf:
        hub.add_repo(repo, gguf_repo_files())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with hub:
        print(f"FAKE_HUB {hub.url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    _serve()
