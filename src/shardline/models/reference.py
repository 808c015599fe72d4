"""The model references beyond a name or a directory: a local GGUF file (split or not) and a Hugging Face
repository, each made a model directory in the cache (registry.cache_dir) under one name.

- A GGUF is imported once, keyed by its digest (the sha256 of the file; of a split GGUF, the sha256 over its
  parts' sha256s): the import's shardline_import.json says where it came from (`origin`: the file or the hub
  repository, revision and digests), so the same bytes under another path find the import again. Digests are
  kept by (path, size, mtime) in the cache (SOURCE_DIGESTS), so a second run does not read 10 GB again.
- An MLX repository is used in place: the cache entry is a symbolic link to the snapshot in the HF cache
  (nodes list, hash and serve it as any directory), its origin in `.NAME.origin.json` beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from shardline.models.errors import ModelError
from shardline.models.gguf_import import DEFAULT_WEIGHTS, IMPORT_INFO_FILE, import_gguf
from shardline.models.gguf_split import split_parts, split_stem
from shardline.models.registry import (
    KNOWN_MODELS,
    NAME_PATTERN,
    cache_dir,
    import_lock,
    is_current,
    read_info,
    remove_stale_temps,
)
from shardline.models.validate import validate_model_dir

if TYPE_CHECKING:
    from shardline.models.hub import RepoRef

SOURCE_DIGESTS = ".source-digests.json"  # in the cache: path -> size, mtime and sha256 of files hashed
GGUF_MAGIC = b"GGUF"
_BLOCK = 8 << 20


def is_gguf(path: Path) -> bool:
    """A GGUF file by its magic (whatever its name)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def hub_ref(text: str) -> RepoRef | None:
    """`org/name[@revision][:QUANT]` parsed, else None."""
    from shardline.models.hub import parse_repo_ref

    return parse_repo_ref(text)


def origin_path(model_dir: Path) -> Path:
    """Beside the entry, as the digest record: an MLX snapshot's directory is the HF cache's, not ours."""
    return model_dir.parent / f".{model_dir.name}.origin.json"


