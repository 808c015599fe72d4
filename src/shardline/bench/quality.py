"""`shardline bench quality`: perplexity through the pipeline's stages, scored as llama.cpp's perplexity.

The method is llama.cpp's (tools/perplexity/perplexity.cpp, `perplexity()`), so the numbers compare:
- the text is tokenized once (with BOS when the tokenizer adds one) and cut into non-overlapping windows of
  `ctx` tokens (at least two windows are needed; a trailing partial window is dropped);
- each window is evaluated from an empty cache, its first token replaced by BOS when the tokenizer adds one;
- only the second half is scored: the logits at positions ctx/2 .. ctx-2 predict the tokens after them, so
  each window scores ctx - ctx/2 - 1 tokens; ppl = exp(mean negative log-likelihood over every window).

The logits come from the engine's own stages, in one process: the model is split as the engine splits it
(`split_for_stages`), each stage is `load_shard`ed (only its layers, with its attention kernel, input-major
weights and, with a tied head, the split head), and a window's tokens go through the stages in order in chunks
of `prefill_step` with per-stage KV caches, as the runners' prefill does. Only the hop between processes is
left out: a runner's `Shard.forward` returns the last position alone, and perplexity needs every position.
Each stage count is scored in a child process started with the runners' environment (OpenBLAS, allocator).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from shardline.bench.machine import describe
from shardline.compute import blas

DEFAULT_CTX = 512


@dataclass
class Score:
    """Running sums of the negative log-likelihood, as perplexity.cpp keeps them."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, logits: np.ndarray, targets: np.ndarray) -> None:
        """logits (n, vocab) at the positions that predict `targets` (n,)."""
        x = logits.astype(np.float64)
        top = x.max(axis=-1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=-1))
        v = lse - x[np.arange(len(targets)), targets]
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += len(targets)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_err(self) -> float:
        """perplexity.cpp's +/-: the standard error of the mean NLL, times the ppl."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return math.sqrt(var / (self.count - 1)) * self.ppl if var > 0 and self.count > 1 else 0.0


def windows(tokens: list[int], ctx: int, chunks: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of `ctx` tokens; llama-perplexity refuses fewer than 2 * ctx tokens."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4, got {ctx}")
    if len(tokens) < 2 * ctx:
        raise ValueError(f"the text is {len(tokens)} tokens; perplexity with ctx {ctx} needs {2 * ctx}")
    n = len(tokens) // ctx
    if chunks is not None:
        n = min(n, chunks)
    return [tokens[i * ctx : (i + 1) * ctx] for i in range(n)]


def scored_positions(ctx: int) -> tuple[int, int]:
    """[first, last): the positions whose logits are scored (each predicts the token after it)."""
    return ctx // 2, ctx - 1


def tokenize(model_dir: Path, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp takes them (BOS first when the tokenizer adds one), and that BOS."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model_dir)
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    bos = tok.bos_token_id if cfg.get("add_bos_token") else None
    ids = tok.encode(text, add_special_tokens=False)
    return ([bos, *ids] if bos is not None else ids), bos


class StagedModel:
    """The engine's stages of one model, loaded in this process, evaluated in order with all positions."""

    def __init__(self, model_dir: Path, stages: int) -> None:
        from shardline.cluster.placement import split_for_stages
        from shardline.compute.shard import LayerRange, load_shard
        from shardline.models.footprint import footprint_from_dir

        fp = footprint_from_dir(Path(model_dir))  # the engine's own split of one machine's cores
        self.shards = [
            load_shard(Path(model_dir), LayerRange(s, e, fp.layers)) for s, e in split_for_stages(fp, stages)
        ]

    def logits(self, tokens: list[int], rows: tuple[int, int], step: int) -> mx.array:
        """Logits (float32) of positions rows[0]..rows[1]-1 of `tokens`, evaluated from empty caches in
        chunks of `step` positions through every stage, as a prompt is prefilled."""
        from mlx_lm.models.base import create_attention_mask

        caches = [s.make_cache(step) for s in self.shards]
        out = []
        for start in range(0, rows[1], step):
            h = mx.array([tokens[start : min(start + step, rows[1])]])
            for shard, cache in zip(self.shards, caches, strict=True):
                # Shard.forward, but keeping every position (it returns the last one's logits alone).
                h = shard.embed(h) if shard.range.is_first else h
                mask = create_attention_mask(h, cache[0])
                for layer, c in zip(shard.layers, cache, strict=True):
                    h = layer(h, mask, cache=c)
            lo, hi = max(rows[0], start) - start, h.shape[1]
            if lo < hi:
                out.append(self._head(h[0, lo:hi]))
            mx.eval(h, *out[-1:])  # one chunk's graph at a time (the caches' updates are part of it)
        return mx.concatenate(out, axis=0)

    def _head(self, h: mx.array) -> mx.array:
        last = self.shards[-1]
        packed = last.head(last.norm(h))
        # With a split (tied) head the first stage computes the lower half of the logits, as the leader does.
        return self.shards[0].finish_head(packed) if last.head_split else packed


