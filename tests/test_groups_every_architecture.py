"""Tensor-parallel groups of every architecture placement would split: where a model's footprint says its
layers split (`ModelFootprint.tensor_split` empty), two members loaded with `load_shard(member=r, group=2)`
and summing in member order compute what the whole model computes, on the fast path for llama, qwen2 and
qwen3 and on the generic path (the model's own forward over split modules) for the others."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest
from test_tensor_parallel import _ThreadSum

from shardline.compute.shard import load_shard
from shardline.models.footprint import TENSOR_PARALLEL_ARCHITECTURES, footprint_from_dir
from shardline.testing import arch_zoo

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(21)]  # three chunks of 8


@pytest.fixture(scope="module")
def splittable(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every zoo architecture whose footprint allows a group, written once."""
    root = tmp_path_factory.mktemp("groups")
    found = {}
    for arch in arch_zoo.architectures():
        try:
            path = arch_zoo.write(arch, root / arch)
        except Exception:
            continue  # not buildable here: the architecture matrix reports it
        if not footprint_from_dir(path).tensor_split:
            found[arch] = path
    return found


def _run(members: list, caches: list, out: list, r: int, x: mx.array) -> None:
    out[r] = members[r].forward(x, caches[r])
    mx.eval(out[r])


@pytest.mark.timeout(300)
def test_every_splittable_architecture_groups_exactly(splittable: dict[str, Path]) -> None:
    assert {"llama", "qwen3", "granite", "gemma3_text", "cohere2"} <= set(splittable)  # kinds that split
    wrong = {}
    for arch, path in splittable.items():
        whole = load_shard(path)
        members = [load_shard(path, member=r, group=2) for r in range(2)]
        want_path = "fast" if arch in TENSOR_PARALLEL_ARCHITECTURES else "generic"
        assert members[0].path == want_path, (arch, members[0].path, members[0].why_generic)
        sums = _ThreadSum(2)
        for r, m in enumerate(members):
            m.join_group(sums.reduce(r), sums.gather(r))
        ref, caches = whole.make_cache(8), [m.make_cache(8) for m in members]
        chunks = [PROMPT[i : i + 8] for i in range(0, len(PROMPT), 8)] + [[5], [9]]
        for ids in chunks:
            x = mx.array([ids])
            want = whole.forward(x, ref)
            out: list[mx.array | None] = [None, None]
            threads = [threading.Thread(target=_run, args=(members, caches, out, r, x)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert out[0] is not None and out[1] is not None, arch
            rel = float(mx.abs(out[0] - want).max() / mx.abs(want).max())
            if rel > 1e-4:
                wrong[arch] = f"logits {rel:.1e} away"
                break
    assert not wrong, wrong
