"""`shardline bench quality`: llama-perplexity's scoring through the engine's stages, against mlx-lm."""

from __future__ import annotations

import json
import math
import random

import mlx.core as mx
import numpy as np
import pytest

from shardline.bench.quality import Score, StagedModel, perplexity, run, scored_positions, windows
from shardline.models.synth import SynthSpec, write_synth_model

CTX = 48


def _reference_ppl(model_dir, token_windows: list[list[int]]) -> float:
    """The same scoring, written out directly on single-process mlx-lm logits of whole windows."""
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    nll, count = 0.0, 0
    for w in token_windows:
        logits = np.array(model(mx.array([w]))[0].astype(mx.float32), dtype=np.float64)
        for pos in range(len(w) // 2, len(w) - 1):
            row = logits[pos]
            nll += math.log(np.exp(row - row.max()).sum()) + row.max() - row[w[pos + 1]]
            count += 1
    return math.exp(nll / count)


def _windows(vocab: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    return windows([rng.randrange(vocab) for _ in range(n * CTX + 5)], CTX)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head; tied head (split across 2 stages)
@pytest.mark.timeout(180)
def test_staged_perplexity_equals_mlx_lm_and_does_not_depend_on_stages(tiny_models, arch):
    model_dir = tiny_models[arch]
    token_windows = _windows(512)
    expected = _reference_ppl(model_dir, token_windows)
    got = {}
    for stages in (1, 2, 3):
        # A step that does not divide the window: chunked prefill with caches, as the runners do it.
        score, _ = perplexity(StagedModel(model_dir, stages), token_windows, None, step=20)
        assert score.count == len(token_windows) * (CTX - CTX // 2 - 1)
        got[stages] = score.ppl
    assert got[1] == pytest.approx(expected, rel=1e-4)
    assert got[2] == pytest.approx(got[1], rel=1e-5) and got[3] == pytest.approx(got[1], rel=1e-5)


@pytest.mark.timeout(120)
def test_staged_logits_are_what_the_engines_runner_processes_compute(tiny_models, start_engine):
    """The in-process stages are the engine's computation: at the position a runner does return (the last
    one, with want_logits), both give the same logits, split head included."""
    model_dir = tiny_models["qwen2"]
    engine = start_engine(model_dir, 2)
    staged = StagedModel(model_dir, 2)
    for n in (5, 21):
        prompt = [(37 * i + n) % 500 + 3 for i in range(n)]
        got = next(iter(engine.submit(prompt, max_tokens=1, want_logits=True))).logits
        mine = staged.logits(prompt, (n - 1, n), step=8)[0]
        assert float(mx.abs(mine - got).max() / mx.abs(got).max()) < 1e-5


@pytest.mark.timeout(30)
def test_windows_follow_llama_perplexity():
    tokens = list(range(10 * 8 + 3))
    w = windows(tokens, 8)
    assert len(w) == 10 and w[1] == list(range(8, 16))  # non-overlapping, the partial tail dropped
    assert len(windows(tokens, 8, chunks=4)) == 4
    assert scored_positions(512) == (256, 511)  # 255 tokens scored per window, as perplexity.cpp counts
    with pytest.raises(ValueError, match="needs 32"):
        windows(list(range(31)), 16)


@pytest.mark.timeout(30)
def test_score_matches_a_direct_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 3
    targets = np.array([0, 3, 10, 7, 7])
    s = Score()
    s.add(logits, targets)
    x = logits.astype(np.float64)
    nll = -(x[np.arange(5), targets] - np.log(np.exp(x).sum(axis=1)))
    assert s.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert s.ppl_err == pytest.approx(math.sqrt(nll.var() / 4) * s.ppl, rel=1e-9)


@pytest.mark.timeout(180)
def test_run_reports_each_stage_count_and_skips_llama_cpp_without_a_gguf(tmp_path):
    spec = SynthSpec(
        layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=320, bits=0, dtype="float32"
    )
    model = write_synth_model(tmp_path / "syn", spec)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)  # byte tokens: 270
    out = tmp_path / "q.json"
    result = run(str(model), text, [1, 2], ctx=64, json_path=out)
    assert json.loads(out.read_text()) == result
    assert result["chunks"] == 270 // 64 and result["tokens_scored"] == 4 * 31
    ppl = {s: r["ppl"] for s, r in result["stages"].items()}
    assert set(ppl) == {"1", "2"} and ppl["1"] == pytest.approx(ppl["2"], rel=1e-5)
    assert "skipped" in result["llama_cpp"] and "not runner processes" in result["engine"]
