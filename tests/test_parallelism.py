"""Placement's choice between pipeline stages and tensor-parallel groups, from measured quantities."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.bench.tp import BENCH_SPEC
from shardline.cluster.parallelism import ETHERNET_1G, LOOPBACK, Choice, LinkFigures, choose, estimate
from shardline.cluster.placement import NodeCapacity, PlacementRequest, place
from shardline.models.footprint import ModelFootprint, footprint_from_dir
from shardline.models.synth import footprint as synth_footprint

SLOW_LINK = LinkFigures(rtt_s=3e-3, bytes_per_s=30e6)  # a busy Wi-Fi
READ = 10e9  # bytes/s: this machine's single-core read bandwidth, about


def nodes(n: int, gb: float = 8.0) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", int(gb * 1e9), 100.0, READ) for i in range(n)]


def decide(fp: ModelFootprint, count: int, link: LinkFigures, gb: float = 8.0) -> Choice:
    caps = nodes(count, gb)
    request = PlacementRequest()
    return choose(fp, caps, place(fp, caps, request), link, request)


@pytest.mark.parametrize("count", [2, 4])
def test_the_default_model_stays_a_pipeline_with_the_numbers_why(model_dir: Path, count: int):
    fp = footprint_from_dir(model_dir)
    choice = decide(fp, count, LOOPBACK)
    assert choice.group == 1 and choice.stages == count
    # Its 9 heads do not split in two, and even as if they did, the sums would cost what they save.
    grouped = estimate(fp, nodes(count), count // 2, 2, LOOPBACK, PlacementRequest())
    assert not grouped.fits and "do not split 2 ways" in grouped.why_not
    assert grouped.sums_s > 0.3 * grouped.compute_s
    assert "pipeline" in choice.explanation and "ms a token" in choice.explanation


@pytest.mark.parametrize(("count", "shape"), [(2, (1, 2)), (4, (1, 4))])
def test_a_large_model_on_a_fast_link_gets_groups(count: int, shape: tuple[int, int]):
    fp = synth_footprint(BENCH_SPEC)
    choice = decide(fp, count, LOOPBACK)
    assert (choice.stages, choice.group) == shape, choice.explanation
    pipeline, best = choice.candidates[0], min(c.token_s for c in choice.candidates if c.fits)
    assert pipeline.group == 1 and best <= 0.85 * pipeline.token_s
    assert choice.explanation.startswith("groups:")


def test_gigabit_ethernet_still_pays_for_groups_of_a_large_model_but_a_slow_link_does_not():
    fp = synth_footprint(BENCH_SPEC)
    assert decide(fp, 2, ETHERNET_1G).group == 2
    slow = decide(fp, 2, SLOW_LINK)
    assert slow.group == 1 and "sums cost" in slow.explanation


def test_a_small_model_that_splits_stays_a_pipeline_for_its_sums(tiny_models):
    fp = footprint_from_dir(tiny_models["qwen3"])
    choice = decide(fp, 2, LOOPBACK)
    assert choice.group == 1
    grouped = next(c for c in choice.candidates if c.group == 2)
    assert grouped.fits and grouped.sums_s > grouped.compute_s  # possible, and not worth it


def test_groups_must_fit_each_members_memory():
    fp = synth_footprint(BENCH_SPEC)
    request = PlacementRequest()
    kv = fp.kv_bytes_per_token_per_layer * fp.layers * 4096 * request.sequences
    # A node holds a member's half of the layers and the KV, the face the embedding and head besides.
    face = sum(fp.layer_bytes) / 2 + fp.embed_bytes + fp.head_bytes + kv / 2 + request.activation_bytes
    choice = decide(fp, 2, LOOPBACK, gb=face * 1.02 / 1e9)
    assert choice.group == 2, choice.explanation
    # Too small for a member's half of the layers plus the face's embedding and head: no group fits.
    tight = estimate(fp, nodes(2, fp.weight_bytes * 0.3 / 1e9), 1, 2, LOOPBACK, PlacementRequest())
    assert not tight.fits and "offers" in tight.why_not


def test_layers_a_group_does_not_split_keep_the_pipeline_and_say_why():
    # The large model that gets groups above, were its layers experts: the candidates say why not.
    why = "layers hold tensors a tensor-parallel group does not split (mlp.switch_mlp.gate_proj)"
    fp = synth_footprint(BENCH_SPEC).model_copy(update={"tensor_split": why})
    choice = decide(fp, 2, LOOPBACK)
    assert choice.group == 1 and "no group layout fits or splits" in choice.explanation
    assert "1 stage x groups of 2: " in choice.explanation and f"not possible: {why}" in choice.explanation
