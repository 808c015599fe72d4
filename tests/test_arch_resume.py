"""One architecture of each family on real runner processes (S=2): batched requests give each one's own
tokens, the prefix cache shares blocks where the model's caches allow, a runner SIGKILLed mid-decode resumes
to the same tokens as single-process mlx-lm, and a constrained request keeps its grammar.

The every-architecture matrix runs in-process (tests/test_arch_matrix.py); this is what needs processes:
the ring between stages, batched decode rows over it, and recovery. Each family takes its own path through
the generic stage: sliding windows (gemma3_text), latent attention with experts (deepseek_v3), experts
(qwen3_moe), recurrent layers between attention ones (qwen3_next), state-space layers only (mamba2), and a
dense model whose multipliers the fast path lacks (granite).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import FAST, STEP, assert_no_runner_left
from tokenizers import Tokenizer

from shardline.compute.constraints import Constraint
from shardline.compute.sampling import SamplingParams
from shardline.testing import arch_zoo
from shardline.testing.reference import Reference

FAMILIES = {
    "gemma3_text": "sliding window",
    "deepseek_v3": "MLA+MoE",
    "qwen3_moe": "MoE",
    "qwen3_next": "hybrid-recurrent",
    "mamba2": "SSM",
    "granite": "dense, generic",
}
# Plain KV caches share a prompt's blocks through the prefix cache; windows and recurrent state cannot.
PREFIX_SHARED = {"deepseek_v3", "qwen3_moe", "granite"}
PROMPTS = [[(7 * i + 3 * k) % 250 + 3 for i in range(20 + k)] for k in range(4)]  # 3 prefill chunks of 8
TOKENS = 24


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each family's model directory and mlx-lm's own greedy tokens for every prompt."""
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for arch in FAMILIES:
        path = arch_zoo.write(arch, root / arch)
        ref = Reference(path)
        out[arch] = (path, [ref.greedy(p, TOKENS)[0] for p in PROMPTS])
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_batches_and_resumes_exactly_on_two_stages(zoo, start_engine, arch):
    path, expected = zoo[arch]
    engine = start_engine(path, 2, **FAST)
    # None of these blocks is llama-shaped: every stage runs the model's own forward and says why.
    assert all(p.startswith("generic: ") for p in engine.paths()), engine.paths()
    assert engine.submit(PROMPTS[0], max_tokens=TOKENS).tokens(timeout=60) == expected[0]
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]  # decoded together
    assert [h.tokens(timeout=60) for h in handles] == expected
    # PROMPTS[0] again: its two full blocks come from the cache where the model's caches can share them.
    assert handles[0].cached_tokens == (2 * STEP if arch in PREFIX_SHARED else 0)
    old = engine.runner_pids()
    got: list[int] = []
    killed_at = 0.0
    for tok in engine.submit(PROMPTS[1], max_tokens=TOKENS):
        got.append(tok.token)
        if len(got) == 5:
            killed_at = time.monotonic()
            os.kill(old[1], signal.SIGKILL)
    assert got == expected[1]
    # A loaded machine may add a stall of its own (heartbeats are short here): the kill's recovery is the
    # first one detected after it, and it names the killed stage.
    after = [r for r in engine.recoveries if r.detected_at >= killed_at]
    assert after, "the killed runner was never noticed"
    assert "stage 1" in after[0].why, after[0].why
    assert engine.recoveries[-1].recovered_at is not None
    assert_no_runner_left(old)
    # Sampling happens on the logits whatever path computed them: a constrained request keeps its grammar.
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))  # the zoo's byte-level tokenizer
    eos = tok.token_to_id(json.loads((path / "tokenizer_config.json").read_text())["eos_token"])
    digits = SamplingParams(constraint=Constraint(kind="regex", source="[0-9]{3}", end=(eos,)))
    out = engine.submit(PROMPTS[2], max_tokens=8, sampling=digits, stop_tokens=[eos]).tokens(timeout=60)
    text = tok.decode([t for t in out if t != eos])
    assert len(text) == 3 and text.isdigit(), text


@pytest.mark.timeout(180)
def test_a_generic_architecture_in_tensor_parallel_groups(zoo, start_engine):
    """gemma3_text (sliding windows, scaled embedding, extra norms) on 2 stages of 2-member groups: each
    member runs the model's own forward over its heads and columns, the groups sum, and batched requests
    give mlx-lm's tokens."""
    path, expected = zoo["gemma3_text"]
    engine = start_engine(path, 2, tp=2, **FAST)
    assert len(engine.runner_pids()) == 4
    assert all(p.startswith("generic: ") for p in engine.paths()), engine.paths()
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]
    assert [h.tokens(timeout=60) for h in handles] == expected
