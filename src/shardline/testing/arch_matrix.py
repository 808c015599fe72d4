"""Every mlx-lm text architecture, sharded: the engine's stages against mlx-lm's own forward.

For each architecture of testing/arch_zoo.py, its tiny random model (constant parameters shaken: `shake`) is
written to a directory once, and:

- the reference is mlx-lm's own `load_model` of that directory, run with its `make_prompt_cache`: the prompt
  in the chunks the stages take (plamo3's own logits depend on them: its sliding mask spans one key more
  than its cache keeps), then DECODE greedy tokens;
- S=1, 2 and 3: stages loaded with `load_shard` (ranges from `split_layers`), chained in this process, the
  prompt prefilled in chunks of CHUNK positions (it crosses two chunk boundaries), then DECODE greedy tokens;
  the tokens must be the reference's, and the logits of every decoded position within TOLERANCE of its;
- batched: the requests of PROMPTS (four lengths), each prefilled alone, then decoded together with
  `forward_rows` for BATCH_DECODE steps on the two stages of S=2 (on one where the architecture is served
  on one stage only), each giving the tokens (and logits) the reference gives it alone;
- resume: those stages again with fresh caches, as a new generation after a failure, replaying the request
  as exact resume does (the prompt in its chunks, then each of the first RESUME_AT emitted tokens as a decode
  step of its own), then decoding on: the reference's remaining tokens and logits. Runner processes killed
  for real resume in tests/test_arch_resume.py, one architecture of each kind.

An architecture mlx-lm itself cannot run here has its error as `refused` and no checks. Children run the
architectures (a native crash costs one row, not the matrix). `python -m shardline.testing.arch_matrix`
prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from shardline.compute.pipeline_limits import PIPELINE_REFUSED
from shardline.testing import arch_zoo

PROMPT = arch_zoo.PROMPT  # 20 ids
CHUNK = 8  # prefill chunk: PROMPT crosses two chunk boundaries
DECODE = 32  # greedy tokens after each prompt
BATCH_DECODE = 8  # the rows' independence shows in a few steps
# Prompts of the batched check: different lengths and ids, PROMPT first.
PROMPTS = [PROMPT] + [[(p * i + 5 * p) % 250 + 3 for i in range(n)] for p, n in ((11, 13), (13, 17), (17, 5))]
# How far a staged logit may be from mlx-lm's own, relative to the spread (max - min) of the reference's
# logits at that position. The same functions computed otherwise (the fast path's native kernels) differ by
# float32 rounding: at most 5e-7 of the spread over the whole matrix; every wrong path seen was off by 7e-2
# or more.
TOLERANCE = 1e-4
RESUME_AT = 5  # tokens emitted before the stages are lost
CHECKS = ("S1", "S2", "S3", "batched", "resume")
OK = "ok"


@dataclass(frozen=True)
class MatrixRow:
    arch: str
    refused: str  # mlx-lm's own error on this machine ("" when its reference runs)
    results: dict[str, str] = field(default_factory=dict)  # check -> OK or what went wrong, in one line
    paths: dict[str, str] = field(default_factory=dict)  # check -> each stage's path, "fast,generic"
    seconds: float = 0.0
    # Why placement makes no tensor-parallel group of it (ModelFootprint.tensor_split; "" when it may)
    tp: str = ""

    def failed(self, check: str) -> bool:
        return not self.refused and self.results.get(check) != OK


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or repr(error)
    return f"{type(error).__name__}: {text}"[:200]


def _greedy(
    step: Callable[[list[int]], mx.array], prompt: list[int], steps: int = DECODE
) -> tuple[list[int], mx.array]:
    """`steps` greedy tokens: `step(ids)` runs ids after what it ran before and returns the last logits; the
    prompt goes in chunks of CHUNK."""
    logits = None
    for i in range(0, len(prompt), CHUNK):
        logits = step(prompt[i : i + CHUNK])
    tokens, seen = [], []
    for _ in range(steps):
        assert logits is not None
        mx.eval(logits)
        seen.append(logits)
        tokens.append(int(mx.argmax(logits).item()))
        if len(tokens) < steps:
            logits = step([tokens[-1]])
    return tokens, mx.stack(seen)


def reference(model: Any, prompt: list[int], steps: int = DECODE) -> tuple[list[int], mx.array]:
    """mlx-lm's own greedy tokens after `prompt` and each decoded position's logits (float32)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return _greedy(lambda ids: model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32), prompt, steps)


