"""`shardline bench engine`'s prefix-cache figures: a conversation's fifth turn and concurrent requests
sharing a system prompt, each on an engine with the cache and on one without it, every reply compared."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from shardline.bench.engine_runs import prompt_ids, start_engine, timed_request
from shardline.engine.engine import Engine


@dataclass(frozen=True)
class PrefixWork:
    """The prefix cache's workloads: a conversation (a system prompt, then turns of a user message and a
    reply) timed at its fifth turn, and concurrent requests that share one system prompt."""

    system: int = 600
    user: int = 268  # with the reply, a turn of ~300 tokens
    reply: int = 32
    turns: int = 5
    shared_system: int = 1024
    shared_user: int = 32
    shared_requests: int = 8

    @classmethod
    def quick(cls) -> PrefixWork:
        return cls(system=200, user=60, reply=8, shared_system=256, shared_user=16)


def concurrent(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens a second from submitting every prompt at once to the last token, and each one's tokens."""
    start = time.perf_counter()
    handles = [engine.submit(p, max_tokens=max_tokens) for p in prompts]
    tokens = [h.tokens(timeout=600) for h in handles]
    return sum(len(t) for t in tokens) / (time.perf_counter() - start), tokens


def prefix_round(model_dir: Path, vocab: int, work: PrefixWork) -> tuple[dict, dict, int]:
    """One round of the prefix cache's figures on 2 stages: the engine with the cache, then without it. The
    time to first token of turn 5 (two variants of its user message after the same four turns), and the
    throughput of concurrent requests sharing a system prompt from a cold cache. Every reply is compared
    between the two: a cached run must not change a token."""
    history = prompt_ids(work.system, vocab, offset=21)
    turns: list[tuple[list[int], list[int]]] = []  # prompt, reply
    last = [prompt_ids(work.user, vocab, offset=400 + k) for k in range(2)]
    shared = [
        prompt_ids(work.shared_system, vocab, offset=31) + prompt_ids(work.shared_user, vocab, offset=200 + k)
        for k in range(work.shared_requests)
    ]
    raw: dict[str, float] = {}
    with start_engine(model_dir, 2) as engine:
        for t in range(work.turns - 1):
            prompt = history + prompt_ids(work.user, vocab, offset=300 + t)
            reply = engine.submit(prompt, max_tokens=work.reply).tokens(timeout=600)
            turns.append((prompt, reply))
            history = prompt + reply
        ttft = [timed_request(engine, history + user, 1)[0] for user in last]
        raw["prefix_turn5_ttft_s_cached"] = statistics.mean(ttft)
        raw["prefix_turn5_prompt_tokens"] = len(history) + work.user
    with start_engine(model_dir, 2) as engine:  # a cold cache: the first request computes what the rest share
        raw["prefix_shared_tps_cached"], shared_cached = concurrent(engine, shared, work.reply)
    with start_engine(model_dir, 2, prefix_cache=False) as engine:
        ttft = [timed_request(engine, history + user, 1)[0] for user in last]
        raw["prefix_turn5_ttft_s_plain"] = statistics.mean(ttft)
        raw["prefix_shared_tps_plain"], shared_plain = concurrent(engine, shared, work.reply)
        mismatched = sum(
            engine.submit(prompt, max_tokens=work.reply).tokens(timeout=600) != reply
            for prompt, reply in turns
        )
    mismatched += sum(a != b for a, b in zip(shared_cached, shared_plain, strict=True))
    ratios = {
        "prefix_ttft_ratio_turn5": raw["prefix_turn5_ttft_s_cached"] / raw["prefix_turn5_ttft_s_plain"],
        "prefix_shared_prompt_throughput_ratio": raw["prefix_shared_tps_cached"]
        / raw["prefix_shared_tps_plain"],
    }
    return ratios, raw, mismatched
