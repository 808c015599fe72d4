"""Our GGUF tokenizers against llama.cpp's tokenization of the same vocabularies and strings.

tests/data/tokenizers/ holds tiny vocabulary GGUFs (SentencePiece: llama, gemma, phi-3; gemma 4's BPE on
characters; one byte-level BPE, given every pre-tokenizer in turn) and `llama-tokenize`'s ids for
multilingual text, code, digit runs and whitespace runs (scripts/record-gguf-tokenizers.py). With llama.cpp
built here, one more test runs llama-tokenize again, live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import _is_bpe_decoder, _is_spm_decoder, _is_spm_decoder_no_space
from tokenizers import Tokenizer

from shardline.bench.llama_cpp import BUILD_HINT, binary
from shardline.models.errors import UnsupportedModelError
from shardline.models.gguf_pretokenizers import _NAMES, _TYPES
from shardline.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from shardline.testing import tokenizer_fixtures as fx

FAMILIES = {f.name: f for f in fx.FAMILIES}


def _mismatches(tok: Tokenizer, cases: list[dict[str, Any]]) -> list[str]:
    out = []
    for case in cases:
        ids = tok.encode(case["text"]).ids
        if ids != case["ids"]:
            out.append(f"{case['text']!r}:\n  ours      {ids}\n  llama.cpp {case['ids']}")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_ids_match_llama_cpp(name: str) -> None:
    family = FAMILIES[name]
    doc = fx.recorded(family)
    assert [c["text"] for c in doc["cases"]] == list(family.texts()), "strings changed: record them again"
    tok = build_tokenizer(fx.family_meta(family))
    bad = _mismatches(tok, doc["cases"])
    assert not bad, (
        f"{len(bad)} of {len(doc['cases'])} strings differ from {doc['llama_cpp']}:\n" + "\n".join(bad)
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decode_round_trip(name: str) -> None:
    tok = build_tokenizer(fx.family_meta(FAMILIES[name]))
    for text in fx.TEXTS:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


@pytest.mark.timeout(60)
def test_every_pre_tokenizer_type_is_recorded() -> None:
    recorded = {_NAMES[f.pre] for f in fx.FAMILIES if f.pre is not None}
    assert recorded == set(_TYPES)


@pytest.mark.timeout(60)
def test_unknown_pre_tokenizer_names_the_supported_ones() -> None:
    meta = fx.family_meta(FAMILIES["bpe-gpt-2"]) | {"tokenizer.ggml.pre": "mystery-pre"}
    with pytest.raises(UnsupportedModelError, match=r"'mystery-pre'.*deepseek-v3.*tekken"):
        build_tokenizer(meta)


@pytest.mark.timeout(60)
def test_unknown_tokenizer_model_is_refused() -> None:
    meta = fx.family_meta(FAMILIES["spm-llama"]) | {"tokenizer.ggml.model": "t5"}
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        build_tokenizer(meta)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "kind"),
    [("spm-llama", "spm"), ("spm-gemma", "spm-no-space"), ("gemma4", "spm-no-space"), ("bpe-qwen2", "bpe")],
)
def test_mlx_lm_picks_the_matching_detokenizer(name: str, kind: str) -> None:
    decoder = json.loads(build_tokenizer(fx.family_meta(FAMILIES[name])).to_str())["decoder"]
    found = {"spm": _is_spm_decoder, "spm-no-space": _is_spm_decoder_no_space, "bpe": _is_bpe_decoder}
    assert [k for k, is_kind in found.items() if is_kind(decoder)] == [kind]


@pytest.mark.timeout(60)
def test_spm_tokenizer_config_and_bos() -> None:
    meta = fx.family_meta(FAMILIES["spm-llama"])
    config = tokenizer_config(meta, 4096)
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True  # llama.cpp's default for SentencePiece vocabularies
    tok = build_tokenizer(meta)
    assert tok.encode("hi").ids[0] == 1
    assert tok.encode("hi", add_special_tokens=False).ids[0] != 1
    no_bos = build_tokenizer(meta | {"tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hi").ids == tok.encode("hi", add_special_tokens=False).ids


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    binary("llama-tokenize") is None, reason=f"llama.cpp's llama-tokenize is not built here (`{BUILD_HINT}`)"
)
def test_recorded_ids_are_llama_cpps_live(tmp_path: Path) -> None:
    """llama-tokenize, run now on the same files, still gives the recorded ids (and so ours)."""
    exe = binary("llama-tokenize")
    assert exe is not None
    for family in fx.FAMILIES:
        vocab = fx.family_vocab(family, tmp_path)
        for case in fx.recorded(family)["cases"]:
            assert fx.llama_tokenize(exe, vocab, case["text"]) == case["ids"], (family.name, case["text"])
