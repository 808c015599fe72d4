"""Expert-parallel groups on real runner processes: a MoE model on 2 stages of 2 members, each member
holding half of every layer's experts whole, gives mlx-lm's own tokens (batched too), reports its share of
the experts and the routing it saw; a member SIGKILLed mid-decode or SIGSTOPped mid-prefill is noticed and
every request resumes to the same tokens. One model of each MoE family (plain experts, latent attention with
shared experts, recurrent layers between attention ones) runs in groups; tensor groups of the same model
split every expert by columns instead; a map given by measured routing is the one the runners hold.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import FAST, assert_no_runner_left, wait_for

from shardline.cluster.experts import owners_by_load
from shardline.instance.spec import Fault
from shardline.models.footprint import footprint_from_dir
from shardline.testing import arch_zoo
from shardline.testing.reference import Reference

PROMPTS = [[(7 * i + 3 * k) % 250 + 3 for i in range(20 + k)] for k in range(4)]  # 3 prefill chunks of 8
TOKENS = 24
FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_next")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each family's model directory and mlx-lm's own greedy tokens for every prompt."""
    root = tmp_path_factory.mktemp("experts")
    out = {}
    for arch in FAMILIES:
        path = arch_zoo.write(arch, root / arch)
        ref = Reference(path)
        out[arch] = (path, [ref.greedy(p, TOKENS)[0] for p in PROMPTS])
    return out


def _expert_bytes(engine) -> list[int]:
    return [v.ready.expert_bytes for v in engine.controller.state.views if v.ready is not None]


@pytest.mark.timeout(240)
def test_expert_groups_of_two_stages_batch_report_and_resume_a_killed_member(zoo, start_engine) -> None:
    path, expected = zoo["qwen3_moe"]
    engine = start_engine(path, 2, tp=2, group_kind="expert", **FAST)
    assert len(engine.runner_pids()) == 4
    assert all(p.startswith("generic: ") for p in engine.paths()), engine.paths()
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]  # decoded together
    assert [h.tokens(timeout=60) for h in handles] == expected
    # Each member holds half of its stage's experts: the stage's experts' bytes split evenly.
    fp = footprint_from_dir(path)
    half = sum(fp.expert_bytes) // 4  # two stages of half the layers, each member half of those
    assert _expert_bytes(engine) == [half] * 4
    # The faces report the routing they saw: every token went to `experts_active` experts in every layer.
    beats = {b.slot: b for b in engine.fresh_heartbeats(30)}
    faces = [beats[0], beats[1]]  # slots 0 and 1 are the stages' faces (instance/slots.py)
    routed = [row for face in faces for row in face.routed]
    assert len(routed) == fp.layers and all(len(row) == fp.experts for row in routed)
    assert len({sum(row) for row in routed}) == 1 and sum(routed[0]) > 0
    assert sum(routed[0]) % fp.experts_active == 0
    # A member of the second stage dies mid-decode: noticed, the group re-formed, the same tokens.
    old = engine.runner_pids()
    got: list[int] = []
    killed_at = 0.0
    for tok in engine.submit(PROMPTS[1], max_tokens=TOKENS):
        got.append(tok.token)
        if len(got) == 5:
            killed_at = time.monotonic()
            os.kill(old[3], signal.SIGKILL)
    assert got == expected[1]
    after = [r for r in engine.recoveries if r.detected_at >= killed_at]
    assert after, "the killed member was never noticed"
    assert "stage 1 member 1" in after[0].why, after[0].why
    assert engine.wait_recovered(len(engine.recoveries), 60)
    assert_no_runner_left(old)
    assert _expert_bytes(engine) == [half] * 4  # the same map again


@pytest.mark.timeout(240)
def test_a_member_stopped_mid_prefill_is_noticed_and_the_request_resumes(zoo, start_engine) -> None:
    path, expected = zoo["qwen3_moe"]
    # Slot 2 is stage 0's member 1; its steps: the ring's warm-up, then the prompt's chunks.
    fault = Fault(phase="prefill", action="sigstop", after_steps=3)
    engine = start_engine(path, 2, tp=2, group_kind="expert", faults={2: fault}, **FAST)
    assert engine.submit(PROMPTS[2], max_tokens=TOKENS).tokens(timeout=120) == expected[2]
    wait_for(lambda: engine.recoveries, 60, "the stopped member's recovery")
    assert "stage 0 member 1" in engine.recoveries[0].why, engine.recoveries[0].why
    assert engine.wait_recovered(1, 60)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_each_moe_family_in_expert_groups(zoo, start_engine, arch) -> None:
    path, expected = zoo[arch]
    engine = start_engine(path, 1, tp=2, group_kind="expert", **FAST)
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]
    assert [h.tokens(timeout=60) for h in handles] == expected
    held = _expert_bytes(engine)
    assert held[0] == held[1] == sum(footprint_from_dir(path).expert_bytes) // 2


@pytest.mark.timeout(240)
def test_tensor_groups_split_every_expert_by_columns(zoo, start_engine) -> None:
    path, expected = zoo["qwen3_moe"]
    engine = start_engine(path, 1, tp=2, group_kind="tensor", **FAST)
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]
    assert [h.tokens(timeout=60) for h in handles] == expected
    held = _expert_bytes(engine)
    assert held[0] == held[1] == sum(footprint_from_dir(path).expert_bytes) // 2  # half of every expert


@pytest.mark.timeout(240)
def test_a_map_by_measured_routing_is_the_map_the_members_hold(zoo, start_engine) -> None:
    path, expected = zoo["qwen3_moe"]
    fp = footprint_from_dir(path)
    # Experts 0 and 1 hot in every layer: contiguous blocks would give both to member 0.
    load = [[100.0, 90.0] + [1.0] * (fp.experts - 2) for _ in range(fp.layers)]
    engine = start_engine(path, 1, tp=2, group_kind="expert", expert_load=load, **FAST)
    spread = owners_by_load(load[0], 2)
    assert spread[0] != spread[1]
    assert engine.expert_owners == [[spread] * fp.layers]
    handles = [engine.submit(p, max_tokens=TOKENS) for p in PROMPTS]
    assert [h.tokens(timeout=60) for h in handles] == expected
