"""A tiny random model for every text architecture file of the installed mlx-lm, and a survey of which run.

Each model comes from its architecture file's own ModelArgs, with the sizes of testing/arch_configs.py
(a few layers, small dims, 4 experts of which 2 route), and random weights from the seed. The survey runs
mlx-lm's own forward with its own `make_prompt_cache` (a prompt, then greedy decode steps) on two builds of
the same seed; a failure is mlx-lm's own error in one line. `python -m shardline.testing.arch_zoo` prints it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import importlib
import io
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from shardline.testing.arch_configs import COMMON, FILL_BY_TYPE, KINDS, OVERRIDES, VOCAB, WRAPPERS

PROMPT = [(7 * i + 3) % 256 + 3 for i in range(20)]  # byte-range ids of the synth tokenizer
DECODE_STEPS = 4
_TYPE_ORDER = ("dict", "list", "tuple", "bool", "float", "int", "str")


@dataclass(frozen=True)
class ArchRow:
    arch: str
    kind: str  # dense, sliding window, MLA, MoE, hybrid-recurrent, SSM (joined with "+"), "?" if not built
    builds: bool
    runs: bool
    reason: str  # mlx-lm's error in one line, "" when it runs


def _models_dir() -> Path:
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def architectures() -> list[str]:
    """Every mlx-lm architecture file with a Model and a ModelArgs, less the vision-language wrappers."""
    found = []
    for path in sorted(_models_dir().glob("*.py")):
        if path.stem not in WRAPPERS and {"Model", "ModelArgs"} <= _top_level_names(path):
            found.append(path.stem)
    return found


def _import(arch: str) -> ModuleType:
    # Some files exit or print when an optional package is missing: keep what they said as the reason.
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            return importlib.import_module(f"mlx_lm.models.{arch}")
    except SystemExit as e:
        raise ImportError(out.getvalue().strip() or f"import exited with {e.code}") from None


def _kind_of(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.lower()
    return next((t for t in _TYPE_ORDER if t in text), "int")


def _text_args(module: ModuleType) -> type | None:
    for name, value in vars(module).items():
        if "Text" in name and dataclasses.is_dataclass(value) and isinstance(value, type):
            return value
    return None


def _fill(args_cls: type, module: ModuleType, common: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for field in dataclasses.fields(args_cls):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if field.name == "model_type":
            continue
        if field.name in common:
            config[field.name] = common[field.name]
        elif field.name == "text_config":
            text = _text_args(module)
            config[field.name] = _fill(text, module, common) if text else dict(common)
        elif required:
            config[field.name] = FILL_BY_TYPE[_kind_of(field.type)]
    return config


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def tiny_config(arch: str, sizes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of `arch`'s tiny model, model_type included; `sizes`: fields by name to set instead
    of COMMON's (a larger model of the same shape, e.g. bench/arch.py's)."""
    module = _import(arch)
    config = {**_fill(module.ModelArgs, module, {**COMMON, **(sizes or {})}), "model_type": arch}
    if isinstance(config.get("text_config"), dict):
        config["text_config"].setdefault("model_type", arch)
    return copy.deepcopy(_merge(config, OVERRIDES.get(arch, {})))  # no list shared with the tables


