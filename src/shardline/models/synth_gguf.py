"""Synthetic GGUF files in a real model's shape: random weights that llama.cpp and shardline both read.

For speed benchmarks and CI only (the text random weights make means nothing; speed and equality do):
`shardline models synth --gguf --shape qwen2-1.5b` writes the model as an F16 GGUF with gguf-py's writer,
one tensor at a time (peak memory about one tensor), then llama.cpp's `llama-quantize` makes the requested
type from it (Q4_K_M by default), so that both engines read the very same file. F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 can also be written without llama.cpp (gguf-py quantizes them itself): the tests do so.

Weights have llama's init spread (uniform with std 0.02, the residual-writing projections shrunk by
sqrt(2 * layers) as models/synth.py does, norms 1): activations stay finite through any depth. The
vocabulary is byte-level BPE (`gpt2`, the 256 byte tokens, a few merges, ChatML specials, `[PADn]` filler
typed unused as llama.cpp's converter pads vocabularies), with a pre-tokenizer both llama.cpp and our
importer know, so that llama-bench, llama-perplexity and `shardline models pull FILE.gguf` all take it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

from shardline.models.synth import PURPOSE

# Written by gguf-py without llama.cpp: file type, and the type of every matrix.
DIRECT_TYPES = {
    "F32": (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
    "F16": (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    "BF16": (LlamaFileType.MOSTLY_BF16, GGMLQuantizationType.BF16),
    "Q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
    "Q4_0": (LlamaFileType.MOSTLY_Q4_0, GGMLQuantizationType.Q4_0),
    "Q4_1": (LlamaFileType.MOSTLY_Q4_1, GGMLQuantizationType.Q4_1),
    "Q5_0": (LlamaFileType.MOSTLY_Q5_0, GGMLQuantizationType.Q5_0),
    "Q5_1": (LlamaFileType.MOSTLY_Q5_1, GGMLQuantizationType.Q5_1),
}
DEFAULT_QUANT = "Q4_K_M"
QUANTIZERS = ("auto", "llama-quantize", "gguf-py")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few merges of English text, so that the vocabulary has merges as llama.cpp requires (and they are used).
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("i", "s"),
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHUNK_ELEMENTS = 1 << 24  # rows drawn (and quantized) this many values at a time: 64 MB of float32


@dataclass(frozen=True)
class GGUFShape:
    arch: str  # llama.cpp's architecture name: qwen2 or llama
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    qkv_bias: bool = False
    tied: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 4096
    pre: str = "qwen2"  # tokenizer.ggml.pre: one models/gguf_pretokenizers.py knows
    add_bos: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"architecture must be qwen2 or llama, got {self.arch!r}")
        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads) < 1:
            raise ValueError("layers, hidden, intermediate, heads and kv-heads must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(
                f"hidden {self.hidden} must split into {self.heads} heads (of an even size) "
                f"in {self.kv_heads} groups"
            )
        if self.vocab < len(vocabulary_base()):
            raise ValueError(f"vocab must be at least {len(vocabulary_base())} (the byte-level tokenizer's)")


SHAPES = {
    # Qwen2.5-1.5B (and its Coder): untied head, q/k/v biases.
    "qwen2-1.5b": GGUFShape(
        "qwen2", 28, 1536, 8960, 12, 2, 151936, qkv_bias=True, rope_theta=1e6, rms_eps=1e-6, context=32768
    ),
    # Llama 3 8B (cut with --layers).
    "llama-8b": GGUFShape(
        "llama", 32, 4096, 14336, 32, 8, 128256, rope_theta=5e5, context=8192, pre="llama-bpe", add_bos=True
    ),
    # A few MB, every dimension a multiple of 256: quick checks of the whole path (K-quants included).
    "qwen2-tiny": GGUFShape("qwen2", 2, 256, 512, 4, 2, 512, qkv_bias=True, rope_theta=1e6, rms_eps=1e-6),
}


class QuantizerMissingError(RuntimeError):
    """The type asked for needs llama.cpp's llama-quantize, which is not built here."""


