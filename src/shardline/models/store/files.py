"""The on-disk layout of a model directory: which files it has, their safetensors headers, their hashes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from shardline.models.store.errors import WeightsError

SHARD_MANIFEST = "shardline_shard.json"  # in a directory that holds one stage's tensors (read by load_shard)
WEIGHTS_FILE = "model.safetensors"  # the single weights file of a fetched stage
MAX_SMALL_FILE_BYTES = 256 << 20  # a "small" file (tokenizer, config) larger than this is not a model file
# Model and small-file names: one path component, not hidden; keeps every path inside its root.
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
HASH_BLOCK = 8 << 20


def stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def read_header(path: Path) -> tuple[int, dict]:
    """(data start, header) of a safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(path.stat().st_size - 8, 100 << 20):
            raise WeightsError(f"{path}: safetensors header length {n} is impossible")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path}: safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is not an object")
    return 8 + n, header


def hash_range(fd: int, offset: int, size: int) -> str:
    h = hashlib.sha256()
    done = 0
    while done < size:
        block = os.pread(fd, min(HASH_BLOCK, size - done), offset + done)
        if not block:
            break  # a truncated file: the hash cannot match
        h.update(block)
        done += len(block)
    return h.hexdigest()


def hash_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model*.safetensors"))  # exactly what mlx-lm loads


def small_files(model_dir: Path) -> list[Path]:
    """Top-level files other than weights: config, tokenizer, generation settings."""
    out = []
    for p in sorted(model_dir.iterdir()):
        name = p.name
        if not p.is_file() or not NAME.match(name) or name == SHARD_MANIFEST:
            continue
        if name.endswith((".safetensors", ".safetensors.index.json")):
            continue  # weights travel as tensors; an index would name files a stage does not have
        if p.stat().st_size <= MAX_SMALL_FILE_BYTES:
            out.append(p)
    return out


def read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{model_dir}: config.json is missing or not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise WeightsError(f"{model_dir}: config.json is not an object")
    return config


def current_stamps(model_dir: Path, names: Iterable[str]) -> dict[str, tuple[int, int]] | None:
    try:
        return {n: stamp(model_dir / n) for n in names}
    except OSError:
        return None


def check_name(what: str, name: str) -> None:
    if not NAME.match(name):
        raise ValueError(f"bad {what} name {name!r}: one path component of [A-Za-z0-9._+-], not hidden")