def _chain(shards: list[Any], x: mx.array, caches: list[Any], rows: bool) -> mx.array:
    for shard, cache in zip(shards, caches, strict=True):
        x = shard.forward_rows(x, cache) if rows else shard.forward(x, cache)
    # A split tied head: the last stage sends [hidden, upper logits], the first stage completes them.
    return shards[0].finish_head(x) if shards[-1].head_split else x


def staged(shards: list[Any], prompt: list[int]) -> tuple[list[int], mx.array]:
    """Greedy tokens through the stages, the prompt prefilled in chunks of CHUNK."""
    caches = [s.make_cache(CHUNK) for s in shards]
    return _greedy(lambda ids: _chain(shards, mx.array([ids]), caches, rows=False), prompt)


def batched(shards: list[Any], prompts: list[list[int]]) -> list[tuple[list[int], mx.array]]:
    """Each prompt prefilled alone in chunks, then every request decoded together, one row each."""
    caches = [[s.make_cache(CHUNK) for s in shards] for _ in prompts]
    logits = []
    for prompt, cache in zip(prompts, caches, strict=True):
        for i in range(0, len(prompt), CHUNK):
            last = _chain(shards, mx.array([prompt[i : i + CHUNK]]), cache, rows=False)
        logits.append(last)
    by_stage = [[c[j] for c in caches] for j in range(len(shards))]
    tokens: list[list[int]] = [[] for _ in prompts]
    seen: list[list[mx.array]] = [[] for _ in prompts]
    step = mx.stack(logits)
    for n in range(BATCH_DECODE):
        mx.eval(step)
        for r in range(len(prompts)):
            seen[r].append(step[r])
            tokens[r].append(int(mx.argmax(step[r]).item()))
        if n + 1 < BATCH_DECODE:
            step = _chain(shards, mx.array([[t[-1]] for t in tokens]), by_stage, rows=True)
    return [(t, mx.stack(s)) for t, s in zip(tokens, seen, strict=True)]


def resumed(shards: list[Any], prompt: list[int], emitted: list[int]) -> tuple[list[int], mx.array]:
    """Exact resume, as a new generation replays a request: fresh caches, the prompt in its chunks, then each
    of the RESUME_AT tokens emitted before the failure as a decode step of its own; then greedy tokens to
    DECODE in all, with the logits of each."""
    caches = [s.make_cache(CHUNK) for s in shards]

    def step(ids: list[int]) -> mx.array:
        return _chain(shards, mx.array([ids]), caches, rows=False)

    logits = None
    for i in range(0, len(prompt), CHUNK):
        logits = step(prompt[i : i + CHUNK])
    for t in emitted[:RESUME_AT]:
        logits = step([t])
    tokens, seen = [], []
    for _ in range(DECODE - RESUME_AT):
        assert logits is not None
        mx.eval(logits)
        seen.append(logits)
        tokens.append(int(mx.argmax(logits).item()))
        if len(tokens) < DECODE - RESUME_AT:
            logits = step([tokens[-1]])
    return tokens, mx.stack(seen)


def compare(got: tuple[list[int], mx.array], want: tuple[list[int], mx.array]) -> str:
    """OK, or how far the logits are (up to where the tokens part: after it the inputs differ), or where."""
    tokens, logits = got
    ref_tokens, ref_logits = want
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens))
    n = min(same + 1, len(tokens))  # the position that chose differently is compared too
    spread = mx.max(ref_logits[:n], axis=-1) - mx.min(ref_logits[:n], axis=-1)
    gap = mx.max(mx.abs(logits[:n] - ref_logits[:n]), axis=-1) / mx.maximum(spread, 1e-12)
    worst = float(mx.max(gap).item())
    if not worst <= TOLERANCE:  # NaN fails too
        at = int(mx.argmax(gap).item()) if worst == worst else -1
        return f"logits {worst:.1e} of their spread away at decoded position {at}"
    if same < len(tokens):
        return f"token {same} is {tokens[same]}, mlx-lm's {ref_tokens[same]} (logits within tolerance)"
    return OK