def origin_of(model_dir: Path) -> dict[str, Any]:
    """Where a cache entry came from: its side file, else its import's `origin`; {} when unknown."""
    try:
        side = json.loads(origin_path(model_dir).read_text(encoding="utf-8"))
        if isinstance(side, dict):
            return side
    except (OSError, ValueError):
        pass
    origin = read_info(model_dir).get("origin")
    return origin if isinstance(origin, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- digests of source files ----------------------------------------------------------------------------


def _known_digests() -> dict[str, Any]:
    try:
        data = json.loads((cache_dir() / SOURCE_DIGESTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sha256(path: Path, progress: bool) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        path.open("rb") as f,
        tqdm(total=size, desc=f"Hashing {path.name}", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        while block := f.read(_BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def file_digests(parts: list[Path], progress: bool = False, given: dict[str, str] | None = None) -> list[str]:
    """Each file's sha256: as kept for its (path, size, mtime), as `given` (file name -> sha256, checked by
    the hub client), else read now and kept."""
    known = _known_digests()
    out, changed = [], False
    for part in parts:
        key = str(part.resolve())
        st = part.stat()
        entry = known.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
        ):
            out.append(str(entry["sha256"]))
            continue
        digest = (given or {}).get(part.name) or _sha256(part, progress)
        known[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        out.append(digest)
        changed = True
    if changed:
        try:
            cache_dir().mkdir(parents=True, exist_ok=True)
            _write_json(cache_dir() / SOURCE_DIGESTS, known)
        except OSError:
            pass  # a read-only cache hashes again next time
    return out


def source_digest(digests: list[str]) -> str:
    """A GGUF's digest: its file's sha256; a split GGUF's, the sha256 over its parts' (in order)."""
    return digests[0] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()


# ---- names ------------------------------------------------------------------------------------------------


def sanitize(text: str) -> str:
    """A model name (registry.NAME_PATTERN) made from a file stem: other characters become `-`."""
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", text).lstrip(".+-")[:180]
    return name or "gguf"


def find_import(digest: str) -> Path | None:
    """The cache entry imported from the GGUF of this digest, if any (a real directory, not an alias)."""
    root = cache_dir()
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        if NAME_PATTERN.fullmatch(entry.name) and not entry.is_symlink() and entry.is_dir():
            origin = read_info(entry).get("origin")
            if isinstance(origin, dict) and origin.get("digest") == digest:
                return entry
    return None


def _free_name(stem: str, digest: str) -> str:
    """The stem as a name, or with a short digest where the stem is taken by other bytes (or a known name)."""
    base = sanitize(stem)
    for name in (base, f"{base}-{digest[:8]}", f"{base}-{digest[:16]}", f"{base}-{digest}"):
        entry = cache_dir() / name
        if name in KNOWN_MODELS:
            continue
        if not (entry.exists() or entry.is_symlink()) or origin_of(entry).get("digest") == digest:
            return name
    raise ModelError(f"no free model name for {stem!r} in {cache_dir()}")


def gguf_name(path: Path) -> str:
    """The name a local GGUF file lives under once imported (hashes it the first time, imports nothing)."""
    parts = split_parts(path)
    digest = source_digest(file_digests(parts))
    found = find_import(digest)
    return found.name if found is not None else _free_name(split_stem(parts[0]), digest)


# ---- imports and registrations --------------------------------------------------------------------------


def import_gguf_file(
    path: Path,
    *,
    progress: bool = True,
    weights: str | None = None,
    name: str | None = None,
    origin: dict[str, Any] | None = None,
    given: dict[str, str] | None = None,
) -> Path:
    """The cache entry of a GGUF file (any part of a split one), imported unless the same bytes already were.

    name: the entry's name (a hub reference's); None: the file's stem (with a short digest if taken).
    origin: where it came from (default: the file). given: sha256s the hub client checked, by file name."""
    parts = split_parts(Path(path))
    digests = file_digests(parts, progress, given)
    digest = source_digest(digests)
    origin = {
        **(origin or {"kind": "file", "path": str(parts[0].resolve())}),
        "files": [p.name for p in parts],
        "digest": digest,
        "bytes": sum(p.stat().st_size for p in parts),
    }
    found = find_import(digest)
    if found is not None and is_current(found, None, weights):
        return found if name in (None, found.name) else register_alias(name, found, origin)
    target = found if found is not None else cache_dir() / (name or _free_name(split_stem(parts[0]), digest))
    with import_lock(target):
        again = find_import(digest)  # another process may have imported it meanwhile
        if again is not None and is_current(again, None, weights):
            target = again
        else:
            from shardline.models.store.manifest import record_import, record_path

            remove_stale_temps(target)
            record_path(target).unlink(missing_ok=True)
            origin_path(target).unlink(missing_ok=True)
            if target.is_symlink():
                target.unlink()
            import_gguf(
                parts[0], target, progress=progress, overwrite=True, weights=weights or DEFAULT_WEIGHTS
            )
            info = read_info(target)
            info["origin"] = origin
            _write_json(target / IMPORT_INFO_FILE, info)  # before the digests: they cover it
            record_import(target, target.name, replace=True)
    validate_model_dir(target)
    if name not in (None, target.name):
        return register_alias(name, target, origin)
    return cache_dir().resolve() / target.name


def register_link(name: str, directory: Path, origin: dict[str, Any]) -> Path:
    """Make the cache entry `name` a symbolic link to `directory` (an HF snapshot used in place, or another
    entry), with its origin beside it, and record its digests (hashed once, as an import's)."""
    from shardline.models.store.manifest import record_import, record_path

    link = cache_dir() / name
    validate_model_dir(link.parent / directory)  # a relative target is the cache's own entry
    target = str(directory)
    with import_lock(link):
        same = link.is_symlink() and os.readlink(link) == target and origin_of(link) == origin
        if not same:
            if link.is_symlink():
                link.unlink()
            elif link.exists():
                shutil.rmtree(link)  # ours: a copy a peer sent, or an older import under this name
            record_path(link).unlink(missing_ok=True)
            tmp = link.with_name(f".{name}.link-{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target, target_is_directory=True)
            os.replace(tmp, link)
            _write_json(origin_path(link), origin)
        record_import(link, name, replace=not same)
    return cache_dir().resolve() / name


def register_alias(name: str, entry: Path, origin: dict[str, Any]) -> Path:
    """A second name for an imported entry (a hub reference whose GGUF was imported under another name)."""
    return register_link(name, Path(entry.name), origin)  # relative: the cache may move


def resolve_hub(
    ref: RepoRef,
    *,
    progress: bool = True,
    weights: str | None = None,
    refresh: bool = False,
    on_phase: Callable[[str], None] | None = None,
) -> Path:
    """A Hugging Face reference's cache entry: taken as it is when present (no network) unless `refresh`;
    else fetched (hub.fetch), an MLX snapshot linked in place, a GGUF imported."""
    from shardline.models import hub

    name = ref.model_name
    entry = cache_dir() / name
    if (
        not refresh
        and (entry / "config.json").is_file()
        and (is_current(entry, None, weights) or _is_mlx(entry))
    ):
        return cache_dir().resolve() / name
    if on_phase is not None:
        on_phase("downloading")
    model = hub.fetch(ref, progress=progress)
    origin = {
        "kind": "hub",
        "repo": model.repo_id,
        "revision": model.revision,
        "requested": model.requested,
        "quant": model.quant,
        "digests": model.digests,
    }
    if model.kind == "mlx":
        return register_link(name, model.path, origin)
    given = {Path(k).name: v for k, v in model.digests.items()}
    if on_phase is not None:
        on_phase("importing")
    return import_gguf_file(
        model.path, progress=progress, weights=weights, name=name, origin=origin, given=given
    )


@contextmanager
def watch_download(ref: RepoRef, on_bytes: Callable[[int, int], None] | None) -> Iterator[None]:
    """Call on_bytes(done, 0) every second with the bytes in the repository's HF cache storage (partial
    files included) while the block runs: a download's progress, its total unknown here."""
    if on_bytes is None:
        yield
        return
    from shardline.models import hub

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):  # a sampling period, not a synchronisation
            blobs = hub.storage_dir(ref.repo_id) / "blobs"
            try:
                on_bytes(sum(p.stat().st_size for p in blobs.iterdir()), 0)
            except OSError:
                continue  # not created yet, or a file renamed while read

    thread = threading.Thread(target=watch, daemon=True, name=f"watch-{ref.repo_id}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _is_mlx(entry: Path) -> bool:
    """An entry that is not a GGUF import (an MLX snapshot or directory): valid as it is."""
    if (entry / IMPORT_INFO_FILE).is_file():
        return False
    try:
        validate_model_dir(entry)
    except ModelError:
        return False
    return True


def remove_entry(name: str) -> dict[str, Any]:
    """Delete the cache entry `name` with its digest record, origin and lock; returns its origin. Never the
    user's GGUF file nor the HF cache's files (a link's target stays)."""
    from shardline.models.store.manifest import record_path

    entry = cache_dir() / name
    origin = origin_of(entry)
    with import_lock(entry):
        if entry.is_symlink():
            entry.unlink()
        else:
            shutil.rmtree(entry)
        record_path(entry).unlink(missing_ok=True)
        origin_path(entry).unlink(missing_ok=True)
    (entry.parent / f".{name}.lock").unlink(missing_ok=True)
    return origin