def shape_of(name: str, **given: Any) -> GGUFShape:
    """SHAPES[name], each of `given` (not None) replacing one field; checked."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    shape = replace(SHAPES[name], **{k: v for k, v in given.items() if v is not None})
    shape.check()
    return shape


# ---- the tokenizer --------------------------------------------------------------------------------------


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order: the 256 byte-level tokens."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocabulary_base() -> list[tuple[str, int]]:
    """(token, type) of every token before the filler: bytes, merged tokens, specials."""
    tokens = [(t, TokenType.NORMAL) for t in _byte_tokens()]
    tokens += [(a + b, TokenType.NORMAL) for a, b in MERGES]
    return tokens + [(s, TokenType.CONTROL) for s in SPECIALS]


def vocabulary(size: int) -> tuple[list[str], list[int]]:
    """Tokens and types, padded to `size` with `[PADn]` tokens typed unused (as convert_hf_to_gguf pads)."""
    base = vocabulary_base()
    tokens = [t for t, _ in base] + [f"[PAD{i}]" for i in range(len(base), size)]
    types = [int(k) for _, k in base] + [int(TokenType.UNUSED)] * (size - len(base))
    return tokens, types


def _add_metadata(w: GGUFWriter, shape: GGUFShape, name: str, file_type: int) -> None:
    w.add_name(f"synthetic {name} (random weights)")
    w.add_description(f"shardline {PURPOSE}")
    w.add_string("shardline.synthetic", PURPOSE)
    w.add_string("shardline.synthetic.shape", name)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(file_type)
    w.add_quantization_version(2)
    tokens, types = vocabulary(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(shape.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(shape.add_bos)
    w.add_chat_template(CHAT_TEMPLATE)


# ---- the weights ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    name: str  # llama.cpp's tensor name
    shape: tuple[int, ...]  # numpy order: (out, in) for a matrix
    std: float  # 0: a norm, all ones


def plan(shape: GGUFShape) -> list[Planned]:
    """Every tensor, in the order llama.cpp's converter writes them."""
    std, out_std = 0.02, 0.02 / math.sqrt(2 * shape.layers)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    out = [Planned("token_embd.weight", (shape.vocab, h), std)]
    for n in range(shape.layers):
        p = f"blk.{n}."
        out += [
            Planned(p + "attn_norm.weight", (h,), 0.0),
            Planned(p + "attn_q.weight", (h, h), std),
            Planned(p + "attn_k.weight", (kv, h), std),
            Planned(p + "attn_v.weight", (kv, h), std),
        ]
        if shape.qkv_bias:
            out += [Planned(p + f"attn_{x}.bias", (r,), std) for x, r in (("q", h), ("k", kv), ("v", kv))]
        out += [
            Planned(p + "attn_output.weight", (h, h), out_std),
            Planned(p + "ffn_norm.weight", (h,), 0.0),
            Planned(p + "ffn_gate.weight", (i, h), std),
            Planned(p + "ffn_up.weight", (i, h), std),
            Planned(p + "ffn_down.weight", (h, i), out_std),
        ]
    out.append(Planned("output_norm.weight", (h,), 0.0))
    if not shape.tied:
        out.append(Planned("output.weight", (shape.vocab, h), std))
    return out


def parameter_count(shape: GGUFShape) -> int:
    return sum(math.prod(t.shape) for t in plan(shape))


_FLOATS = {GGMLQuantizationType.F32: np.dtype(np.float32), GGMLQuantizationType.F16: np.dtype(np.float16)}


