"""Where one decode token's time goes inside a stage, op kind by op kind, for `shardline bench engine`.

A fresh process pinned to one core with one thread (as a pinned stage runs) loads the whole model as one
stage (compute/shard.py `load_shard`, the runners' own code), prefills a prompt, then decodes:
- as a runner does (its forward evaluated once, then its sampling): the stage's real time per token;
- with every op of the decode path timed alone (its inputs evaluated first, then it, then its output): the
  projections by kind, attention, norms, rope, the embedding, the head, and the ops between them ("glue":
  reshapes, splits, the KV append, evaluated as the next timed op's inputs).
MLX builds a graph and evaluates it once per token, so ops evaluated one at a time cost a little more than
in the real forward; `eager_overhead` is that difference, so every millisecond of the real forward is in
one of the parts or in it. The engine's side (a step's time from the runner's heartbeat, the token's from
the stream) adds the runner's own overhead and the transport.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline.compute import blas

PROFILE_TIMEOUT_S = 900
# A plan's callables by what they compute (compute/batched.py DecodePlan); fields not named here are
# reported under their own names.
PRODUCTS = {"qkv": "attn_qkv", "o_proj": "attn_o", "act": "mlp_gate_up_silu", "down": "mlp_down"}
NATIVE = {
    "rms_norm": "norms",
    "add_rms_norm": "norms",
    "rope_bthd": "rope",
    "decode_attention": "attention",
}


def _arrays(value: Any) -> list[Any]:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


class Timer:
    """Milliseconds by op kind over the timed tokens; each op timed alone, its inputs evaluated before."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)

    def wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import mlx.core as mx

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            mx.eval(*_arrays(args), *_arrays(list(kwargs.values())))
            ready = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(*_arrays(out))
            self.ms["glue"] += 1e3 * (ready - start)
            self.ms[kind] += 1e3 * (time.perf_counter() - ready)
            return out

        return timed


class _TimedOps:
    """The native module with its ops timed by kind."""

    def __init__(self, ops: Any, timer: Timer) -> None:
        self._ops, self._timer = ops, timer

    def __getattr__(self, name: str) -> Any:
        return self._timer.wrap(NATIVE.get(name, f"native_{name}"), getattr(self._ops, name))


class _TimedCall:
    """A module whose call is timed, its other attributes its own."""

    def __init__(self, module: Any, timed: Callable[..., Any]) -> None:
        self._module, self._timed = module, timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _instrument(shard: Any, timer: Timer) -> Callable[[bool], None]:
    """A switch between the shard's decode path as it is and with every op timed, so that the two are
    measured token by token in turn (a shared machine's speed drifts)."""
    from shardline.compute import batched

    plain = {k: getattr(shard, k, None) for k in ("plans", "forward", "final_norm", "head", "embed")}
    block = batched.decode_block
    timed: dict[str, Any] = {}
    if plain["plans"] is not None:
        plans = []
        for plan in plain["plans"]:
            if plan is None:
                plans.append(None)
                continue
            fields = {
                f.name: timer.wrap(PRODUCTS.get(f.name, f.name), getattr(plan, f.name))
                for f in dataclasses.fields(plan)
                if f.name != "ops" and callable(getattr(plan, f.name))
            }
            plans.append(dataclasses.replace(plan, ops=_TimedOps(plan.ops, timer), **fields))
        timed = {
            "plans": plans,
            "final_norm": timer.wrap("norms", plain["final_norm"]),
            "head": timer.wrap("head", plain["head"]),
        }
        if plain["embed"] is not None:  # a tied head reads it too (its as_linear, timed under the head)
            timed["embed"] = _TimedCall(plain["embed"], timer.wrap("embed", plain["embed"]))
    # Blocks without a plan run mlx-lm's ops (batched.decode_block): timed whole.
    timed_block = timer.wrap("blocks_mlx_lm_ops", block)
    modules = _module_timers(shard, timer) if plain["plans"] is None else []

    def switch(on: bool) -> None:
        for k, v in timed.items():
            setattr(shard, k, v if on else plain[k])
        batched.decode_block = timed_block if on else block
        for module_switch in modules:
            module_switch(on)

    return switch


MODULES = {
    "q_proj": "attn_qkv",
    "k_proj": "attn_qkv",
    "v_proj": "attn_qkv",
    "o_proj": "attn_o",
    "gate_proj": "mlp_gate_up",
    "up_proj": "mlp_gate_up",
    "down_proj": "mlp_down",
    "input_layernorm": "norms",
    "post_attention_layernorm": "norms",
    "q_norm": "norms",
    "k_norm": "norms",
    "rope": "rope",
    "lm_head": "head",
    "embed_tokens": "embed",
    "norm": "norms",
}


def _module_timers(shard: Any, timer: Timer) -> list[Callable[[bool], None]]:
    """The generic path (the model's own forward): its blocks' projections, norms and rope, its attention
    function, the embedding, final norm and untied head, each timed where the forward calls it. Returns
    a switch for each."""
    import mlx.nn as nn

    switches: list[Callable[[bool], None]] = []
    blocks = list(getattr(shard, "layers", []))
    parents = [m for block in blocks for m in (block, *block.children().values())]
    if (model := getattr(shard, "model", None)) is not None:
        parents += [model, *model.children().values()]
    seen: set[tuple[int, str]] = set()
    for parent in (p for p in parents if isinstance(p, nn.Module)):
        for name, kind in MODULES.items():
            child = parent.get(name)
            if isinstance(child, nn.Module) and (id(parent), name) not in seen:
                seen.add((id(parent), name))
                switches.append(_shadow(parent, name, _TimedCall(child, timer.wrap(kind, child))))
    for module in {sys.modules[type(b).__module__] for b in blocks}:
        if callable(plain := getattr(module, "scaled_dot_product_attention", None)):
            timed = timer.wrap("attention", plain)

            def swap(on: bool, module: Any = module, plain: Any = plain, timed: Any = timed) -> None:
                module.scaled_dot_product_attention = timed if on else plain

            switches.append(swap)
    return switches


