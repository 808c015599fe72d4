"""Synthetic models: random weights in a llama shape of any size (or a mixture of experts: qwen3_moe and
deepseek_v3, models/synth_moe.py), in the directory layout mlx-lm loads.

For speed and memory benchmarks only (placement, loading, peak memory, tokens/s): the weights are random, so
the text they produce means nothing. Config and provenance say so (`shardline_synthetic`).

Quantized models use MLX's affine layout as mlx-lm writes and loads it: every projection and the embedding
(and an untied head) as a packed uint32 `weight` with `scales` and `biases` per group, and config.json's
`quantization: {group_size, bits}`. Tensors are generated, quantized and written one at a time (a stack of
experts a few experts at a time), so peak memory stays about one tensor whatever the model's size. Weights
are uniform with the spread of llama's normal init (4x faster to draw than normals, the same for speed).
The tokenizer is byte-level (every byte a token, three ChatML specials, unused filler up to the vocabulary
size): any text encodes within any vocabulary.
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
    # A mixture of experts (models/synth_moe.py): llama, qwen3_moe or deepseek_v3, whose defaults are
    # synth_moe.ARCH_DEFAULTS (`arch_spec`). The fields below stay 0 (1 for the groups) in a llama.
    arch: str = "llama"
    experts: int = 0  # routed experts per MoE layer
    active: int = 0  # experts each token is routed to (num_experts_per_tok)
    moe_intermediate: int = 0  # each expert's intermediate size
    shared_experts: int = 0  # deepseek_v3: always-on experts (one MLP of shared x moe_intermediate)
    dense_layers: int = 0  # the first layers keep a dense MLP of `intermediate`
    expert_groups: int = 1  # deepseek_v3: the experts in groups (n_group) ...
    active_groups: int = 1  # ... of which a token's experts come from this many (topk_group)
    q_lora_rank: int = 0  # deepseek_v3's latent attention (0: a full-rank query)
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    nope_head_dim: int = 0
    v_head_dim: int = 0
    routed_scaling: float = 2.5  # deepseek_v3's routed_scaling_factor

    def check(self) -> None:
        from shardline.models.synth_moe import check_moe

        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads) < 1:
            raise ValueError("layers, hidden, intermediate, heads and kv-heads must be >= 1")
        if self.arch == "llama" and (self.hidden % self.heads or self.heads % self.kv_heads):
            raise ValueError(
                f"hidden {self.hidden} must split into {self.heads} heads of {self.kv_heads} groups"
            )
        dims = check_moe(self)
        if self.vocab < len(SPECIALS) + 256:
            raise ValueError(f"vocab must be at least {len(SPECIALS) + 256} (the byte-level tokenizer's)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.bits:
            if self.bits not in (2, 3, 4, 5, 6, 8):
                raise ValueError(f"bits must be 0 (no quantization) or 2, 3, 4, 5, 6, 8; got {self.bits}")
            if self.group_size not in (32, 64, 128):
                raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")
            for what, dim in dims:
                if dim % self.group_size:
                    raise ValueError(f"{what} {dim} is not a multiple of the group size {self.group_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def arch_spec(arch: str = "llama", **given: Any) -> SynthSpec:
    """The spec of `arch` with its defaults (synth_moe.ARCH_DEFAULTS), each of `given` replacing one."""
    from shardline.models.synth_moe import ARCH_DEFAULTS

    return SynthSpec(**{**ARCH_DEFAULTS.get(arch, {}), **given, "arch": arch})


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # (out, in) for matrices, as mlx-lm stores them; (experts or heads, out, in)
    std: float  # 0: a norm weight, all ones
    quantized: bool
    bits: int = 0  # a quantized tensor's own bits and group size, where not the model's (a router's)
    group_size: int = 0
    dtype: str = ""  # a float tensor's own dtype, where not the model's (deepseek's score-correction bias)


def plan(spec: SynthSpec) -> list[PlannedTensor]:
    """Every tensor of the model, in file order (layer by layer), with its init."""
    from shardline.models.synth_moe import plan_moe

    # 0.02 as llama's initializer_range; the residual-writing projections shrunk by sqrt(2 * layers) (GPT-2)
    # so the residual stream stays near unit scale through any depth: activations finite even in float16.
    std, out_std = 0.02, 0.02 / math.sqrt(2 * spec.layers)
    if spec.arch != "llama":
        return plan_moe(spec, std, out_std)
    h, i, kv = spec.hidden, spec.intermediate, spec.kv_heads * spec.head_dim
    q = bool(spec.bits)
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
    dtype = DTYPES[t.dtype or spec.dtype][1]
    if not t.quantized:
        return [(t.name, dtype, t.shape)]
    *lead, cols = t.shape
    bits, group_size = _quantization(spec, t)
    base = t.name.removesuffix(".weight")
    groups = (*lead, cols // group_size)
    return [
        (t.name, "U32", (*lead, cols * bits // 32)),
        (base + ".scales", dtype, groups),
        (base + ".biases", dtype, groups),
    ]


def _quantization(spec: SynthSpec, t: PlannedTensor) -> tuple[int, int]:
    return t.bits or spec.bits, t.group_size or spec.group_size


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]


def footprint(spec: SynthSpec, name: str = "synth") -> Any:
    """The ModelFootprint placement would read from the written model, from the spec alone (placement and
    its tests reason about models of GBs without writing them): footprint_from_dir of the model's config and
    safetensors headers, written without their data (it reads nothing else)."""
    import tempfile

    from shardline.models.footprint import footprint_from_dir

    spec.check()
    tensors = plan(spec)
    with tempfile.TemporaryDirectory(prefix="synth-footprint-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config(spec)))
        for j, indices in enumerate(_files(spec, tensors)):
            with (Path(tmp) / f"model-{j + 1:05d}.safetensors").open("wb") as f:
                f.write(_header(spec, tensors, indices))
        return footprint_from_dir(Path(tmp), name)


def config(spec: SynthSpec) -> dict:
    from shardline.models.synth_moe import config_moe

    out: dict = config_moe(spec) if spec.arch != "llama" else _llama_config(spec)
    out.update(
        {
            "torch_dtype": spec.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "shardline_synthetic": {"purpose": PURPOSE, **asdict(spec)},
        }
    )
    if spec.bits:
        quant: dict[str, Any] = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
        # Tensors quantized otherwise than the model (a router), by module path, as mlx_lm.convert records
        # them and mlx-lm's load_model reads them.
        for t in plan(spec):
            if t.quantized and (t.bits or t.group_size):
                bits, group_size = _quantization(spec, t)
                path = t.name.removesuffix(".weight")
                quant[path] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        # Both keys, as mlx-lm's own convert writes them.
        out["quantization"] = quant
        out["quantization_config"] = dict(quant)
    return out


def _llama_config(spec: SynthSpec) -> dict:
    return {
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
    }


CHUNK_ELEMENTS = 1 << 24  # a stack (of experts, of heads) drawn this many float32 values at a time: 64 MB


def _generate(spec: SynthSpec, index: int, t: PlannedTensor) -> list[list[mx.array]]:
    """One tensor's stored arrays, in `stored` order, each in parts along its first axis (a stack's few
    experts at a time, quantized as drawn: only the packed parts are held); deterministic in (seed, index)."""
    dtype = DTYPES[t.dtype or spec.dtype][0]
    if t.std == 0.0:
        return [[mx.ones(t.shape, dtype=dtype)]]
    key = mx.random.key(spec.seed * 1_000_003 + index)
    stack = len(t.shape) == 3
    # A stack's members get keys of their own: the values do not depend on how many are drawn at once.
    keys = mx.random.split(key, t.shape[0]) if stack else key[None]
    inner = t.shape[1:] if stack else t.shape
    step = max(1, CHUNK_ELEMENTS // math.prod(inner)) if stack else 1
    limit = t.std * math.sqrt(3)  # uniform on [-limit, limit]: standard deviation std
    parts: list[list[mx.array]] = [[] for _ in stored(spec, t)]
    for start in range(0, len(keys), step):
        chunk = [mx.random.uniform(-limit, limit, inner, key=k) for k in keys[start : start + step]]
        w = (mx.stack(chunk) if stack else chunk[0]).astype(dtype)
        if t.quantized:
            bits, group_size = _quantization(spec, t)
            arrays = list(mx.quantize(w, group_size=group_size, bits=bits))
        else:
            arrays = [w]
        mx.eval(arrays)  # now, so that the float chunk is freed before the next is drawn
        for held, a in zip(parts, arrays, strict=True):
            held.append(a)
    return parts


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


def _header(spec: SynthSpec, tensors: list[PlannedTensor], indices: list[int]) -> bytes:
    """A safetensors file's length and header for these tensors."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx", "shardline": PURPOSE}}
    offset = 0
    for k in indices:
        for name, dtype, shape in stored(spec, tensors[k]):
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def _write_file(
    path: Path, spec: SynthSpec, tensors: list[PlannedTensor], indices: list[int], done: Callable[[int], None]
) -> None:
    with path.open("wb") as f:
        f.write(_header(spec, tensors, indices))
        for k in indices:
            arrays = _generate(spec, k, tensors[k])
            for parts, (name, dtype, shape) in zip(arrays, stored(spec, tensors[k]), strict=True):
                made = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
                if made != shape or sum(a.nbytes for a in parts) != _nbytes(dtype, shape):
                    raise AssertionError(f"{name}: made {made} {parts[0].dtype}, planned {shape} {dtype}")
                for a in parts:
                    f.write(_raw(a))
            done(sum(a.nbytes for parts in arrays for a in parts))
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
            "active_parameters": active_parameter_count(spec),
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


