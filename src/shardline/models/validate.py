"""Cheap checks that a model directory is loadable, run before handing it to mlx-lm.

mlx-lm's own failures (KeyError deep in a model class, a safetensors panic) are hard to
read; these checks turn the common cases into one-line CorruptModelError messages.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from shardline.models.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from shardline.models.gguf_config import SUPPORTED_ARCHITECTURES
from shardline.models.store.formats import SAFETENSORS_ITEMSIZE

SUPPORTED_MODEL_TYPES = SUPPORTED_ARCHITECTURES
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
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported (supported: {supported})"
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