def _stored(
    t: Planned, qtype: GGMLQuantizationType
) -> tuple[GGMLQuantizationType, np.dtype, tuple[int, ...]]:
    """(type, numpy dtype, numpy shape) of a planned tensor as written: vectors stay float32, as llama.cpp
    keeps them; matrices of other types than F32/F16 are uint8 rows of their blocks' bytes."""
    if len(t.shape) == 1:
        return GGMLQuantizationType.F32, _FLOATS[GGMLQuantizationType.F32], t.shape
    if qtype in _FLOATS:
        return qtype, _FLOATS[qtype], t.shape
    rows, cols = t.shape
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{t.name}: {cols} columns are not whole blocks of {block} ({qtype.name})")
    return qtype, np.dtype(np.uint8), (rows, cols // block * size)


def _nbytes(t: Planned, qtype: GGMLQuantizationType) -> int:
    _, dtype, shape = _stored(t, qtype)
    return math.prod(shape) * dtype.itemsize


def _generate(t: Planned, qtype: GGMLQuantizationType, seed: int, index: int) -> np.ndarray:
    """One tensor as stored, drawn and converted a chunk of rows at a time; deterministic in (seed, index)."""
    kind, dtype, stored_shape = _stored(t, qtype)
    if t.std == 0.0:
        return np.ones(t.shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    limit = np.float32(t.std * math.sqrt(3))  # uniform on [-limit, limit]: standard deviation std

    def draw(*dims: int) -> np.ndarray:
        return rng.random(dims, dtype=np.float32) * (2 * limit) - limit

    if len(t.shape) == 1:
        return draw(*t.shape)
    rows, cols = t.shape
    out = np.empty(stored_shape, dtype=dtype)
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        part = draw(min(step, rows - start), cols)
        out[start : start + len(part)] = quantize(part, kind).reshape(len(part), -1)
    return out


def write_gguf(
    path: Path,
    shape: GGUFShape,
    quant: str = "F16",
    name: str = "synthetic",
    seed: int = 0,
    progress: bool = False,
) -> Path:
    """The model as a GGUF at `path` with every matrix in `quant` (one of DIRECT_TYPES), written by gguf-py
    one tensor at a time (beside `path`, then renamed: never seen half written)."""
    shape.check()
    if quant not in DIRECT_TYPES:
        raise ValueError(f"gguf-py writes {', '.join(DIRECT_TYPES)}, not {quant}")
    file_type, qtype = DIRECT_TYPES[quant]
    tensors = plan(shape)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.synth-{os.getpid()}")
    writer = GGUFWriter(str(tmp), shape.arch)
    try:
        _add_metadata(writer, shape, name, int(file_type))
        for t in tensors:
            kind, dtype, stored_shape = _stored(t, qtype)
            raw = None if kind in _FLOATS else kind
            writer.add_tensor_info(t.name, stored_shape, dtype, _nbytes(t, qtype), raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(_nbytes(t, qtype) for t in tensors)
        written = 0
        show = progress and sys.stderr.isatty()
        for index, t in enumerate(tensors):
            data = _generate(t, qtype, seed, index)
            writer.write_tensor_data(data)
            written += data.nbytes
            del data
            if show:
                print(f"\rwriting {written / 1e9:6.2f} of {total / 1e9:.2f} GB", end="", file=sys.stderr)
        if show:
            print(file=sys.stderr)
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---- llama-quantize -------------------------------------------------------------------------------------


def llama_quantize(exe: Path, source: Path, target: Path, quant: str, threads: int | None = None) -> Path:
    """llama.cpp's llama-quantize (`exe`) of `source` into `target` as `quant` (any type name it takes)."""
    tmp = target.with_name(f".{target.name}.quantize-{os.getpid()}")
    cmd = [str(exe), str(source), str(tmp), quant, str(threads or os.cpu_count() or 1)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"llama-quantize {quant} failed ({done.returncode}): " + " | ".join(tail))
    os.replace(tmp, target)
    return target


def synth_gguf(
    path: Path,
    shape: GGUFShape,
    quant: str = DEFAULT_QUANT,
    *,
    quantize_exe: Path | None = None,
    name: str = "synthetic",
    seed: int = 0,
    keep_f16: bool = False,
    quantizer: str = "auto",
    progress: bool = False,
) -> Path:
    """Write the synthetic model as a `quant` GGUF at `path`.

    quantize_exe: llama.cpp's llama-quantize (bench/llama_cpp.py `binary`), None where it is not built.
    quantizer: "llama-quantize" (an F16 GGUF, then llama.cpp's tool: any type it takes), "gguf-py" (the
    DIRECT_TYPES only, no llama.cpp needed) or "auto" (llama-quantize where it is built, else gguf-py where
    it can). The F16 file (`path` with .f16.gguf) is removed afterwards unless `keep_f16`."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {quantizer!r}")
    quant = quant.upper()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    direct = quant in ("F32", "F16") or (
        quant in DIRECT_TYPES and (quantizer == "gguf-py" or (quantizer == "auto" and quantize_exe is None))
    )
    if direct:
        return write_gguf(path, shape, quant, name=name, seed=seed, progress=progress)
    if quantizer == "gguf-py":
        raise ValueError(f"gguf-py writes {', '.join(DIRECT_TYPES)}, not {quant}")
    if quantize_exe is None:
        raise QuantizerMissingError(
            f"{quant} needs llama.cpp's llama-quantize, which is not built (without it: "
            f"{', '.join(DIRECT_TYPES)})"
        )
    f16 = path.with_name(path.name.removesuffix(".gguf") + ".f16.gguf")
    write_gguf(f16, shape, "F16", name=name, seed=seed, progress=progress)
    if progress:  # minutes on a few cores, silent otherwise
        print(f"llama-quantize {f16.name} -> {quant}", file=sys.stderr, flush=True)
    try:
        llama_quantize(quantize_exe, f16, path, quant)
    finally:
        if not keep_f16:
            f16.unlink(missing_ok=True)
    return path