def active_parameter_count(spec: SynthSpec) -> int:
    """The parameters one token computes with: all but the routed experts it is not routed to."""
    from shardline.models.synth_moe import inactive_parameters

    return parameter_count(spec) - inactive_parameters(spec)


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
    quantization = cfg.get("quantization") or {}
    bits = int(quantization.get("bits") or 0)
    stored_bytes = params = 0
    entries = list(_headers(model_dir))
    names = {name for name, _, _ in entries}
    for name, dtype, shape in entries:
        stored_bytes += math.prod(shape) * SAFETENSORS_ITEMSIZE.get(dtype, 4)
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and base.rsplit(".", 1)[0] + ".weight" in names:
            continue  # a quantized weight's group parameters: not parameters of the model
        if bits and dtype == "U32" and f"{base}.scales" in names:
            # A module quantized otherwise than the model (a router) has its own entry, by module path.
            own = quantization.get(base)
            params += math.prod(shape) * 32 // int(own["bits"] if isinstance(own, dict) else bits)
        else:
            params += math.prod(shape)
    return {"stored_bytes": stored_bytes, "parameters": params, "float32_bytes": 4 * params}


def is_synthetic(model_dir: Path) -> bool:
    return (Path(model_dir) / SYNTH_INFO_FILE).is_file()
