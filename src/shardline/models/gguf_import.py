"""Import a GGUF file into a model directory mlx-lm can load (the architectures of models/gguf_archs.py).

Output: config.json, model.safetensors (HF tensor names), tokenizer.json, tokenizer_config.json,
generation_config.json and shardline_import.json (provenance, and the form each tensor took).

Weights (`weights=`):
- "quantized" (the default): matrices of the block types the CPU kernel reads (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
  Q6_K: `gguf_quant.BLOCK_TYPES`) keep their GGUF bytes as stored, each a uint8 (rows, row bytes) tensor,
  named in config.json's `gguf_quantization` ({module: type}); compute/gguf_linear.py loads them, and
  converts them to MLX affine once where that kernel does not run (a GPU). The weights then cost the GGUF's
  bytes. Every other quantized matrix (other types, 3-D expert stacks) becomes MLX affine, as "affine" does.
- "affine": quantized GGUF matrices become MLX affine quantization (`models/gguf_quant.py`: exact for
  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K, 8-bit requantization with its error measured for the rest), and
  config.json's `quantization` says so the way mlx-lm's loader reads it (1.0-1.35x the GGUF's bytes).
- "float32": every tensor dequantized to float32 (4-8x the GGUF's bytes).
Norms, biases and float tensors stay float32 in every form: activations (and so the KV cache) are float32,
since on CPU MLX ran float16 at half the speed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from tqdm import tqdm

from shardline.models.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from shardline.models.gguf_archs import FLOAT_ONLY, ArchSpec, arch_spec, hf_name, is_norm, layer_short_name
from shardline.models.gguf_config import build_config, check_architecture, meta_scalar
from shardline.models.gguf_quant import GROUP, Form, check_rows, float16_exact, form_for, to_affine
from shardline.models.gguf_split import SplitGGUF, split_parts
from shardline.models.gguf_tensors import (
    CONFIG_TENSORS,
    dequantize_tensor,
    float_tensor,
    hf_shape,
    join_kv_b,
    unpermute_llama_qk,
)
from shardline.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from shardline.models.safetensors_stream import write_safetensors
from shardline.models.store.formats import IMPORT_INFO_FILE

log = logging.getLogger("shardline.models")

# Bump when the output layout or conversion changes, so cached imports are redone.
# 2: quantized GGUF matrices stay quantized (MLX affine) by default.
# (More architectures did not change what llama, qwen2 and qwen3 import to.)
# 3: the kernel's block types keep their GGUF bytes ("quantized"; the affine form is "affine").
IMPORT_FORMAT_VERSION = 3
TEMP_PREFIX = ".importing-"
WEIGHTS = ("quantized", "affine", "float32")  # what import_gguf(weights=...) accepts
DEFAULT_WEIGHTS = "quantized"
# Its dequantized rows are the residual stream's input, in its scales' dtype: float32 keeps activations
# float32 (float16 scales would round every embedding value to float16 first).
_EMBEDDING = "model.embed_tokens.weight"


def open_gguf(path: Path) -> GGUFReader | SplitGGUF:
    """Open a GGUF file (any part of a split one: all its parts, as one reader), mapping I/O and format
    failures to model errors."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    try:
        parts = split_parts(path)
        return GGUFReader(path) if len(parts) == 1 else SplitGGUF(parts)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CorruptModelError(f"{path}: not a readable GGUF file ({e})") from e


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (the `GGUF.*` header fields excluded)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _mla_plan(tensors: dict[str, ReaderTensor], mla: str) -> tuple[set[str], list[ReaderTensor]]:
    """DeepSeek's latent attention: the GGUF tensors to leave out, and kv_b tensors to add.

    Newer converters store kv_b_proj as attn_k_b / attn_v_b (older files: attn_kv_b; some both). A model
    that reads kv_b_proj ("joined") gets it, rebuilt in float32 from the halves where the file lacks it; one
    that reads the halves ("halves") gets them, and kv_b_proj (which mlx-lm splits) only where they are
    missing."""
    skip: set[str] = set()
    joined: list[ReaderTensor] = []
    for name, tensor in tensors.items():
        short = layer_short_name(name)
        if short == "attn_kv_b" and mla == "halves" and name.replace(".attn_kv_b.", ".attn_k_b.") in tensors:
            skip.add(name)
        if short in ("attn_k_b", "attn_v_b") and mla == "joined":
            skip.add(name)
            kv_b = name.replace(f".{short}.", ".attn_kv_b.")
            if short == "attn_k_b" and kv_b not in tensors:
                v_b = tensors[name.replace(".attn_k_b.", ".attn_v_b.")]
                whole = join_kv_b(dequantize_tensor(tensor), dequantize_tensor(v_b))
                joined.append(float_tensor(kv_b, whole))
    return skip, joined


