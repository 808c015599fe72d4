"""Hugging Face repositories: `org/name[@revision][:QUANT]` -> files in the local HF cache, verified.

The one module that talks to the hub, through the installed `huggingface_hub` (its client, its errors, its
URLs and its cache layout: `models--org--name/{blobs,snapshots,refs}`), so what it downloads is what
`hf download` would have, and what `hf download` left is used in place. `HF_TOKEN`, `HF_ENDPOINT`,
`HF_HUB_OFFLINE` and `HF_HOME` / `HF_HUB_CACHE` keep their meaning; they are read when `fetch` is called (a
test or a daemon may set them after `huggingface_hub` was imported).

Files are downloaded by this module, with `huggingface_hub`'s `http_get`, into `blobs/<etag>.incomplete` under
the same file lock `hf_hub_download` takes: a download killed midway (the process, not only the connection)
resumes from that file with a range request. huggingface_hub 2.4's own downloads write to a name unique to the
process and drop it on failure, so they resume only within one process. Each file is checked against the
hub's own digest before it enters the cache (LFS files: the sha256 the hub reports; small files: their git
blob sha1); a mismatch is removed, so a retry downloads it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from shardline.models.errors import CorruptModelError, ModelError, ModelNotFoundError

DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's `-hf org/repo` takes without a tag
# The files mlx-lm's own downloader fetches (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS), at the repository's top.
MLX_PATTERNS = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model")
MLX_PATTERNS += ("*.txt", "*.jsonl", "*.jinja")
SPLIT = re.compile(r"^(?P<base>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"  # the hub's repo-name rule, less its `--`/`..`
REF = re.compile(
    rf"(?P<org>{_PART})/(?P<name>{_PART})(?:@(?P<rev>[^\s:@]+))?(?::(?P<quant>[A-Za-z0-9_.-]+))?"
)
_QUANT_TAG = re.compile(
    r"(?:^|[-_.])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?|TQ\d_\d)(?=[-_.]|$)",
    re.IGNORECASE,
)
CHUNK_BYTES = 1 << 20  # a download writes this at a time: a process killed mid-file loses at most that
_SHA1 = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RepoRef:
    """A Hugging Face model repository, a revision in it (None: its default branch) and a GGUF quant tag."""

    repo_id: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{at}{':' + self.quant if self.quant else ''}"

    @property
    def model_name(self) -> str:
        """A model name that may cross the cluster's wire (trust/names.py: no slash, no `+`, 128 characters at
        most), one per reference.

        `org/name` -> `org--name` (as the HF cache names it; the hub forbids `--` inside names), `@rev` ->
        `--rev` (characters outside [A-Za-z0-9._-] become `_`), `:QUANT` -> `--QUANT` (upper case, as tags
        compare): `org/name@v1:q8_0` -> `org--name--v1--Q8_0`."""
        return model_name(self.repo_id, self.revision, self.quant)


def model_name(repo_id: str, revision: str | None, quant: str | None) -> str:
    name = repo_id.replace("/", "--")
    if revision:
        name += "--" + re.sub(r"[^A-Za-z0-9._-]", "_", revision)
    if quant:
        name += "--" + quant.upper()
    if len(name) > 128:  # the wire's bound (trust/names.py): keep a readable head and make it unique again
        name = name[:111] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return name


def parse_repo_ref(text: str) -> RepoRef | None:
    """`org/name[@revision][:QUANT]` as a RepoRef, also written `hf.co/...` (as Ollama takes it) or as the
    hub's web address; None for anything else (a path, a known name, ...).

    A relative path of two parts (`models/foo`) parses too: the resolver looks at the disk first."""
    match = REF.fullmatch(re.sub(r"^(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/", "", text.strip()))
    if match is None or any(".." in p or "--" in p for p in (match["org"], match["name"])):
        return None
    rev = match["rev"]
    if rev is not None and (rev.startswith("/") or rev.endswith("/") or ".." in rev or "//" in rev):
        return None
    return RepoRef(f"{match['org']}/{match['name']}", rev, match["quant"])


@dataclass(frozen=True)
class HubModel:
    """A fetched repository: an mlx-lm directory (`path`, the snapshot, used in place) or a GGUF (`path`, its
    first part; `files`, every part). `revision` is the commit the hub resolved; `digests` maps each fetched
    file's repository name to its sha256."""

    kind: Literal["mlx", "gguf"]
    path: Path
    files: list[Path]
    repo_id: str
    revision: str
    digests: dict[str, str]
    quant: str | None = None  # the GGUF quant tag chosen (asked for or the default)
    requested: str | None = None  # the revision as asked (a branch, a tag, a commit or None)

    @property
    def model_name(self) -> str:
        """The cache-safe name of what was fetched: as RepoRef.model_name, with the quant actually chosen."""
        return model_name(self.repo_id, self.requested, self.quant if self.kind == "gguf" else None)


