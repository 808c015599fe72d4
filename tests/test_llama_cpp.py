"""The llama.cpp reference helpers: their parsers on recorded outputs, and None when nothing was built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline.bench import llama_cpp

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "data"


def test_llama_bench_json_gives_prefill_and_decode():
    # Recorded: llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -p 512 -n 128 -r 2 -o json
    out = llama_cpp.parse_bench_json((DATA / "llama-bench-1t.json").read_text())
    assert out == {
        "prefill_tps": pytest.approx(65.663507),
        "prefill_tokens": 512,
        "decode_tps": pytest.approx(42.169208),
        "decode_tokens": 128,
    }


def test_llama_bench_json_without_either_test_is_an_error():
    only_depth = [{"n_prompt": 0, "n_gen": 0, "avg_ts": 1.0}]
    with pytest.raises(ValueError, match="no prefill"):
        llama_cpp.parse_bench_json(json.dumps(only_depth))
    one = llama_cpp.parse_bench_json(json.dumps([{"n_prompt": 0, "n_gen": 16, "avg_ts": 9.5}]))
    assert one == {"decode_tps": 9.5, "decode_tokens": 16}


def test_llama_perplexity_log_gives_the_final_estimate_and_what_it_scored():
    # Recorded: llama-perplexity -c 512 -b 512 -t 1 on an Apache-2.0 license text (stderr, then stdout).
    out = llama_cpp.parse_perplexity_output((DATA / "llama-perplexity.log").read_text())
    assert out == {"ppl": 15.9351, "ppl_err": 1.42456, "chunks": 4, "ctx": 512, "tokens_scored": 4 * 255}


def test_llama_perplexity_on_a_short_text_says_so():
    # It exits 0 with only an error line when the text is shorter than two windows.
    with pytest.raises(ValueError, match="398 tokens"):
        llama_cpp.parse_perplexity_output((DATA / "llama-perplexity-short.log").read_text())
    with pytest.raises(ValueError, match="no final estimate"):
        llama_cpp.parse_perplexity_output("perplexity: tokenizing the input ..\n")


def test_helpers_return_none_when_llama_cpp_is_not_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(llama_cpp.CACHE_ENV, str(tmp_path))
    assert llama_cpp.install_dir() == tmp_path / "llama.cpp" / llama_cpp.LLAMA_CPP_PYTHON_VERSION
    assert llama_cpp.binary("llama-bench") is None
    assert llama_cpp.llama_bench(tmp_path / "m.gguf", threads=1) is None
    assert llama_cpp.llama_perplexity(tmp_path / "m.gguf", tmp_path / "t.txt", ctx=512) is None
    assert llama_cpp.main(False, None) == 1
    assert "llama.cpp not built; run `shardline bench llama-cpp --build`" in capsys.readouterr().out
