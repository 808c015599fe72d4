"""The runs `shardline bench engine` times: an engine started as the bench starts it, one request's token
stamps, concurrent streams, and the deterministic prompts they take."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from shardline.compute.sampling import SamplingParams
from shardline.engine.engine import Engine, EngineConfig

PREFILL_STEP = 128
# Every prompt of the bench and its tokens fit; a model trained on a shorter context computes past it (its
# speed is measured, not its answers), and a longer one's is not needed.
BENCH_CONTEXT = 4096


def prompt_ids(n: int, vocab: int, offset: int = 0) -> list[int]:
    # Deterministic, vocabulary-spread ids, clear of the vocabulary's ends (where special tokens tend to
    # lie): speed does not depend on which tokens they are.
    low = min(500, vocab // 4)
    return [(offset + 7919 * i) % (vocab - 2 * low) + low for i in range(n)]


def start_engine(
    model_dir: Path,
    stages: int,
    window: int = 0,
    context_length: int = 0,
    prefix_cache: bool = True,
    pin_cpus: bool = True,
) -> Engine:
    """pin_cpus: each stage on a core of its own with one thread; else unpinned, the cores shared out.
    context_length: 0, BENCH_CONTEXT."""
    config = EngineConfig(
        model_dir=model_dir,
        stages=stages,
        prefill_step=PREFILL_STEP,
        window=window,
        pin_cpus=pin_cpus,
        context_length=context_length or BENCH_CONTEXT,
        prefix_cache=prefix_cache,
    )
    return Engine(config).start()


def timed_request(engine: Engine, tokens: list[int], max_tokens: int) -> list[float]:
    """Seconds from submitting to each token."""
    start = time.perf_counter()
    stamps = []
    for _ in engine.submit(tokens, max_tokens=max_tokens):
        stamps.append(time.perf_counter() - start)
    return stamps


def decode_tps(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def streams(
    engine: Engine, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams | None = None
) -> tuple[float, list[list[int]]]:
    """Concurrent streams: tokens/s while every one of them is decoding, and each stream's tokens."""
    stamps: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    handles = [engine.submit(p, max_tokens=max_tokens, sampling=sampling) for p in prompts]

    def follow(i: int) -> None:
        for t in handles[i]:
            stamps[i].append(time.perf_counter())
            tokens[i].append(t.token)

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The window in which all streams were decoding: from the last first token to the first last token.
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    inside = sum(1 for s in stamps for x in s if start < x <= end)
    return inside / (end - start), tokens