def _tensor_plan(
    reader: GGUFReader | SplitGGUF, spec: ArchSpec
) -> tuple[list[tuple[str, ReaderTensor]], dict[str, np.ndarray]]:
    """(HF name, GGUF tensor) pairs to write, plus the rope tensors that go to config."""
    plan: list[tuple[str, ReaderTensor]] = []
    extras: dict[str, np.ndarray] = {}
    tensors = {t.name: t for t in reader.tensors}
    skip, joined = _mla_plan(tensors, spec.mla) if spec.mla else (set(), [])
    for tensor in [*reader.tensors, *joined]:
        if tensor.name in CONFIG_TENSORS:
            extras[tensor.name] = dequantize_tensor(tensor)
        elif tensor.name not in skip:
            plan.append((hf_name(tensor.name, spec), tensor))
    return plan, extras


def _hf_layout(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape mlx-lm wants where llama.cpp stores fewer dimensions: qwen2moe's shared-expert gate is
    a [1, hidden] linear layer, kept as a [hidden] vector."""
    if name.endswith(".shared_expert_gate.weight") and len(shape) == 1:
        return (1, *shape)
    return shape


@dataclass(frozen=True)
class _Tensor:
    name: str  # HF name
    tensor: ReaderTensor
    shape: tuple[int, ...]  # HF shape
    form: Form

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.tensor.tensor_type)

    def outputs(self) -> dict[str, tuple[int, ...]]:
        """The tensors it is stored as: itself, its blocks' bytes by row, or a quantized matrix's packed
        weight, scales and biases."""
        if self.form.blocks:
            elements, size = GGML_QUANT_SIZES[self.qtype]
            return {self.name: (*self.shape[:-1], self.shape[-1] // elements * size)}
        if not self.form.quantized:
            return {self.name: self.shape}
        base = self.name.removesuffix(".weight")
        *rows, cols = self.shape  # a 3-D expert stack keeps its leading [experts, out]
        groups = (*rows, cols // GROUP)
        return {
            f"{base}.weight": (*rows, cols * self.form.bits // 32),
            f"{base}.scales": groups,
            f"{base}.biases": groups,
        }


@dataclass
class FormStats:
    """What the tensors of one GGUF type became in one form, for the import's summary."""

    gguf_type: str
    form: str
    exact: bool
    tensors: int = 0
    bytes_in: int = 0  # in the GGUF
    bytes_out: int = 0  # in model.safetensors
    scales: set[str] = field(default_factory=set)  # dtypes the scales and biases were stored as
    max_abs_error: float = 0.0  # against gguf's own float32 dequantization
    sq_error: float = 0.0
    sq_weight: float = 0.0

    @property
    def rel_rms_error(self) -> float:
        return float(np.sqrt(self.sq_error / self.sq_weight)) if self.sq_weight else 0.0

    def as_json(self) -> dict[str, Any]:
        out = {
            "gguf_type": self.gguf_type,
            "form": self.form,
            "exact": self.exact,
            "tensors": self.tensors,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }
        if self.scales:
            out["scales"] = ", ".join(sorted(self.scales))
        if not self.exact:
            out["max_abs_error"] = self.max_abs_error
            out["rel_rms_error"] = self.rel_rms_error
        return out


def _qk_heads(arch: str, name: str, meta: dict[str, Any]) -> int | None:
    """Head count to un-permute a llama Q/K tensor's rows by; None for every other tensor."""
    # Only the llama converter (and those built on it) permutes Q/K rows; the others are stored as in HF.
    if not arch_spec(arch).permute_qk or not (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
        return None
    n_head = int(meta_scalar(meta, f"{arch}.attention.head_count"))
    return n_head if ".q_proj." in name else int(meta_scalar(meta, f"{arch}.attention.head_count_kv", n_head))


def _converted(
    plan: list[_Tensor],
    meta: dict[str, Any],
    stats: dict[tuple[str, str], FormStats],
    *,
    progress: bool,
    desc: str,
) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors to store under HF names, one at a time (peak memory: about one tensor's)."""
    arch = meta["general.architecture"]
    plus_one = arch_spec(arch).norm_plus_one
    for t in tqdm(plan, desc=desc, unit="tensor", disable=not progress):
        heads = _qk_heads(arch, t.name, meta)
        key = (t.qtype.name, t.form.label)
        st = stats.setdefault(key, FormStats(t.qtype.name, t.form.label, t.form.exact))
        st.tensors += 1
        st.bytes_in += int(t.tensor.n_bytes)
        if t.form.blocks:  # the bytes as stored: whole rows move where Q/K rows are un-permuted
            (shape,) = t.outputs().values()
            raw = np.ascontiguousarray(t.tensor.data, dtype=np.uint8).reshape(shape)
            if heads is not None:
                raw = np.ascontiguousarray(unpermute_llama_qk(raw, heads))
            st.bytes_out += raw.nbytes
            yield t.name, raw
            continue
        if not t.form.quantized:
            weight = dequantize_tensor(t.tensor).reshape(t.shape)
            if heads is not None:
                weight = unpermute_llama_qk(weight, heads)
            if plus_one and is_norm(t.tensor.name):
                weight = weight - np.float32(1.0)  # Gemma's converter stored 1 + w; mlx-lm adds the one
            st.bytes_out += weight.nbytes
            yield t.name, weight
            continue
        try:
            affine = to_affine(t.tensor.data, t.qtype, t.shape)  # type: ignore[arg-type]
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"GGUF tensor {t.tensor.name!r} uses unsupported type {t.qtype.name}"
            ) from e
        except ValueError as e:
            raise CorruptModelError(f"GGUF tensor {t.tensor.name!r}: {e}") from e
        if t.form.exact and (err := check_rows(t.tensor.data, t.qtype, affine)) != 0.0:
            raise RuntimeError(f"{t.tensor.name}: {t.qtype.name} as {t.form.label} is off by {err} (a bug)")
        if heads is not None:
            # Whole rows move, so permuting the packed rows with their scales and biases is exact.
            affine = affine.rows(lambda rows, n=heads: unpermute_llama_qk(rows, n))
        st.max_abs_error = max(st.max_abs_error, affine.max_abs_error)
        st.sq_error += affine.sq_error
        st.sq_weight += affine.sq_weight
        half = t.name != _EMBEDDING and float16_exact(affine.scales, affine.biases)
        scale_dtype = np.float16 if half else np.float32
        st.scales.add(np.dtype(scale_dtype).name)
        base = t.name.removesuffix(".weight")
        for suffix, array in (
            ("weight", affine.weight),
            ("scales", affine.scales.astype(scale_dtype)),
            ("biases", affine.biases.astype(scale_dtype)),
        ):
            st.bytes_out += array.nbytes
            yield f"{base}.{suffix}", array.reshape(*t.shape[:-1], -1)


def quantization_config(plan: list[_Tensor]) -> dict[str, Any] | None:
    """config.json's `quantization` as mlx-lm's loader reads it: defaults, plus an entry per module that
    differs (another bit width, or a matrix left float32: False). None when nothing is quantized."""
    bits = Counter(t.form.bits for t in plan if t.form.quantized)
    if not bits:
        return None
    default = bits.most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP, "bits": default, "mode": "affine"}
    for t in plan:
        if len(t.shape) not in (2, 3) or not t.name.endswith(".weight"):
            continue
        module = t.name.removesuffix(".weight")
        if not t.form.quantized:
            config[module] = False  # float32, or GGUF blocks (gguf_blocks_config)
        elif t.form.bits != default:
            config[module] = {"group_size": GROUP, "bits": t.form.bits, "mode": "affine"}
    return config


def gguf_blocks_config(plan: list[_Tensor]) -> dict[str, str]:
    """config.json's `gguf_quantization`: the modules whose weight is GGUF blocks, and their type."""
    return {t.name.removesuffix(".weight"): t.form.blocks for t in plan if t.form.blocks}


def weight_format(stats: list[FormStats]) -> str:
    """One line for people: the quantized forms, the most bytes first, e.g. "q4_1→affine4/g32, q8_0→..."
    (≈ instead of → where the form is not exact); "float32" when nothing stayed quantized."""
    forms = sorted((s for s in stats if s.form != "float32"), key=lambda s: -s.bytes_out)
    parts = [
        s.form if s.form.endswith(" blocks") else f"{s.gguf_type.lower()}{'→' if s.exact else '≈'}{s.form}"
        for s in forms
    ]
    return ", ".join(dict.fromkeys(parts)) or "float32"


def format_summary(stats: list[FormStats], seconds: float, gguf_bytes: int, out_bytes: int) -> str:
    """The import's table: per GGUF type and form, tensors, bytes before and after, error where inexact."""
    lines = [
        f"{'GGUF type':<10} {'form':<12} {'tensors':>7} {'GGUF MB':>9} {'stored MB':>9}  {'scales':<16} error"
    ]
    for s in stats:
        error = "exact" if s.exact else f"max abs {s.max_abs_error:.3g}, rel RMS {s.rel_rms_error:.3g}"
        lines.append(
            f"{s.gguf_type:<10} {s.form:<12} {s.tensors:>7} {s.bytes_in / 1e6:>9.2f} "
            f"{s.bytes_out / 1e6:>9.2f}  {', '.join(sorted(s.scales)) or '-':<16} {error}"
        )
    ratio = out_bytes / gguf_bytes if gguf_bytes else 0.0
    lines.append(
        f"model.safetensors {out_bytes / 1e6:.2f} MB = {ratio:.3f}x the GGUF's {gguf_bytes / 1e6:.2f} MB, "
        f"in {seconds:.1f}s"
    )
    return "\n".join(lines)


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


def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    overwrite: bool = False,
    weights: str = DEFAULT_WEIGHTS,
) -> Path:
    """Convert `gguf_path` into the mlx-lm model directory `out_dir` (written atomically).

    weights: "quantized" (GGUF blocks as stored where the kernel reads them, else MLX affine), "affine"
    or "float32" (see the module docstring).
    With `progress`, a progress bar and the summary of what each tensor became go to stderr."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    t0 = time.monotonic()
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    # Check architecture and tokenizer before the slow tensor pass, so bad inputs fail fast.
    arch = check_architecture(meta.get("general.architecture"))
    tokenizer = build_tokenizer(meta)

    pairs, extras = _tensor_plan(reader, arch_spec(arch, meta))
    plan = []
    for name, tensor in pairs:
        shape = _hf_layout(name, hf_shape(tensor))
        qtype = GGMLQuantizationType(tensor.tensor_type)
        keep = weights != "float32" and layer_short_name(tensor.name) not in FLOAT_ONLY
        form = form_for(qtype, shape, blocks=weights == "quantized") if keep else Form()
        plan.append(_Tensor(name, tensor, shape, form))
    shapes = {t.name: t.shape for t in plan}
    for needed in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"):
        if needed not in shapes:
            raise CorruptModelError(f"{gguf_path}: GGUF lacks the tensor for {needed}")
    config = build_config(meta, shapes=shapes, extras=extras)
    if (quantization := quantization_config(plan)) is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization  # mlx-lm writes both; HF tools read the second
    if blocks := gguf_blocks_config(plan):
        config["gguf_quantization"] = blocks
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    outputs = {name: shape for t in plan for name, shape in t.outputs().items()}

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        stats: dict[tuple[str, str], FormStats] = {}
        fmt = "mlx" if quantization or blocks else "pt"  # as mlx-lm and torch tag their files
        tensors = _converted(plan, meta, stats, progress=progress, desc=f"Importing {gguf_path.name}")
        write_safetensors(tmp / "model.safetensors", outputs, tensors, metadata={"format": fmt})
        out_bytes = (tmp / "model.safetensors").stat().st_size
        seconds = time.monotonic() - t0
        table = list(stats.values())
        info = {
            "format_version": IMPORT_FORMAT_VERSION,
            "source": gguf_path.name,
            "source_size": gguf_path.stat().st_size,
            "architecture": arch,
            "name": meta.get("general.name"),
            "weights": weights,
            "weight_format": weight_format(table),
            "weights_bytes": out_bytes,
            "import_seconds": round(seconds, 2),
            "tensors": [s.as_json() for s in table],
        }
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / IMPORT_INFO_FILE, info)
    gguf_bytes = reader.nbytes if isinstance(reader, SplitGGUF) else gguf_path.stat().st_size
    summary = format_summary(table, seconds, gguf_bytes, out_bytes)
    if progress:
        print(summary, file=sys.stderr)
    log.info("imported %s as %s:\n%s", gguf_path.name, weights, summary)
    return out_dir