@dataclass(frozen=True)
class _Listed:
    """One repository file as the hub lists it (or as the cache holds it: sizes and ids then unknown)."""

    name: str
    size: int | None = None
    blob_id: str | None = None  # git sha1 of the file (of its LFS pointer for an LFS file)
    sha256: str | None = None  # LFS files: the sha256 the hub reports


# --- settings, read when called, with huggingface_hub's names and defaults


def offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    # huggingface_hub's own reading of the variable (constants._is_true), now rather than at its import
    return env.strip().upper() in {"1", "ON", "YES", "TRUE"} if env is not None else constants.HF_HUB_OFFLINE


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache() -> Path:
    """The Hugging Face hub cache: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    from huggingface_hub import constants

    if explicit := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.path.expandvars(explicit)).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def storage_dir(repo_id: str) -> Path:
    return hub_cache() / ("models--" + repo_id.replace("/", "--"))


# --- choosing the files


def quant_tag(filename: str) -> str | None:
    """The quant tag in a GGUF's name (`Qwen3-8B-Q4_K_M-00001-of-00002.gguf` -> `Q4_K_M`), upper case."""
    stem = PurePosixPath(filename).name
    stem = SPLIT.sub(r"\g<base>", stem) if SPLIT.match(stem) else stem.removesuffix(".gguf")
    tags = _QUANT_TAG.findall(stem) or _QUANT_TAG.findall(str(PurePosixPath(filename).parent))
    return tags[-1].upper() if tags else None


def _gguf_groups(names: list[str]) -> dict[str, list[str]]:
    """The repository's GGUF models (vision projectors left out): a split model's parts grouped, in order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        base = PurePosixPath(name).name
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        split = SPLIT.match(base)
        key = str(PurePosixPath(name).parent / split["base"]) if split else name
        groups.setdefault(key, []).append(name)
    return groups


def _summary(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return f"{shown}, and {len(names) - 6} more" if len(names) > 6 else shown or "no files"


def _plan(ref: RepoRef, entries: list[_Listed]) -> tuple[Literal["mlx", "gguf"], list[_Listed], str | None]:
    """Which files of the repository make the model: (kind, files, quant tag) as llama.cpp and mlx-lm pick."""
    names = [e.name for e in entries]
    by_name = {e.name: e for e in entries}
    top = [n for n in names if "/" not in n]
    has_mlx = "config.json" in top and any(fnmatch(n, "model*.safetensors") for n in top)
    groups = _gguf_groups(names)
    if has_mlx and ref.quant is None:
        return "mlx", [by_name[n] for n in top if any(fnmatch(n, p) for p in MLX_PATTERNS)], None
    if not groups:
        if ref.quant is not None:
            raise ModelNotFoundError(f"{ref.repo_id} has no .gguf files to choose {ref.quant!r} from")
        raise ModelNotFoundError(
            f"{ref.repo_id} holds neither an mlx-lm model (config.json and model*.safetensors) nor .gguf "
            f"files: it has {_summary(names)}"
        )
    tags = {key: quant_tag(parts[0]) for key, parts in groups.items()}
    wanted = (ref.quant or DEFAULT_QUANT).upper()
    chosen = [key for key, tag in tags.items() if tag == wanted]
    if not chosen and ref.quant is None:
        chosen = list(groups)  # no Q4_K_M: the only, or the first, as llama.cpp does
    if not chosen:
        available = sorted({t or PurePosixPath(k).name for k, t in tags.items()})
        raise ModelNotFoundError(f"{ref.repo_id} has no {ref.quant} GGUF; available: {', '.join(available)}")
    parts = groups[chosen[0]]
    split = SPLIT.match(PurePosixPath(parts[0]).name)
    if split and len(parts) != int(split["count"]):
        raise ModelNotFoundError(
            f"{ref.repo_id}: split GGUF {PurePosixPath(chosen[0]).name} lists {split['count']} parts but the "
            f"repository holds {len(parts)}"
        )
    return "gguf", [by_name[n] for n in parts], tags[chosen[0]]


# --- the cache


def _safe(name: str) -> str:
    """A repository file name that stays inside the snapshot directory."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not name or "\\" in name:
        raise CorruptModelError(f"refusing repository file name {name!r}")
    return name


