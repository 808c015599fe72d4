"""Cheap checks that a model directory is loadable, run before handing it to mlx-lm.

mlx-lm's own failures (KeyError deep in a model class, a safetensors panic) are hard to
read; these checks turn the common cases into one-line CorruptModelError messages.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import math
import re
import struct
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from shardline.models.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from shardline.models.store.formats import SAFETENSORS_ITEMSIZE

# A model_type names a module file: anything else (dots, slashes) could reach outside mlx_lm.models.
_MODULE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")
# A safetensors JSON header beyond this is certainly garbage (real ones are a few MB at most).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def check_safetensors(path: Path) -> None:
    """Parse the header of a safetensors file and check its tensors fit in the file."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"header length {header_len} exceeds file size {size}")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data_len = size - 8 - header_len
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            if not 0 <= start <= end <= data_len:
                raise ValueError(f"tensor {name!r} lies outside the file (truncated?)")
            item = SAFETENSORS_ITEMSIZE.get(entry["dtype"])
            if item is not None and math.prod(entry["shape"]) * item != end - start:
                raise ValueError(
                    f"tensor {name!r} {entry['dtype']}{entry['shape']} is not {end - start} bytes"
                )
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{path}: not a valid safetensors file ({e})") from e


def mlx_lm_architecture(model_type: str, architectures: Sequence[str] = ()) -> str | None:
    """The mlx_lm.models module that loads `model_type` (with config.json's `architectures`), resolved as
    mlx-lm's loader does (its remapping tables, e.g. mistral -> llama), or None where mlx-lm has none.

    The module is found, never imported: some exit on a missing optional package. It must define a Model
    and a ModelArgs, so that mlx_lm.models' helpers (cache, rope_utils, ...) are no architectures."""
    import mlx_lm.utils

    by_architecture: dict[tuple[str, str], str] = getattr(mlx_lm.utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    resolved = next(
        (by_architecture[(model_type, a)] for a in architectures if (model_type, a) in by_architecture),
        mlx_lm.utils.MODEL_REMAPPING.get(model_type, model_type),
    )
    return resolved if _defines_a_model(resolved) else None


@lru_cache(maxsize=256)
def _defines_a_model(module: str) -> bool:
    if not _MODULE_NAME.fullmatch(module):
        return False
    try:
        spec = importlib.util.find_spec(f"mlx_lm.models.{module}")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return {"Model", "ModelArgs"} <= names


def mlx_lm_version() -> str:
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def validate_model_dir(path: str | Path) -> dict[str, Any]:
    """Return the parsed config.json of a loadable model directory, else raise a ModelError."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model directory not found: {path}")
    if not path.is_dir():
        raise CorruptModelError(f"{path}: not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CorruptModelError(f"{path}: config.json is missing")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptModelError(f"{path}: config.json is not valid JSON ({e})") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CorruptModelError(f"{path}: config.json has no model_type")
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    if mlx_lm_architecture(model_type, [a for a in architectures if isinstance(a, str)]) is None:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported: it is not an architecture of "
            f"mlx-lm {mlx_lm_version()}"
        )
    # mlx-lm loads exactly model*.safetensors, so other names would not count.
    weights = sorted(path.glob("model*.safetensors"))
    if not weights:
        raise CorruptModelError(f"{path}: no model*.safetensors weight file")
    for weight in weights:
        check_safetensors(weight)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise CorruptModelError(f"{path}: tokenizer.json is missing")
    return config
