"""Synthetic models: random weights in a llama shape of any size, in the directory layout mlx-lm loads.

For speed and memory benchmarks only (placement, loading, peak memory, tokens/s): the weights are random, so
the text they produce means nothing. Config and provenance say so (`shardline_synthetic`).

Quantized models use MLX's affine layout as mlx-lm writes and loads it: every projection and the embedding
(and an untied head) as a packed uint32 `weight` with `scales` and `biases` per group, and config.json's
`quantization: {group_size, bits}`. Tensors are generated, quantized and written one at a time, so peak
memory stays about one tensor whatever the model's size. The tokenizer is byte-level (every byte a token,
three ChatML specials, unused filler up to the vocabulary size): any text encodes within any vocabulary.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from shardline.models.store.formats import SAFETENSORS_ITEMSIZE

SYNTH_INFO_FILE = "shardline_synthetic.json"
SYNTH_FORMAT_VERSION = 1
PURPOSE = "synthetic random weights: for speed and memory benchmarks only, never for text quality"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DTYPES = {
    "float32": (mx.float32, "F32", 4),
    "float16": (mx.float16, "F16", 2),
    "bfloat16": (mx.bfloat16, "BF16", 2),
}
MAX_FILE_BYTES = 2 << 30  # weights files of at most ~2 GiB each, as mlx-lm shards its own (it globs them all)
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SynthSpec:
    layers: int = 28
    hidden: int = 1536
    intermediate: int = 4096
    heads: int = 12
    kv_heads: int = 4
    vocab: int = 32000
    bits: int = 4  # 0: not quantized
    group_size: int = 32
    dtype: str = "float16"  # of everything not packed: scales, biases, norms (and weights when bits is 0)
    context: int = 4096
    tied: bool = False
    seed: int = 0
    rope_theta: float = 10000.0

    def check(self) -> None:
        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads) < 1:
            raise ValueError("layers, hidden, intermediate, heads and kv-heads must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden {self.hidden} must split into {self.heads} heads of {self.kv_heads} groups"
            )
        if self.vocab < len(SPECIALS) + 256:
            raise ValueError(f"vocab must be at least {len(SPECIALS) + 256} (the byte-level tokenizer's)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.bits:
            if self.bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"bits must be 0 (no quantization) or 2, 3, 4, 5, 6, 8; got {self.bits}")
            if self.group_size not in (32, 64, 128):
                raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")
            for dim in (self.hidden, self.intermediate):
                if dim % self.group_size:
                    raise ValueError(f"dimension {dim} is not a multiple of the group size {self.group_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # (out, in) for matrices, as mlx-lm stores them
    std: float  # 0: a norm weight, all ones
    quantized: bool


def plan(spec: SynthSpec) -> list[PlannedTensor]:
    """Every tensor of the model, in file order (layer by layer), with its init."""
    h, i, kv = spec.hidden, spec.intermediate, spec.kv_heads * spec.head_dim
    q = bool(spec.bits)
    # 0.02 as llama's initializer_range; the residual-writing projections shrunk by sqrt(2 * layers) (GPT-2)
    # so the residual stream stays near unit scale through any depth: activations finite even in float16.
    std, out_std = 0.02, 0.02 / math.sqrt(2 * spec.layers)
    out = [PlannedTensor("model.embed_tokens.weight", (spec.vocab, h), std, q)]
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        out += [
            PlannedTensor(p + "input_layernorm.weight", (h,), 0.0, False),
            PlannedTensor(p + "self_attn.q_proj.weight", (h, h), std, q),
            PlannedTensor(p + "self_attn.k_proj.weight", (kv, h), std, q),
            PlannedTensor(p + "self_attn.v_proj.weight", (kv, h), std, q),
            PlannedTensor(p + "self_attn.o_proj.weight", (h, h), out_std, q),
            PlannedTensor(p + "post_attention_layernorm.weight", (h,), 0.0, False),
            PlannedTensor(p + "mlp.gate_proj.weight", (i, h), std, q),
            PlannedTensor(p + "mlp.up_proj.weight", (i, h), std, q),
            PlannedTensor(p + "mlp.down_proj.weight", (h, i), out_std, q),
        ]
    out.append(PlannedTensor("model.norm.weight", (h,), 0.0, False))
    if not spec.tied:
        out.append(PlannedTensor("lm_head.weight", (spec.vocab, h), std, q))
    return out


def stored(spec: SynthSpec, t: PlannedTensor) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of what one planned tensor is stored as."""
    dtype = DTYPES[spec.dtype][1]
    if not t.quantized:
        return [(t.name, dtype, t.shape)]
    rows, cols = t.shape
    base = t.name.removesuffix(".weight")
    groups = (rows, cols // spec.group_size)
    return [
        (t.name, "U32", (rows, cols * spec.bits // 32)),
        (base + ".scales", dtype, groups),
        (base + ".biases", dtype, groups),
    ]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]


def footprint(spec: SynthSpec, name: str = "synth") -> Any:
    """The ModelFootprint placement would read from the written model, from the spec alone (placement and
    its tests reason about models of GBs without writing them)."""
    from shardline.models.footprint import LAYER_OVERHEAD_BYTES, ModelFootprint

    layers, embed, head = [0] * spec.layers, 0, 0
    for t in plan(spec):
        n = sum(_nbytes(dtype, shape) for _, dtype, shape in stored(spec, t))
        if t.name.startswith("model.layers."):
            layers[int(t.name.split(".")[2])] += n
        elif t.name.startswith("model.embed_tokens."):
            embed += n
        else:
            head += n
    return ModelFootprint(
        name=name,
        layers=spec.layers,
        layer_bytes=layers,
        embed_bytes=embed,
        head_bytes=head,
        tied=spec.tied,
        # The cache takes the activations' dtype: a quantized model's scales' (float32 scales: 4 bytes).
        kv_bytes_per_token_per_layer=2 * spec.kv_heads * spec.head_dim * DTYPES[spec.dtype][2],
        context_length=spec.context,
        hidden_size=spec.hidden,
        vocab_size=spec.vocab,
        weight_format=f"mlx {spec.bits}-bit g{spec.group_size}" if spec.bits else spec.dtype,
        layer_overhead_bytes=LAYER_OVERHEAD_BYTES,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate,
        quant_group=spec.group_size if spec.bits else 0,
        tensor_split="",  # llama layers
        model_type="llama",
    )


def config(spec: SynthSpec) -> dict:
    out: dict = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": spec.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": spec.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "shardline_synthetic": {"purpose": PURPOSE, **asdict(spec)},
    }
    if spec.bits:
        quant = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
        # Both keys, as mlx-lm's own convert writes them.
        out["quantization"] = quant
        out["quantization_config"] = dict(quant)
    return out


def _generate(spec: SynthSpec, index: int, t: PlannedTensor) -> list[mx.array]:
    """One tensor's stored arrays, in `stored` order; deterministic in (seed, index)."""
    dtype = DTYPES[spec.dtype][0]
    if t.std == 0.0:
        return [mx.ones(t.shape, dtype=dtype)]
    key = mx.random.key(spec.seed * 1_000_003 + index)
    w = mx.random.normal(t.shape, key=key) * t.std
    if not t.quantized:
        return [w.astype(dtype)]
    packed, scales, biases = mx.quantize(w.astype(dtype), group_size=spec.group_size, bits=spec.bits)
    return [packed, scales, biases]


def _raw(a: mx.array) -> memoryview:
    if a.dtype == mx.bfloat16:  # no buffer format for bfloat16: write its bits
        a = a.view(mx.uint16)
    mx.eval(a)
    return memoryview(a)


def _files(spec: SynthSpec, tensors: list[PlannedTensor]) -> list[list[int]]:
    """Planned tensor indices per weights file: in order, a new file once one passes MAX_FILE_BYTES."""
    files: list[list[int]] = [[]]
    size = 0
    for k, t in enumerate(tensors):
        n = sum(_nbytes(d, s) for _, d, s in stored(spec, t))
        if files[-1] and size + n > MAX_FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append(k)
        size += n
    return files


def _write_file(
    path: Path, spec: SynthSpec, tensors: list[PlannedTensor], indices: list[int], done: Callable[[int], None]
) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "mlx", "shardline": PURPOSE}}
    offset = 0
    for k in indices:
        for name, dtype, shape in stored(spec, tensors[k]):
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in indices:
            arrays = _generate(spec, k, tensors[k])
            for a, (name, dtype, shape) in zip(arrays, stored(spec, tensors[k]), strict=True):
                if tuple(a.shape) != shape or a.nbytes != _nbytes(dtype, shape):
                    raise AssertionError(f"{name}: made {a.shape} {a.dtype}, planned {shape} {dtype}")
                f.write(_raw(a))
            done(sum(a.nbytes for a in arrays))
            del arrays


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:  # filler: no merge ever makes them, so ids stay below 259 in practice
        vocab[f"<|unused_{len(vocab)}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


def _write_tokenizer(path: Path, spec: SynthSpec) -> None:
    (path / "tokenizer.json").write_text(_tokenizer_json(spec.vocab))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[1],
        "eos_token": SPECIALS[2],
        "unk_token": SPECIALS[0],
        "pad_token": SPECIALS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.context,
        "chat_template": _CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def write_synth_model(path: Path, spec: SynthSpec, progress: bool = False, overwrite: bool = False) -> Path:
    """Write the model directory at `path` (built beside it, then renamed: never seen half written)."""
    spec.check()
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (overwrite to replace it)")
    tensors = plan(spec)
    files = _files(spec, tensors)
    total = sum(_nbytes(d, s) for t in tensors for _, d, s in stored(spec, t))
    tmp = path.with_name(f".{path.name}.synth-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written, started = [0], time.monotonic()

    progress = progress and sys.stderr.isatty()  # a log file gets the summary alone

    def done(n: int) -> None:
        written[0] += n
        if progress:
            print(f"\rwriting {written[0] / 1e9:6.2f} of {total / 1e9:.2f} GB", end="", file=sys.stderr)

    try:
        for j, indices in enumerate(files):
            one = len(files) == 1
            name = "model.safetensors" if one else f"model-{j + 1:05d}-of-{len(files):05d}.safetensors"
            _write_file(tmp / name, spec, tensors, indices, done)
        if progress:
            print(file=sys.stderr)
        (tmp / "config.json").write_text(json.dumps(config(spec), indent=1))
        _write_tokenizer(tmp, spec)
        info = {
            "format_version": SYNTH_FORMAT_VERSION,
            "synthetic": True,
            "purpose": PURPOSE,
            "spec": asdict(spec),
            "parameters": parameter_count(spec),
            "stored_bytes": total,
            "float32_bytes": 4 * parameter_count(spec),
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / SYNTH_INFO_FILE).write_text(json.dumps(info, indent=1))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def parameter_count(spec: SynthSpec) -> int:
    return sum(math.prod(t.shape) for t in plan(spec))


def _headers(model_dir: Path) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    from shardline.models.store.files import read_header

    for path in sorted(Path(model_dir).glob("model*.safetensors")):
        _, header = read_header(path)
        header.pop("__metadata__", None)
        for name, entry in header.items():
            yield name, entry["dtype"], tuple(entry["shape"])


def weight_sizes(model_dir: Path) -> dict[str, int]:
    """A model directory's weights: `stored_bytes` (its files' tensors as they are), `parameters` (packed
    quantized weights counted as the values they hold) and `float32_bytes` (the same model in float32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    bits = int((cfg.get("quantization") or {}).get("bits") or 0)
    stored_bytes = params = 0
    entries = list(_headers(model_dir))
    names = {name for name, _, _ in entries}
    for name, dtype, shape in entries:
        stored_bytes += math.prod(shape) * SAFETENSORS_ITEMSIZE.get(dtype, 4)
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and base.rsplit(".", 1)[0] + ".weight" in names:
            continue  # a quantized weight's group parameters: not parameters of the model
        if bits and dtype == "U32" and f"{base}.scales" in names:
            params += math.prod(shape) * 32 // bits
        else:
            params += math.prod(shape)
    return {"stored_bytes": stored_bytes, "parameters": params, "float32_bytes": 4 * params}


def is_synthetic(model_dir: Path) -> bool:
    return (Path(model_dir) / SYNTH_INFO_FILE).is_file()