def _etag(entry: _Listed) -> str:
    """The blob name huggingface_hub gives the file: the LFS sha256, else the git blob sha1."""
    etag = entry.sha256 or entry.blob_id
    if etag is None or not (_SHA256.fullmatch(etag) or _SHA1.fullmatch(etag)):
        raise ModelError(f"the hub reports no usable digest for {entry.name} ({etag!r})")
    return etag


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The lock hf_hub_download takes on a blob (filelock: flock on the same file); released if we die."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _link(pointer: Path, blob: Path) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, relative as huggingface_hub makes it, atomically."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    temp = pointer.with_name(f".{pointer.name}.{os.getpid()}.link")
    temp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(blob, pointer.parent), temp)
    os.replace(temp, pointer)


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = storage / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    temp = ref.with_name(f".{ref.name}.{os.getpid()}")
    temp.write_text(commit)
    os.replace(temp, ref)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _git_sha1(path: Path) -> str:
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _digest(path: Path) -> str:
    """sha256 of a cached file: an LFS blob is named by it (free); anything else is hashed (small files)."""
    if path.is_symlink() and _SHA256.fullmatch(name := Path(os.readlink(path)).name):
        return name
    return _sha256(path)


def _check(repo_id: str, entry: _Listed, path: Path) -> str:
    """The file's sha256 after checking it against the hub's digest; CorruptModelError if they differ."""
    if entry.sha256 is not None:
        got, want, kind = _sha256(path), entry.sha256, "sha256"
    else:
        got, want, kind = _git_sha1(path), entry.blob_id or "", "git sha1"
    if got != want:
        raise CorruptModelError(
            f"{repo_id}/{entry.name}: downloaded bytes have {kind} {got[:12]}, the hub says {want[:12]}; "
            "removed, run again to download it anew"
        )
    return got if entry.sha256 is not None else _sha256(path)