def _shadow(parent: Any, name: str, wrapped: Any) -> Callable[[bool], None]:
    """An instance attribute shadows the module's child of that name (nn.Module looks its children up only
    where no attribute is found); removing it leaves the child as it was."""

    def switch(on: bool) -> None:
        if on:
            object.__setattr__(parent, name, wrapped)
        else:
            object.__delattr__(parent, name)

    return switch


def profile(model_dir: Path, context: int, tokens: int, prefill_step: int = 128) -> dict[str, Any]:
    """One decode token at about `context` positions, in milliseconds: the stage's real forward and
    sampling (medians over `tokens` tokens), and the same forward op by op (medians over as many)."""
    import mlx.core as mx

    from shardline.bench.engine_runs import prompt_ids
    from shardline.compute.sampling import SamplingParams, sample
    from shardline.compute.shard import load_shard

    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    shard = load_shard(model_dir)
    cache = shard.make_cache(256)
    prompt = prompt_ids(context, vocab, offset=3)
    for i in range(0, len(prompt), prefill_step):
        logits = shard.forward(mx.array([prompt[i : i + prefill_step]]), cache)
        mx.eval(logits)
    greedy, nucleus = SamplingParams(), SamplingParams(temperature=0.6, top_p=0.9, top_k=40)
    token, pos = sample(logits, greedy, len(prompt), prompt).token, len(prompt)
    timer = Timer()
    switch = _instrument(shard, timer)
    forward, sampling, sampling_top, parts = [], [], [], []
    for i in range(tokens + 2):  # the first two warm up; then the plain forward and the timed one in turn
        start = time.perf_counter()
        logits = shard.forward(mx.array([[token]]), cache)
        mx.eval(logits)
        mid = time.perf_counter()
        token = sample(logits, greedy, pos + 1, prompt[-20:]).token
        end = time.perf_counter()
        sample(logits, nucleus, pos + 1, prompt[-20:])
        sampling_top.append(time.perf_counter() - end)
        forward.append(mid - start)
        sampling.append(end - mid)
        switch(True)
        timer.ms.clear()
        start = time.perf_counter()
        mx.eval(shard.forward(mx.array([[token]]), cache))
        total = 1e3 * (time.perf_counter() - start)
        switch(False)
        if i >= 2:  # "rest": the Python between the timed ops, and what runs after the last of them
            parts.append({**timer.ms, "rest": total - sum(timer.ms.values()), "total": total})
        pos += 2
    kinds = sorted({k for p in parts for k in p})
    ops = {k: round(statistics.median(p.get(k, 0.0) for p in parts), 3) for k in kinds if k != "total"}
    forward_ms = 1e3 * statistics.median(forward[2:])
    eager_ms = statistics.median(p["total"] for p in parts)
    return {
        "path": getattr(shard, "path", "generic"),
        "why_generic": getattr(shard, "why_generic", ""),
        "context": context,
        "forward": round(forward_ms, 3),
        "sampling_greedy": round(1e3 * statistics.median(sampling[2:]), 3),
        "sampling_top_k_top_p": round(1e3 * statistics.median(sampling_top[2:]), 3),
        "ops": ops,
        # What evaluating op by op added over the real forward's one evaluation (negative: it saved).
        "eager_overhead": round(eager_ms - forward_ms, 3),
    }


def measure(model_dir: Path, context: int, tokens: int) -> dict[str, Any]:
    """`profile` in a fresh process on the first core with one thread, as a pinned stage runs."""
    cores = sorted(os.sched_getaffinity(0))[:1] if hasattr(os, "sched_getaffinity") else []
    code = (
        "import os, sys; cores = eval(sys.argv[4]); cores and os.sched_setaffinity(0, cores); "
        "from shardline.bench.engine_profile import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(context), str(tokens), repr(cores)],
        env=blas.runner_env(1),
        capture_output=True,
        text=True,
        timeout=PROFILE_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"decode profile failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_or_reason(model_dir: Path, context: int, tokens: int) -> dict[str, Any]:
    """`measure`, or why it could not: the bench's other figures stand without it."""
    try:
        return measure(model_dir, context, tokens)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        return {"skipped": str(exc)}


def main() -> None:
    # `-c` shifts argv: the values after "-c CODE".
    model_dir, context, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(profile(model_dir, context, tokens)), flush=True)


def token_accounts(result: dict[str, Any], s1_token_ms: float, s1_step_ms: float) -> dict[str, Any]:
    """One decode token on one pinned stage, every millisecond in one place: the engine's token (from the
    stream) = the stage's step (its heartbeat) + transport and the leader's Python; the step = the forward
    + sampling + the runner's own work; the forward = the ops, timed alone, less their eager overhead."""
    if "skipped" in result:
        return result
    return {
        "token": round(s1_token_ms, 3),
        "transport_and_leader": round(s1_token_ms - s1_step_ms, 3),
        "step": round(s1_step_ms, 3),
        "runner_other": round(s1_step_ms - result["forward"] - result["sampling_greedy"], 3),
        **result,
    }