def perplexity(
    model: StagedModel, token_windows: list[list[int]], bos: int | None, step: int
) -> tuple[Score, float]:
    """llama.cpp's scoring over the windows; the score and the seconds it took."""
    score, started = Score(), time.perf_counter()
    for w in token_windows:
        w = [bos, *w[1:]] if bos is not None else list(w)
        first, last = scored_positions(len(w))
        logits = model.logits(w, (first, last), step)
        score.add(np.array(logits), np.array(w[first + 1 : last + 1]))
    return score, time.perf_counter() - started


def _score_in_child(
    model_dir: Path, stages: int, token_windows: list[list[int]], bos: int | None, step: int
) -> tuple[Score, float]:
    """`perplexity` in a fresh process with the runners' environment (OpenBLAS preloaded, their allocator
    settings): the environment is fixed at a process's start, and the reference BLAS is ~10x slower."""
    payload = {"model": str(model_dir), "stages": stages, "windows": token_windows, "bos": bos, "step": step}
    done = subprocess.run(
        [sys.executable, "-m", "shardline.bench.quality"],
        input=json.dumps(payload),
        env=blas.runner_env(os.cpu_count() or 1),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scoring on {stages} stage(s) failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Score(out["nll"], out["nll2"], out["count"]), out["seconds"]


def _child() -> None:
    """`python -m shardline.bench.quality`: one stage count's scoring, request and answer as JSON."""
    req = json.loads(sys.stdin.read())
    staged = StagedModel(Path(req["model"]), int(req["stages"]))
    score, seconds = perplexity(staged, req["windows"], req["bos"], int(req["step"]))
    print(json.dumps({"nll": score.nll, "nll2": score.nll2, "count": score.count, "seconds": seconds}))


def _llama_cpp(gguf: Path | None, text_file: Path, ctx: int, chunks: int | None) -> dict:
    from shardline.bench import llama_cpp

    if gguf is None:
        return {"skipped": "no GGUF source known for this model (pass --gguf)"}
    if llama_cpp.binary("llama-perplexity") is None:
        return {"skipped": llama_cpp.missing_message()}
    try:
        report = llama_cpp.llama_perplexity_report(gguf, text_file, ctx, chunks=chunks)
    except (ValueError, RuntimeError, OSError) as exc:  # a short text, a failed run: said, not fatal
        return {"gguf": gguf.name, "error": str(exc)[:500]}
    return {"gguf": gguf.name, **(report or {})}


def source_gguf(model: str | None, model_dir: Path) -> Path | None:
    """The GGUF the model was imported from (the llama.cpp reference runs on it)."""
    from shardline.bench.engine_references import model_gguf

    return model_gguf(model, model_dir)[0]


def run(
    model: str | None,
    text_file: Path,
    stages: list[int],
    ctx: int = DEFAULT_CTX,
    chunks: int | None = None,
    gguf: Path | None = None,
    prefill_step: int = 128,
    json_path: Path | None = None,
) -> dict:
    from shardline.models.registry import resolve_model

    model_dir = resolve_model(model)
    tokens, bos = tokenize(model_dir, text_file.read_text(encoding="utf-8"))
    token_windows = windows(tokens, ctx, chunks)
    first, last = scored_positions(ctx)
    result: dict = {
        "machine": describe(),
        "model": model_dir.name,
        "text": text_file.name,
        "text_tokens": len(tokens),
        "ctx": ctx,
        "chunks": len(token_windows),
        "tokens_scored": len(token_windows) * (last - first),
        "prefill_step": prefill_step,
        "method": "llama.cpp llama-perplexity's: non-overlapping windows of ctx tokens from empty caches, "
        "BOS first when the tokenizer adds one, the second half of each window scored",
        "engine": "the engine's stages (split_for_stages + load_shard: its attention kernel, input-major "
        "weights, split head) in one process with the runners' environment, in order, in prefill-step "
        "chunks; not runner processes (a runner returns only the last position's logits)",
        "stages": {},
    }
    for s in stages:
        print(f"bench quality: {model_dir.name}, {s} stage(s), {len(token_windows)} windows", file=sys.stderr)
        score, seconds = _score_in_child(model_dir, s, token_windows, bos, prefill_step)
        result["stages"][str(s)] = {
            "ppl": round(score.ppl, 4),
            "ppl_err": round(score.ppl_err, 5),
            "tokens_scored": score.count,
            "seconds": round(seconds, 1),
        }
    result["llama_cpp"] = _llama_cpp(gguf or source_gguf(model, model_dir), text_file, ctx, chunks)
    _print(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['system']}, mlx {m['mlx']}")
    print(
        f"model: {result['model']}; text {result['text']} ({result['text_tokens']} tokens); "
        f"ctx {result['ctx']}, {result['chunks']} windows, {result['tokens_scored']} tokens scored"
    )
    print(f"method: {result['method']}")
    print(f"engine: {result['engine']}")
    for s, r in result["stages"].items():
        print(
            f"  S={s}: ppl {r['ppl']:.4f} +/- {r['ppl_err']:.4f} "
            f"({r['tokens_scored']} tokens, {r['seconds']} s)"
        )
    ref = result["llama_cpp"]
    if "ppl" in ref:
        scored = ref.get("tokens_scored", "?")
        print(f"  llama.cpp ({ref['gguf']}): ppl {ref['ppl']:.4f} +/- {ref['ppl_err']:.4f} ({scored} tokens)")
    else:
        print(f"  llama.cpp: {ref.get('skipped') or ref.get('error')}")


if __name__ == "__main__":
    _child()