def shake(model: Any, seed: int) -> None:
    """Give every float parameter that init left constant (norm weights of 1, biases of 0, scales) values
    of its own, so that a path which skips one (a norm's weight, gemma's 1 + weight) cannot agree."""
    from mlx.utils import tree_flatten, tree_unflatten

    changed = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        if not mx.issubdtype(v.dtype, mx.floating) or v.size == 0 or mx.any(v != v.flatten()[0]).item():
            continue
        noise = mx.random.normal(v.shape, key=mx.random.key(seed * 100_003 + i)).astype(v.dtype)
        changed.append((name, v * (1 + 0.1 * noise) if v.flatten()[0].item() else 0.02 * noise))
    model.update(tree_unflatten(changed))
    mx.eval(model.parameters())


def write(arch: str, directory: Path, seed: int = 0) -> Path:
    """arch_zoo.write's model directory, its constant parameters shaken (`shake`)."""
    from mlx.utils import tree_flatten

    from shardline.models.synth import SynthSpec, _write_tokenizer

    model, config = arch_zoo.build(arch, seed)
    shake(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(directory, SynthSpec(vocab=arch_zoo.VOCAB, context=256))
    return directory


def _layers(model: Any) -> int:
    from shardline.compute.generic import layer_list

    try:
        return len(layer_list(model))
    except ValueError:
        return len(model.layers)


def run_arch(arch: str, workdir: Path, seed: int = 0, tell: Callable[[str], None] = print) -> MatrixRow:
    """One architecture's row, in this process (`tell` hears each check's name before it runs)."""
    from mlx_lm.utils import load_model

    from shardline.compute.shard import load_shard, split_layers

    started = time.perf_counter()
    # load_shard collects garbage once per stage: what lived before this row need not be walked each time.
    gc.collect()
    gc.freeze()
    directory = workdir / arch
    tell("reference")
    try:
        if not (directory / "config.json").exists():
            write(arch, directory, seed)
        model, _ = load_model(directory)
        total = _layers(model)
        want = reference(model, PROMPT)
        alone = [reference(model, p, BATCH_DECODE) for p in PROMPTS]
    except Exception as e:
        return MatrixRow(arch, _one_line(e), seconds=time.perf_counter() - started)
    results, paths = {}, {}
    loaded: dict[int, list[Any]] = {}
    for stages in (1, 2, 3):
        check = f"S{stages}"
        tell(check)
        try:
            shards = [load_shard(directory, r) for r in split_layers(total, stages)]
            paths[check] = ",".join(s.path for s in shards)
            loaded[stages] = shards
            results[check] = compare(staged(shards, PROMPT), want)
        except Exception as e:
            results[check] = _one_line(e)
    # The stages of S=2 again, with caches of their own (or of S=1 where the model is served on one stage).
    stages = 1 if arch in PIPELINE_REFUSED else 2
    tell("batched")
    try:
        shards = loaded.get(stages) or [load_shard(directory, r) for r in split_layers(total, stages)]
        paths["batched"] = ",".join(s.path for s in shards)
        got = batched(shards, PROMPTS)
        wrong = [f"request {i}: {compare(g, w)}" for i, (g, w) in enumerate(zip(got, alone, strict=True))]
        results["batched"] = next((w for w in wrong if not w.endswith(f": {OK}")), OK)
    except Exception as e:
        results["batched"] = _one_line(e)
    # The same stages as a new generation would hold them: a resume replays the request into fresh caches.
    tell("resume")
    try:
        shards = loaded.get(stages) or [load_shard(directory, r) for r in split_layers(total, stages)]
        paths["resume"] = ",".join(s.path for s in shards)
        after = (want[0][RESUME_AT:], want[1][RESUME_AT:])
        results["resume"] = compare(resumed(shards, PROMPT, want[0]), after)
    except Exception as e:
        results["resume"] = _one_line(e)
    from shardline.models.footprint import footprint_from_dir

    tp = footprint_from_dir(directory).tensor_split
    return MatrixRow(arch, "", results, paths, time.perf_counter() - started, tp)


def _emit(tag: str, payload: object) -> None:
    print(tag, json.dumps(payload), flush=True)


def _rows_here(archs: list[str], seed: int) -> None:
    """A child's side of matrix(): a STEP line before each check, a ROW line per architecture."""
    mx.set_default_device(mx.cpu)
    with tempfile.TemporaryDirectory(prefix="arch-matrix-") as tmp:
        for arch in archs:
            row = run_arch(arch, Path(tmp), seed, tell=lambda check, a=arch: _emit("STEP", [a, check]))
            _emit("ROW", dataclasses.asdict(row))


def _children(archs: list[str], seed: int) -> list[MatrixRow]:
    """Rows of `archs` from child processes; one that dies (native code can corrupt its heap) costs the
    check it was in, and the next child goes on after that architecture."""
    rows: list[MatrixRow] = []
    while len(rows) < len(archs):
        todo = archs[len(rows) :]
        argv = [sys.executable, "-m", "shardline.testing.arch_matrix", "--seed", str(seed), "--rows", *todo]
        child = subprocess.run(argv, capture_output=True, text=True, check=False)
        step = ""
        for line in child.stdout.splitlines():
            tag, _, payload = line.partition(" ")
            if tag == "STEP":
                step = json.loads(payload)[1]
            elif tag == "ROW":
                rows.append(MatrixRow(**json.loads(payload)))
        if len(rows) < len(archs) and child.returncode != 0:
            code = child.returncode
            died = signal.Signals(-code).name if code < 0 else f"exit {code}"
            last = (child.stderr.strip().splitlines() or [""])[-1].strip()
            reason = f"the process died ({died}){': ' + last if last else ''}"[:200]
            arch = archs[len(rows)]
            if step in ("", "reference"):
                rows.append(MatrixRow(arch, reason))
            else:  # the checks after the one it died in did not run
                done = CHECKS.index(step)
                results = {c: reason if i == done else "not run" for i, c in enumerate(CHECKS) if i >= done}
                rows.append(MatrixRow(arch, "", results))
    return rows


def matrix(archs: list[str] | None = None, seed: int = 0, workers: int = 2) -> list[MatrixRow]:
    """Every architecture's row (arch_zoo.architectures() by default), surveyed by `workers` children."""
    archs = archs or arch_zoo.architectures()
    parts = [archs[i::workers] for i in range(workers) if archs[i::workers]]
    with ThreadPoolExecutor(len(parts)) as pool:
        found = {r.arch: r for part in pool.map(lambda p: _children(p, seed), parts) for r in part}
    return [found[a] for a in archs]


def _cell(row: MatrixRow, check: str) -> str:
    if row.refused:
        return "-"
    if row.results.get(check) != OK:
        return "FAIL"
    letters = "".join(p[0] for p in row.paths.get(check, "").split(","))  # f(ast) or g(eneric) per stage
    return letters + (" (S1)" if check in ("batched", "resume") and len(letters) == 1 else "")


def table(rows: list[MatrixRow]) -> str:
    """One line per architecture: each check's path per stage (f: fast, g: generic), FAIL, or - where mlx-lm
    itself does not run it; the reason; and the counts."""
    checks = " ".join(f"{c:<{w}}" for c, w in zip(CHECKS, (4, 4, 4, 8, 8), strict=True))
    lines = [f"{'architecture':<22} {checks} {'TP':<3} {'s':>4}  reason"]
    for r in rows:
        reason = r.refused or next((f"{c}: {r.results[c]}" for c in CHECKS if r.failed(c)), "")
        if not reason and r.arch in PIPELINE_REFUSED:
            reason = f"one stage only: {PIPELINE_REFUSED[r.arch]}"
        cells = [f"{_cell(r, c):<{w}}" for c, w in zip(CHECKS, (4, 4, 4, 8, 8), strict=True)]
        tp = "-" if r.refused else ("no" if r.tp else "yes")
        lines.append(f"{r.arch:<22} {' '.join(cells)} {tp:<3} {r.seconds:>4.1f}  {reason}")
    ran = [r for r in rows if not r.refused]
    one = [r for r in ran if not any(r.failed(c) for c in ("S1", "batched", "resume"))]
    piped = [r for r in one if not r.failed("S2") and not r.failed("S3")]
    groups = [r for r in piped if not r.tp]
    lines.append(
        f"found {len(rows)}; mlx-lm runs {len(ran)}; served on one stage, batched and resumed {len(one)}; "
        f"on 2 and 3 stages too {len(piped)}; in tensor-parallel groups {len(groups)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="mlx-lm architectures as stages, against mlx-lm itself.")
    parser.add_argument("archs", nargs="*", help="architectures (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", nargs="+", help=argparse.SUPPRESS)  # matrix()'s children
    args = parser.parse_args(argv)
    if args.rows:
        _rows_here(args.rows, args.seed)
        return
    started = time.perf_counter()
    print(table(matrix(args.archs or None, args.seed)))
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
