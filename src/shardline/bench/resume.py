"""`shardline bench resume`: what a failure costs a request under each resume mode, on the same requests.

exact: replay the prompt with its original chunking, then the emitted tokens as the same decode steps:
       the fault-free numerics, so greedy output cannot change; one decode step per emitted token.
fast:  one chunked prefill of prompt + emitted: fewer steps, but another summation order, which can flip
       a near-tied greedy choice.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from shardline.engine.engine import Engine, EngineConfig

KILL_AFTER = 24
MAX_TOKENS = 48


def _chat_prompts(model_dir: Path) -> list[list[int]]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model_dir)
    questions = [
        "Explain how a rainbow forms.",
        "Write a short poem about the sea.",
        "What are the planets of the solar system?",
        "Describe how bread is made.",
    ]
    chats = [[{"role": "user", "content": q}] for q in questions]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _one(engine: Engine, prompt: list[int], kill_stage: int | None) -> tuple[list[int], float | None]:
    """The tokens, and the pause the client saw around the failure (last token before to first after)."""
    stamps, tokens = [], []
    for tok in engine.submit(prompt, max_tokens=MAX_TOKENS):
        tokens.append(tok.token)
        stamps.append(time.monotonic())
        if kill_stage is not None and len(tokens) == KILL_AFTER:
            os.kill(engine.runner_pids()[kill_stage], signal.SIGKILL)
    pause = stamps[KILL_AFTER] - stamps[KILL_AFTER - 1] if kill_stage is not None else None
    return tokens, pause


def run(model: str | None, json_path: Path | None, stages: int = 2) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    prompts = _chat_prompts(model_dir)
    base = dict(model_dir=model_dir, stages=stages, prefill_step=64, heartbeat_s=0.25, heartbeat_timeout=2.0)
    print(
        f"bench resume: {len(prompts)} requests, last stage SIGKILLed after {KILL_AFTER} tokens",
        file=sys.stderr,
    )
    with Engine(EngineConfig(**base)).start() as engine:
        reference = [_one(engine, p, None)[0] for p in prompts]
    result: dict = {"model": model_dir.name, "stages": stages, "kill_after_tokens": KILL_AFTER}
    for mode in ("exact", "fast"):
        pauses, mismatched = [], 0
        with Engine(EngineConfig(**base, resume=mode, max_restarts=100)).start() as engine:
            for prompt, ref in zip(prompts, reference, strict=True):
                tokens, pause = _one(engine, prompt, stages - 1)
                pauses.append(pause)
                mismatched += tokens != ref
        result[f"pause_s_median_{mode}"] = statistics.median(pauses)
        result[f"pause_s_max_{mode}"] = max(pauses)
        result[f"outputs_mismatched_{mode}"] = mismatched
    result["requests"] = len(prompts)
    for key, value in result.items():
        print(f"{key:28} {value:.2f}" if isinstance(value, float) else f"{key:28} {value}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result
