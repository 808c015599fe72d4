"""`shardline bench serve`: what serving over HTTP costs next to the Python API, on one 2-node cluster.

The same N concurrent streaming clients, each sending the same requests (greedy, max_tokens generated
whatever the model says), run against node s1's HTTP API (OpenAI chat, streamed) and against a front in the
bench process connected to s1 over zenoh (the Python API), in alternating rounds. Reported:
- http_overhead_ratio: tokens/s over HTTP / tokens/s through the Python API, median of the pairs (range);
- ttft_p50_s / ttft_p99_s, itl_p50_s / itl_p99_s: over HTTP, from request sent to first content chunk and
  between content chunks;
- requests_lost: requests of either path that did not end with exactly max_tokens tokens.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shardline.bench.machine import describe
from shardline.models.registry import resolve_model
from shardline.testing.cluster import MODEL_RUNNERS, LocalCluster

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how the tides work, step by step.",
    "Describe a walk through a forest in autumn.",
    "What makes a good cup of tea?",
]


@dataclass
class Round:
    path: str
    wall_s: float = 0.0
    tokens: int = 0
    lost: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def add(self, tokens: int, expected: int, arrivals: list[float], sent: float) -> None:
        with self.lock:
            self.tokens += tokens
            self.lost += tokens != expected
            if arrivals:
                self.ttft.append(arrivals[0] - sent)
                self.itl += [b - a for a, b in itertools.pairwise(arrivals)]


def _http_request(api: str, model: str, question: str, max_tokens: int, r: Round) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    tokens = 0
    sent = time.monotonic()
    try:
        with httpx.stream("POST", api + "/v1/chat/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.monotonic())
    except httpx.HTTPError:
        pass
    r.add(tokens, max_tokens, arrivals, sent)


def _python_request(front, prompt: list[int], max_tokens: int, r: Round) -> None:  # type: ignore[no-untyped-def]
    arrivals: list[float] = []
    sent = time.monotonic()
    try:
        handle = front.submit(prompt, max_tokens=max_tokens)
        for _ in handle.stream(timeout=600):
            arrivals.append(time.monotonic())
    except Exception:
        pass
    r.add(len(arrivals), max_tokens, arrivals, sent)


def _round(path: str, clients: int, per_client: int, one: Callable[[int, Round], None]) -> Round:
    r = Round(path)

    def client(i: int) -> None:
        for k in range(per_client):
            one(i + k, r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.wall_s = time.monotonic() - start
    return r


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(
    model: str | None = None,
    json_path: Path | None = None,
    clients: int = 4,
    max_tokens: int = 48,
    pairs: int = 3,
    per_client: int = 2,
) -> dict:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir = resolve_model(model, progress=False)
    tok = load_tokenizer(model_dir)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    with tempfile.TemporaryDirectory(prefix="shardline-bench-serve-") as tmp:
        runners = dict(MODEL_RUNNERS)
        cluster = LocalCluster(
            Path(tmp),
            ["s1", "s2"],
            model_dir.parent,
            extra=["--prefill-step", "128"],
            runners=runners,
            api=True,
        ).start()
        try:
            client = cluster.client("s1")
            client.wait(lambda v: sum(n.alive for n in v.nodes) == 2, 60, "2 nodes")
            reply = client.place(model_dir.name)
            assert reply.instance is not None
            rec = client.wait_ready(reply.instance.instance, 600)
            front = client.front(rec.instance)
            api = cluster.nodes["s1"].api
            name = rec.model

            def http(i: int, r: Round) -> None:
                _http_request(api, name, QUESTIONS[i % len(QUESTIONS)], max_tokens, r)

            def python(i: int, r: Round) -> None:
                _python_request(front, prompts[i % len(prompts)], max_tokens, r)

            _round("warm-http", 1, 1, http)  # first request per path: tokenizer, connections
            _round("warm-python", 1, 1, python)
            rounds: list[tuple[Round, Round]] = []
            for k in range(pairs):
                order = [("http", http), ("python", python)]
                done = {
                    p: _round(p, clients, per_client, f) for p, f in (order if k % 2 == 0 else order[::-1])
                }
                rounds.append((done["http"], done["python"]))
                print(
                    f"pair {k + 1}: http {done['http'].tokens_per_s:.1f} tok/s, "
                    f"python {done['python'].tokens_per_s:.1f} tok/s",
                    file=sys.stderr,
                )
        finally:
            cluster.close()

    ratios = [h.tokens_per_s / p.tokens_per_s for h, p in rounds if p.tokens_per_s]
    http_all = [h for h, _ in rounds]
    py_all = [p for _, p in rounds]
    ttft = [t for h in http_all for t in h.ttft]
    itl = [t for h in http_all for t in h.itl]
    py_ttft = [t for p in py_all for t in p.ttft]
    py_itl = [t for p in py_all for t in p.itl]
    result = {
        "machine": describe(),
        "model": model_dir.name,
        "clients": clients,
        "requests_per_client": per_client,
        "max_tokens": max_tokens,
        "pairs": pairs,
        "http_overhead_ratio": round(statistics.median(ratios), 3) if ratios else None,
        "http_overhead_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        "http_tokens_per_s": round(statistics.median(h.tokens_per_s for h in http_all), 2),
        "python_tokens_per_s": round(statistics.median(p.tokens_per_s for p in py_all), 2),
        "ttft_p50_s": round(_pct(ttft, 0.5), 4),
        "ttft_p99_s": round(_pct(ttft, 0.99), 4),
        "itl_p50_s": round(_pct(itl, 0.5), 4),
        "itl_p99_s": round(_pct(itl, 0.99), 4),
        "python_ttft_p50_s": round(_pct(py_ttft, 0.5), 4),
        "python_itl_p50_s": round(_pct(py_itl, 0.5), 4),
        "requests_lost": sum(h.lost for h in http_all) + sum(p.lost for p in py_all),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    return result