# --- fetching


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def _hub_error(ref: RepoRef, error: Exception, base: str) -> ModelError:
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return ModelError(f"{ref.repo_id} is gated on {base}: accept its terms there, then set HF_TOKEN")
    if isinstance(error, errors.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"no repository {ref.repo_id} on {base} (a private one needs HF_TOKEN with access to it)"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return ModelNotFoundError(f"{ref.repo_id} on {base} has no revision {ref.revision!r}")
    if isinstance(error, errors.HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status in (401, 403):
            return ModelError(f"{base} refused {ref.repo_id} (HTTP {status}): set HF_TOKEN with access")
        return ModelError(f"{base} answered HTTP {status} for {ref.repo_id}")
    return ModelError(f"cannot fetch {ref} from {base}: {_one_line(error)}")


def _cached(ref: RepoRef, reason: str) -> HubModel:
    """The model from the local HF cache alone (no request). `reason` says why the hub is not asked."""
    storage = storage_dir(ref.repo_id)
    revision = ref.revision or "main"
    commit = revision if _SHA1.fullmatch(revision) else None
    if commit is None and (ref_file := storage / "refs" / revision).is_file():
        commit = ref_file.read_text().strip()
    snapshot = storage / "snapshots" / (commit or "-")
    if commit is None or not snapshot.is_dir():
        raise ModelNotFoundError(f"{reason}: {ref} is not in the Hugging Face cache ({storage})")
    names = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    try:
        kind, chosen, quant = _plan(ref, [_Listed(n) for n in names])
    except ModelNotFoundError as error:
        raise ModelNotFoundError(f"{reason}: the cached copy of {error}") from None
    if kind == "mlx":
        _check_complete(ref, snapshot, {e.name for e in chosen}, reason)
    files = [snapshot / e.name for e in chosen]
    digests = {e.name: _digest(snapshot / e.name) for e in chosen}
    path = snapshot if kind == "mlx" else files[0]
    return HubModel(kind, path, files, ref.repo_id, commit, digests, quant, ref.revision)


def _check_complete(ref: RepoRef, snapshot: Path, have: set[str], reason: str) -> None:
    """A cached mlx-lm snapshot holds every weights file its index names (an interrupted fetch does not)."""
    import json

    index = snapshot / "model.safetensors.index.json"
    needed = set(json.loads(index.read_text()).get("weight_map", {}).values()) if index.is_file() else set()
    if missing := sorted(needed - have):
        raise ModelNotFoundError(f"{reason}: the cached copy of {ref} lacks {_summary(missing)}")


class _Bar:
    """One tqdm for the whole fetch; http_get gets a class whose instances forward to it."""

    def __init__(self, label: str, total: int | None, initial: int, enabled: bool) -> None:
        from tqdm import tqdm

        shown = {"desc": label, "unit": "B", "unit_scale": True, "file": sys.stderr, "disable": not enabled}
        self.bar: Any = tqdm(total=total, initial=initial, **shown)

    def forwarder(self) -> type:
        bar = self.bar

        class Forward:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def __enter__(self) -> Forward:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

            def update(self, n: float | None = 1) -> None:
                bar.update(n or 0)

        return Forward


def _download(
    ref: RepoRef, base: str, commit: str, entry: _Listed, bar: _Bar, headers: dict[str, str]
) -> str:
    """One file into the cache (resuming blobs/<etag>.incomplete), checked; returns its sha256."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.file_download import http_get

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)  # lose 1 MiB, not 10
    storage = storage_dir(ref.repo_id)
    etag = _etag(entry)
    blob = storage / "blobs" / etag
    pointer = storage / "snapshots" / commit / _safe(entry.name)
    with _locked(hub_cache() / ".locks" / storage.name / f"{etag}.lock"):
        if not blob.is_file():
            partial = blob.with_name(f"{etag}.incomplete")
            partial.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "ab") as out:
                have = out.tell()
                if entry.size is not None and have > entry.size:
                    out.truncate(0)
                    have = 0
                url = hf_hub_url(ref.repo_id, entry.name, revision=commit, endpoint=base)
                shown = {"displayed_filename": entry.name, "tqdm_class": bar.forwarder()}
                http_get(url, out, resume_size=have, headers=dict(headers), expected_size=entry.size, **shown)
            try:
                digest = _check(ref.repo_id, entry, partial)
            except CorruptModelError:
                partial.unlink(missing_ok=True)
                raise
            os.chmod(partial, 0o644)
            os.replace(partial, blob)
        else:
            digest = entry.sha256 or _sha256(blob)
        _link(pointer, blob)
    return digest


def fetch(ref: RepoRef, progress: bool = True, user_agent: dict[str, str] | None = None) -> HubModel:
    """The model `ref` names, in the local HF cache: what is cached is used in place (online, the hub is
    asked only which commit the revision is and what it holds), what is not is downloaded, resumably, with
    one progress bar on stderr when `progress`, and checked against the hub's digests.

    ModelNotFoundError / ModelError / CorruptModelError, each one line, for what cannot be had."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import build_hf_headers

    from shardline import __version__

    base = endpoint()
    if offline():
        return _cached(ref, "offline (HF_HUB_OFFLINE is set)")
    api = HfApi(endpoint=base, library_name="shardline", library_version=__version__, user_agent=user_agent)
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except OfflineModeIsEnabled:
        return _cached(ref, "offline (HF_HUB_OFFLINE is set)")
    except (httpx2.TransportError, OSError) as error:
        response = error.response if isinstance(error, HfHubHTTPError) else None
        if response is not None and response.status_code < 500:
            raise _hub_error(ref, error, base) from None
        return _cached(ref, f"cannot reach {base} ({_one_line(error)})")
    commit = str(info.sha)
    entries = [
        _Listed(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs is not None else None)
        for s in info.siblings or []
    ]
    kind, chosen, quant = _plan(ref, entries)
    storage = storage_dir(ref.repo_id)
    snapshot = storage / "snapshots" / commit
    missing = [e for e in chosen if not (snapshot / _safe(e.name)).is_file()]
    digests = {e.name: e.sha256 or _digest(snapshot / e.name) for e in chosen if e not in missing}
    if missing:
        partial = sum(_partial_size(storage, e) for e in missing)
        sizes = [e.size for e in missing]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        bar = _Bar(str(ref), total, partial, progress)
        library = {"library_name": "shardline", "library_version": __version__}
        headers = build_hf_headers(user_agent=user_agent, **library)
        try:
            for entry in missing:
                digests[entry.name] = _download(ref, base, commit, entry, bar, headers)
        except (httpx2.TransportError, OSError) as error:
            if isinstance(error, HfHubHTTPError):
                raise _hub_error(ref, error, base) from None
            raise ModelError(f"fetching {ref} failed ({_one_line(error)}); run again to resume") from None
        finally:
            bar.bar.close()
    _write_ref(storage, ref.revision or "main", commit)
    files = [snapshot / e.name for e in chosen]
    path = snapshot if kind == "mlx" else files[0]
    return HubModel(kind, path, files, ref.repo_id, commit, digests, quant, ref.revision)


def _partial_size(storage: Path, entry: _Listed) -> int:
    with contextlib.suppress(ModelError, OSError):
        return (storage / "blobs" / f"{_etag(entry)}.incomplete").stat().st_size
    return 0
