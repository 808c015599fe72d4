"""The real default model, end to end: engine, CLI, errors, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from conftest import PROMPTS
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shardline.models.registry import resolve_model

QUESTION = "Name the capital of France."


@pytest.fixture(scope="module")
def default_model():
    return resolve_model(None, progress=False)


def _shardline(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardline.cli.main", *args]


def _runner_children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_answers_paris_on_two_stages(default_model, start_engine):
    tokenizer = load_tokenizer(default_model)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine = start_engine(default_model, 2, prefill_step=256)
    handle = engine.submit(ids, max_tokens=24, stop_tokens=list(tokenizer.eos_token_ids))
    answer = tokenizer.decode(handle.tokens(timeout=240))
    assert "Paris" in answer, answer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quantized_greedy_text_is_the_same_on_one_two_and_three_stages(default_model, start_engine):
    """The imported (quantized) default model: 8 chat prompts, greedy, the same text on S = 1, 2 and 3."""
    tokenizer = load_tokenizer(default_model)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in PROMPTS
    ]
    texts: dict[int, list[str]] = {}
    for stages in (1, 2, 3):
        engine = start_engine(default_model, stages, prefill_step=64)
        handles = [
            engine.submit(p, max_tokens=24, stop_tokens=list(tokenizer.eos_token_ids)) for p in prompts
        ]
        texts[stages] = [tokenizer.decode(h.tokens(timeout=240)) for h in handles]
        engine.shutdown()
    assert all(texts[1]) and "Paris" in texts[1][0], texts[1]
    assert texts[2] == texts[1], (texts[1], texts[2])
    assert texts[3] == texts[1], (texts[1], texts[3])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_generate_streams_answer_and_leaves_nothing(default_model):
    out = subprocess.run(
        _shardline("generate", "--stages", "2", "--max-tokens", "24", QUESTION),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.timeout(120)
def test_cli_unknown_model_is_one_readable_line():
    out = subprocess.run(
        _shardline("generate", "--model", "no-such-model", "hi"), capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardline: error:"), out.stderr
    assert "no-such-model" in lines[0]


@pytest.mark.timeout(120)
def test_cli_bad_stage_count_is_refused(default_model):
    out = subprocess.run(
        _shardline("generate", "--stages", "0", "hi"), capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "shardline: error: --stages must be at least 1, got 0"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_ctrl_c_exits_without_leftovers(default_model):
    proc = subprocess.Popen(
        _shardline(
            "generate", "--stages", "2", "--max-tokens", "2000", "Write a very long story about a dragon."
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # On a hang, SIGABRT makes faulthandler print every thread's stack: the failure says where.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        # As from a terminal: a test run started in the background inherits SIGINT ignored, and Python
        # then never turns it into KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # The first streamed byte proves the runners are up and decoding.
    assert proc.stdout.read(1)
    children = _runner_children(proc.pid)
    assert children, "no runner processes under the CLI"
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the CLI did not exit within 60s of Ctrl-C; its threads:\n{err.decode()[-20000:]}")
    assert code == 130
    alive = [
        p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, f"left behind: {alive}"
