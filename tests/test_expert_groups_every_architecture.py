"""Expert-parallel groups of every mixture-of-experts architecture mlx-lm runs: two members loaded with
`load_shard(member=r, group=2, expert_owners=...)`, each holding every other expert of each MoE layer whole
(attention whole), summing their MoE modules' outputs in member order, compute what the whole model
computes; where a model's footprint says an expert group cannot hold it, loading one is refused, so
placement and the runners agree. Tensor groups of MoE models (every expert split by columns) are checked
the same way where attention splits by heads.

The members run in threads of one process (the every-architecture matrix belongs in-process); each thread
loads and runs its member on a stream of its own, as a runner process would. tests/test_expert_groups.py
runs real runner processes for one model of each family.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from test_tensor_parallel import _ThreadSum

from shardline.compute.shard import UnsupportedArchitectureError, load_shard
from shardline.models.footprint import footprint_from_dir
from shardline.testing import arch_zoo

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(21)]
CHUNKS = [PROMPT[i : i + 8] for i in range(0, len(PROMPT), 8)] + [[5], [9]]  # three chunks, two decodes
TOLERANCE = 1e-4  # float32 zoo models: a different order of the same float32 sums


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every zoo architecture whose footprint finds routed experts, written once."""
    root = tmp_path_factory.mktemp("experts")
    found = {}
    for arch in arch_zoo.architectures():
        try:
            path = arch_zoo.write(arch, root / arch)
        except Exception:
            continue  # not buildable here: the architecture matrix reports it
        if not footprint_from_dir(path).experts:
            continue
        try:  # mlx-lm's own forward runs here (muse_spark's needs Metal): the matrix reports the others
            whole = load_shard(path)
            mx.eval(whole.forward(mx.array([PROMPT[:4]]), whole.make_cache(8)))
        except Exception:
            continue
        found[arch] = path
    return found


def _member(
    path: Path, r: int, owners: list[list[int]] | None, heads: bool, sums: _ThreadSum, inq: Any, outq: Any
) -> None:
    try:
        with mx.stream(mx.new_stream(mx.cpu)):  # a runner's own: arrays made here are used here
            m = load_shard(path, member=r, group=2, expert_owners=owners, expert_heads=heads)
            outq.put(m)
            m.join_group(sums.reduce(r), sums.gather(r))
            cache = m.make_cache(8)
            while (ids := inq.get(timeout=120)) is not None:
                y = m.forward(mx.array([ids]), cache)
                mx.eval(y)
                outq.put(y)
    except Exception as exc:  # the test thread reports it
        outq.put(exc)


def _group_error(path: Path, owners: list[list[int]] | None, heads: bool = False) -> str:
    """Run two members against the whole model over CHUNKS: "" when they agree, else what went wrong."""
    whole = load_shard(path)
    sums = _ThreadSum(2)
    ins: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    outs: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    for r in range(2):
        args = (path, r, owners, heads, sums, ins[r], outs[r])
        threading.Thread(target=_member, args=args, daemon=True).start()
    try:
        loaded = [outs[r].get(timeout=120) for r in range(2)]
        if errors := [x for x in loaded if isinstance(x, Exception)]:
            raise errors[0]
        assert loaded[0].path == "generic", loaded[0].path
        ref = whole.make_cache(8)
        for ids in CHUNKS:
            want = whole.forward(mx.array([ids]), ref)
            for q in ins:
                q.put(ids)
            got = [outs[r].get(timeout=120) for r in range(2)]
            if isinstance(got[0], Exception):
                raise got[0]
            rel = float(mx.abs(got[0] - want).max() / mx.abs(want).max())
            if rel > TOLERANCE:
                return f"logits {rel:.1e} away"
        return ""
    finally:
        for q in ins:
            q.put(None)


def _alternate(path: Path) -> list[list[int]]:
    """Every other expert to each member, in every MoE layer: the map placement's spreading makes."""
    fp = footprint_from_dir(path)
    return [[e % 2 for e in range(fp.experts)] if fp.expert_at(i) else [] for i in range(fp.layers)]


@pytest.mark.timeout(900)
def test_every_moe_architecture_runs_in_expert_groups(moe_models: dict[str, Path]) -> None:
    # The kinds placement meets: plain experts, latent attention with shared experts, sinks, hybrids of
    # recurrent layers, ungated shared experts, and a model a group cannot hold.
    kinds = {"qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral", "qwen3_next", "jamba", "nemotron_h"}
    assert kinds | {"longcat_flash"} <= set(moe_models)
    wrong, ran, refused = {}, [], []
    for arch, path in moe_models.items():
        why = footprint_from_dir(path).expert_split
        try:
            error = _group_error(path, _alternate(path))
        except UnsupportedArchitectureError as exc:
            if not why:
                wrong[arch] = f"placement would place it, the runner refuses: {exc}"
            refused.append(arch)
            continue
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
        if why:
            wrong[arch] = f"placement refuses it ({why}), the runner runs it: {error or 'exactly'}"
        elif error:
            wrong[arch] = error
        ran.append(arch)
    assert not wrong, wrong
    assert set(refused) <= {"longcat_flash", "longcat_flash_ngram", "dbrx"}, refused
    assert len(ran) >= 43, (len(ran), ran)


@pytest.mark.timeout(600)
def test_moe_tensor_groups_split_every_expert_by_columns(moe_models: dict[str, Path]) -> None:
    """Tensor groups of MoE models where attention splits by heads: mlx-lm's and exo's way of splitting
    experts, the baseline `bench moe` compares expert groups with."""
    wrong = {}
    for arch in ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "granitemoe"):
        if error := _group_error(moe_models[arch], None):
            wrong[arch] = error
    assert not wrong, wrong


@pytest.mark.timeout(600)
def test_expert_groups_may_split_attention_by_heads_too(moe_models: dict[str, Path]) -> None:
    """The other arrangement of an expert group: attention by heads as well (a sum more a layer, half the
    attention each); latent attention (deepseek_v3), which does not split, stays whole."""
    wrong = {}
    for arch in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next"):
        path = moe_models[arch]
        if error := _group_error(path, _alternate(path), heads=True):
            wrong[arch] = error
    assert not wrong, wrong
