from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import psutil
import pytest

from shardline.engine.engine import Engine, EngineConfig
from shardline.testing.cluster import FAST_RUNNERS
from shardline.testing.tiny import make_tiny_model, make_tiny_quantized_model

STEP = 8  # prefill step used with tiny models: small, so every chunking edge is cheap to reach
# Short liveness settings, so failures are found (and tests end) in seconds: the ones clusters get too.
FAST = FAST_RUNNERS


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


# MLX-quantized variants as `mlx_lm.convert -q` writes them: name -> (arch, bits, group size, dtype).
QUANTIZED = {
    "llama-q4g64": ("llama", 4, 64, None),
    "qwen2-q8g32": ("qwen2", 8, 32, None),
    "qwen3-q4g128": ("qwen3", 4, 128, None),  # o_proj's 64 inputs are no group of 128: it stays float
    "qwen3-q8g64-bf16": ("qwen3", 8, 64, mx.bfloat16),
}


@pytest.fixture(scope="session")
def tiny_quantized_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-quantized")
    return {
        name: make_tiny_quantized_model(root / name, arch, bits, group, dtype=dtype)
        for name, (arch, bits, group, dtype) in QUANTIZED.items()
    }


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding the tiny llama as `tiny-llama`, as a node's --models-dir."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_models["llama"], root / "tiny-llama")
    return root


def runner_pids(engine: Engine) -> list[int]:
    return engine.runner_pids()


def _running(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_no_runner_left(pids: list[int], within_s: float = 10.0) -> None:
    """Every process is gone, or going: a kill sent by another process lands within `within_s`."""
    deadline = time.monotonic() + within_s
    while (alive := _running(pids)) and time.monotonic() < deadline:
        try:
            psutil.wait_procs([psutil.Process(p) for p in alive], timeout=0.1)
        except psutil.NoSuchProcess:
            pass  # went between the two looks
    assert not alive, f"runner processes left behind: {alive}"


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator:
    started: list[Engine] = []

    def start(model_dir: Path, stages: int, **kw: object) -> Engine:
        kw.setdefault("prefill_step", STEP)
        kw.setdefault("step_timeout", 30.0)
        kw.setdefault("load_timeout", 60.0)
        engine = Engine(EngineConfig(model_dir=model_dir, stages=stages, log_dir=tmp_path / "logs", **kw))
        started.append(engine)
        return engine.start()

    yield start
    for engine in started:
        pids = runner_pids(engine)
        engine.shutdown()
        assert_no_runner_left(pids)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, period: float = 0.05) -> Any:
    """predicate()'s first truthy value; AssertionError naming `what` past the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        threading.Event().wait(period)  # a poll period while waiting on a condition with a deadline
    raise AssertionError(f"{what} not within {timeout:.0f}s")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (imported once)."""
    from shardline.models.registry import resolve_model

    return resolve_model(None, progress=False)


@contextmanager
def serving_cluster(
    root: Path,
    ids: list[str],
    model_dir: Path,
    node_extra: dict[str, list[str]] | None = None,
    key: str | None = None,
) -> Iterator[Any]:
    """A LocalCluster of the default model whose nodes serve HTTP; on exit every runner must be gone."""
    from shardline.testing.cluster import MODEL_RUNNERS, LocalCluster

    c = LocalCluster(root, ids, model_dir.parent, key=key)
    c.runners = dict(MODEL_RUNNERS)
    c.api = True
    c.extra = ["--prefill-step", "64"]
    c.node_extra = node_extra or {}
    c.start()
    try:
        yield c
    finally:
        pids = c.all_pids()
        c.close()
        assert_no_runner_left(pids)


def api_state(api: str) -> dict:
    """A node's /state, or {} while it does not answer."""
    import httpx

    try:
        return httpx.get(api + "/state", timeout=10).json()
    except httpx.TransportError:
        return {}


def place_and_wait_ready(api: str, model: str, nodes: int, timeout: float) -> dict:
    """Once `nodes` are alive, place `model` through the node's HTTP API; its instance record once ready."""
    import httpx

    wait_for(lambda: sum(n["alive"] for n in api_state(api).get("nodes", [])) == nodes, 60, f"{nodes} nodes")
    placed = httpx.post(api + "/instances", json={"model": model}, timeout=120)
    assert placed.status_code == 201, placed.text
    instance = placed.json()["instance"]

    def ready() -> dict | None:
        rec = next((r for r in api_state(api).get("instances", []) if r["instance"] == instance), None)
        return rec if rec and rec["phase"] == "ready" else None

    return wait_for(ready, timeout, "the instance ready")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_dir)


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return [int(t) for t in mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()]


# Short chat prompts for the default model: eight different answers, none of them long.
PROMPTS = [
    "Name the capital of France.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What colour is the sky on a clear day?",
    "Name a famous painting.",
    "How many legs does a spider have?",
]


def stub_leader_spec(**overrides: Any) -> SimpleNamespace:
    """The settings a Leader reads, for leaders driven in-process with a stand-in stage: one stage of one
    layer, no KV budget, prefill steps of 8; `overrides` set what a test cares about."""
    spec = {
        "stages": 1,
        "layer_start": 0,
        "layer_end": 1,
        "layer_total": 1,
        "group": 1,
        "expert_owners": [],
        "expert_heads": False,
        "kv_budget_bytes": 0,
        "max_waiting": 16,
        "prefill_step": 8,
        "prefix_cache": False,
    }
    return SimpleNamespace(**{**spec, **overrides})
