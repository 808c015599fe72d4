"""Import a GGUF file (llama, qwen2, qwen3) into a model directory mlx-lm can load.

Output: config.json, model.safetensors (float32, HF tensor names), tokenizer.json,
tokenizer_config.json, generation_config.json and shardline_import.json (provenance).
Weights are stored dequantized as float32: on CPU, MLX ran float16 at half the speed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from tqdm import tqdm

from shardline.models.errors import CorruptModelError, ModelNotFoundError
from shardline.models.gguf_config import build_config, check_architecture, meta_scalar
from shardline.models.gguf_tensors import ROPE_FREQS, dequantize_tensor, hf_name, hf_shape, unpermute_llama_qk
from shardline.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from shardline.models.safetensors_stream import write_f32_safetensors

IMPORT_INFO_FILE = "shardline_import.json"
# Bump when the output layout or conversion changes, so cached imports are redone.
IMPORT_FORMAT_VERSION = 1
TEMP_PREFIX = ".importing-"


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file, mapping I/O and format failures to model errors."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CorruptModelError(f"{path}: not a readable GGUF file ({e})") from e


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (the `GGUF.*` header fields excluded)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensor_plan(reader: GGUFReader) -> tuple[list[tuple[str, ReaderTensor]], np.ndarray | None]:
    """(HF name, GGUF tensor) pairs to write, plus Llama 3's rope factors, which go to config."""
    plan: list[tuple[str, ReaderTensor]] = []
    rope_freqs: np.ndarray | None = None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            rope_freqs = dequantize_tensor(tensor)
        else:
            plan.append((hf_name(tensor.name), tensor))
    return plan, rope_freqs


def _converted(
    plan: list[tuple[str, ReaderTensor]], meta: dict[str, Any], *, progress: bool, desc: str
) -> Iterator[tuple[str, np.ndarray]]:
    """Dequantized float32 weights under HF names, one at a time (peak memory: one tensor)."""
    arch = meta["general.architecture"]
    n_head = int(meta_scalar(meta, f"{arch}.attention.head_count"))
    n_head_kv = int(meta_scalar(meta, f"{arch}.attention.head_count_kv", n_head))
    for name, tensor in tqdm(plan, desc=desc, unit="tensor", disable=not progress):
        weight = dequantize_tensor(tensor)
        # Only the llama converter permutes Q/K rows; qwen2/qwen3 are stored as in HF.
        if arch == "llama" and ".self_attn.q_proj." in name:
            weight = unpermute_llama_qk(weight, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            weight = unpermute_llama_qk(weight, n_head_kv)
        yield name, weight


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finish_tree(root: Path) -> None:
    """Flush file contents before the rename publishes them, so a crash can't leave empty files.

    Also give the usual cache permissions: mkdtemp (and safetensors) create owner-only entries.
    """
    for path in root.iterdir():
        path.chmod(0o644)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    root.chmod(0o755)


@contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir next to `final`; on success it replaces `final` by rename, else it is removed.

    The temp dir is hidden (dot-prefixed) and sits in the same parent, so the rename is
    atomic and an interrupted import never leaves a directory that looks like a model.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TEMP_PREFIX}", dir=final.parent))
    try:
        yield tmp
        _finish_tree(tmp)
        old: Path | None = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old)  # replaces the empty placeholder dir
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None:
                os.rename(old, final)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True, overwrite: bool = False) -> Path:
    """Convert `gguf_path` into the mlx-lm model directory `out_dir` (written atomically)."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    # Check architecture and tokenizer before the slow tensor pass, so bad inputs fail fast.
    arch = check_architecture(meta.get("general.architecture"))
    tokenizer = build_tokenizer(meta)

    plan, rope_freqs = _tensor_plan(reader)
    shapes = {name: hf_shape(tensor) for name, tensor in plan}
    for needed in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        if needed not in shapes:
            raise CorruptModelError(f"{gguf_path}: GGUF lacks the tensor for {needed}")
    config = build_config(
        meta,
        vocab_size=shapes["model.embed_tokens.weight"][0],
        q_proj_rows=shapes["model.layers.0.self_attn.q_proj.weight"][0],
        tied="lm_head.weight" not in shapes,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in shapes,
        rope_freqs=rope_freqs,
    )
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    info = {
        "format_version": IMPORT_FORMAT_VERSION,
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "architecture": arch,
        "name": meta.get("general.name"),
    }

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        weights = _converted(plan, meta, progress=progress, desc=f"Importing {gguf_path.name}")
        write_f32_safetensors(tmp / "model.safetensors", shapes, weights, metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / IMPORT_INFO_FILE, info)
    return out_dir