def build(
    arch: str, seed: int = 0, sizes: Mapping[str, Any] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """`arch`'s tiny model (or of `sizes`, as tiny_config) with weights drawn from `seed`, and its config."""
    module = _import(arch)
    config = tiny_config(arch, sizes)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def write(arch: str, directory: Path, seed: int = 0, sizes: Mapping[str, Any] | None = None) -> Path:
    """An mlx-lm model directory for `arch`: config.json, model.safetensors and a byte-level tokenizer."""
    return save(*build(arch, seed, sizes), directory)


def save(model: nn.Module, config: dict[str, Any], directory: Path) -> Path:
    """`model` (quantized by mlx-lm's quantize_model or not) as an mlx-lm model directory."""
    from shardline.models.synth import SynthSpec, _write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    vocab = int(config.get("vocab_size") or VOCAB)
    context = int(config.get("max_position_embeddings") or COMMON["max_position_embeddings"])
    _write_tokenizer(directory, SynthSpec(vocab=vocab, context=context))
    return directory


def generate(model: nn.Module) -> tuple[list[int], mx.array]:
    """Greedy tokens after PROMPT through mlx-lm's own forward and prompt cache, and the last logits."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)[0, -1]
    tokens: list[int] = []
    for _ in range(DECODE_STEPS):
        if not mx.all(mx.isfinite(logits)).item():
            raise FloatingPointError("logits not finite")
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens, logits


def _flat_caches(model: nn.Module) -> list[Any]:
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    flat: list[Any] = []
    for c in make_prompt_cache(model):
        flat.extend(c.caches if isinstance(c, CacheList) else [c])
    return flat


def kind(arch: str, model: nn.Module) -> str:
    """dense / sliding window / MLA / MoE / hybrid-recurrent / SSM (joined with "+"), from the caches that
    mlx-lm makes for the model and the modules it has."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if arch in KINDS:
        return KINDS[arch]
    caches = _flat_caches(model)
    modules = [m for _, m in model.named_modules()]
    names = {type(m).__name__ for m in modules}
    kinds = []
    if any(isinstance(c, ArraysCache) for c in caches):
        attention = any(isinstance(c, KVCache | RotatingKVCache) for c in caches)
        kinds.append("hybrid-recurrent" if attention else "SSM")
    if any(isinstance(c, RotatingKVCache) for c in caches):
        kinds.append("sliding window")
    if any(hasattr(m, "kv_a_proj_with_mqa") or "MLA" in type(m).__name__ for m in modules):
        kinds.append("MLA")
    if any("Switch" in n or "MoE" in n or "Moe" in n for n in names):
        kinds.append("MoE")
    return "+".join(kinds) or "dense"


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or repr(error)
    return f"{type(error).__name__}: {text}"[:200]


def survey_one(arch: str, seed: int = 0, built: Callable[[str], None] | None = None) -> ArchRow:
    """One architecture's row, in this process (`built` hears its kind once it builds)."""
    try:
        model, _ = build(arch, seed)
        what = kind(arch, model)
        if not _flat_caches(model):
            raise ValueError("the model has no layers (its layer pattern is empty)")
    except Exception as e:
        return ArchRow(arch, "?", False, False, _one_line(e))
    if built:
        built(what)
    try:
        tokens, logits = generate(model)
        again, logits_again = generate(build(arch, seed)[0])
    except Exception as e:
        return ArchRow(arch, what, True, False, _one_line(e))
    if tokens != again or not mx.array_equal(logits, logits_again).item():
        return ArchRow(arch, what, True, False, f"two builds of seed {seed} differ: {tokens} vs {again}")
    return ArchRow(arch, what, True, True, "")


def _survey_here(archs: list[str], seed: int) -> None:
    """The child's side of survey(): one BUILT line once a model builds, one ROW line per architecture."""
    with mx.stream(mx.cpu):
        for arch in archs:
            row = survey_one(arch, seed, built=lambda what, a=arch: _emit("BUILT", [a, what]))
            _emit("ROW", dataclasses.asdict(row))


def _emit(tag: str, payload: object) -> None:
    print(tag, json.dumps(payload), flush=True)


def _survey_children(archs: list[str], seed: int) -> list[ArchRow]:
    """Rows of `archs`, surveyed in child processes: a crash in native code (some architectures corrupt
    the heap) costs that architecture its row, not the survey; the next child goes on after it."""
    rows: list[ArchRow] = []
    while len(rows) < len(archs):
        todo = archs[len(rows) :]
        argv = [sys.executable, "-m", "shardline.testing.arch_zoo", "--seed", str(seed), "--rows", *todo]
        child = subprocess.run(argv, capture_output=True, text=True, check=False)
        built: dict[str, str] = {}
        for line in child.stdout.splitlines():
            tag, _, payload = line.partition(" ")
            if tag == "BUILT":
                arch, what = json.loads(payload)
                built[arch] = what
            elif tag == "ROW":
                rows.append(ArchRow(**json.loads(payload)))
        if len(rows) < len(archs) and child.returncode != 0:
            arch = archs[len(rows)]
            code = child.returncode
            died = signal.Signals(-code).name if code < 0 else f"exit {code}"
            last = (child.stderr.strip().splitlines() or [""])[-1].strip()
            reason = f"the process died ({died}){': ' + last if last else ''}"[:200]
            rows.append(ArchRow(arch, built.get(arch, "?"), arch in built, False, reason))
    return rows


def survey(seed: int = 0) -> list[ArchRow]:
    """For each architecture: whether it builds, and whether mlx-lm runs it deterministically on CPU.

    Two children share the architectures; a failure is surveyed again in a child of its own, so that a
    crash or a heap corrupted by the architecture before it cannot be blamed on it."""
    archs = architectures()
    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(lambda part: _survey_children(part, seed), [archs[0::2], archs[1::2]]))
    rows = {r.arch: r for half in halves for r in half}
    for arch in [a for a in archs if not rows[a].runs]:
        rows[arch] = _survey_children([arch], seed)[0]
    return [rows[a] for a in archs]


def table(rows: list[ArchRow]) -> str:
    lines = [f"{'architecture':<22} {'kind':<32} {'builds':<6} {'runs':<5} reason"]
    for r in rows:
        builds, runs = "yes" if r.builds else "no", "yes" if r.runs else "no"
        lines.append(f"{r.arch:<22} {r.kind:<32} {builds:<6} {runs:<5} {r.reason}")
    built = sum(r.builds for r in rows)
    lines.append(f"found {len(rows)}, build {built}, run {sum(r.runs for r in rows)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Survey mlx-lm's architectures as tiny random models.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", nargs="+", help=argparse.SUPPRESS)  # survey()'s children
    args = parser.parse_args(argv)
    if args.rows:
        _survey_here(args.rows, args.seed)
    else:
        print(table(survey(args.seed)))


if __name__ == "__main__":
    main()
