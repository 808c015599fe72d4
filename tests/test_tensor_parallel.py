"""Tensor-parallel stages: member slices compute the whole layer, groups match single-process mlx-lm, and a
group member that stops, dies or is cut off fails its stage within the step deadline, never a hang."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import STEP, assert_no_runner_left, random_prompt, runner_pids, wait_for

from shardline.compute import tensor_parallel
from shardline.compute.shard import load_shard
from shardline.models.synth import SynthSpec, write_synth_model
from shardline.testing.reference import Reference
from shardline.testing.tiny import make_tiny_model

MAX_TOKENS = 8


class _ThreadSum:
    """Two members in one process, summing through a barrier in member order (as the group link does)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list[np.ndarray | None] = [None] * size

    def reduce(self, member: int) -> Callable[[mx.array], mx.array]:
        def call(x: mx.array) -> mx.array:
            mx.eval(x)
            self.parts[member] = np.array(x)
            self.barrier.wait(timeout=30)
            total = self.parts[0].copy()
            for p in self.parts[1:]:
                total += p
            self.barrier.wait(timeout=30)
            return mx.array(total)

        return call

    def gather(self, member: int) -> Callable[[mx.array], mx.array]:
        def call(x: mx.array) -> mx.array:
            mx.eval(x)
            self.parts[member] = np.array(x)
            self.barrier.wait(timeout=30)
            whole = np.concatenate(self.parts, axis=-1)
            self.barrier.wait(timeout=30)
            return mx.array(whole)

        return call


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic llama with its own output head (which splits by vocabulary rows), 4-bit."""
    spec = SynthSpec(
        layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=512, bits=4, dtype="float32"
    )
    return write_synth_model(tmp_path_factory.mktemp("untied") / "m", spec)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2-q8g32", "untied-q4"])
def test_member_slices_sum_to_the_whole_layer(tiny_models, tiny_quantized_models, untied, arch):
    model = untied if arch == "untied-q4" else tiny_quantized_models.get(arch) or tiny_models[arch]
    whole = load_shard(model)
    size = 2
    members = [load_shard(model, member=r, group=size) for r in range(size)]
    sums = _ThreadSum(size)
    for r, shard in enumerate(members):
        shard.join_group(sums.reduce(r), sums.gather(r))
    split = "lm_head" in whole.model
    assert members[1].vocab_split == split  # an untied head splits by vocabulary rows
    # Each member holds its share of the heads: half the KV cache, half the attention and MLP weights.
    attn = members[1].layers[0].self_attn
    assert attn.n_heads * size == whole.layers[0].self_attn.n_heads
    assert members[1].weight_bytes() < 0.75 * whole.weight_bytes()
    ref_cache = whole.make_cache(STEP)
    caches = [s.make_cache(STEP) for s in members]
    out: list[mx.array | None] = [None] * size
    for x in (mx.array([random_prompt(2 * STEP + 5, seed=3)]), mx.array([[5]]), mx.array([[9]])):
        want = whole.forward(x, ref_cache)

        def run(r: int, x: mx.array = x) -> None:
            out[r] = members[r].forward(x, caches[r])
            mx.eval(out[r])

        threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        got = out[0]
        assert got is not None and got.shape == want.shape  # the face computes the head
        assert out[1] is not None  # a member stops at the layers, or at its rows of a split head
        # (in-process, the gather hands every member the whole logits)
        assert out[1].shape[-1] == (want.shape[-1] if split else whole.hidden_size)
        rel = float(mx.abs(got - want).max() / mx.abs(want).max())
        assert rel < (2e-3 if "-q" in arch else 1e-4), f"logits differ by {rel:.2e} relative"
        assert int(mx.argmax(got)) == int(mx.argmax(want))


def test_a_model_that_does_not_split_is_refused_with_the_reason(tiny_models):
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "hidden_size": 64}
    with pytest.raises(tensor_parallel.GroupSumError, match="KV heads do not split into 4"):
        tensor_parallel.check_split(config, 4)
    tensor_parallel.check_split(config, 2)
    config["quantization"] = {"group_size": 64, "bits": 4}
    with pytest.raises(tensor_parallel.GroupSumError, match="split quantization groups of 64"):
        tensor_parallel.check_split(config, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stages", "tp"), [(1, 2), (2, 2)])
def test_groups_match_single_process(tiny_models, start_engine, stages, tp):
    model = tiny_models["qwen3"]
    ref = Reference(model)
    engine = start_engine(model, stages, tp=tp)
    assert len(runner_pids(engine)) == stages * tp
    for i, n in enumerate([1, STEP + 1, 3 * STEP + 7]):
        prompt = random_prompt(n, seed=40 + i)
        expected, margins = ref.greedy(prompt, MAX_TOKENS)
        assert min(margins) > 1e-3, f"reference has a near-tied logit (margins {margins})"
        handle = engine.submit(prompt, max_tokens=MAX_TOKENS, want_logits=True)
        got = list(handle)
        assert [t.token for t in got] == expected, f"prompt length {n}"
        want = ref.last_logits(prompt)
        rel = float(mx.abs(got[0].logits - want).max() / mx.abs(want).max())
        assert rel < 1e-4, f"prompt length {n}: last logits differ by {rel:.2e} relative"
    # A prompt again: it starts after the blocks the first run sealed, on every member, with the same text.
    prompt = random_prompt(3 * STEP + 7, seed=42)
    again = engine.submit(prompt, max_tokens=MAX_TOKENS)
    assert again.tokens(timeout=120) == ref.greedy(prompt, MAX_TOKENS)[0]
    assert again.cached_tokens == 3 * STEP
    # Concurrent requests (batched decode rows) through the groups too.
    prompts = [random_prompt(5 + 11 * k, seed=70 + k) for k in range(3)]
    handles = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    assert [h.tokens(timeout=120) for h in handles] == [ref.greedy(p, MAX_TOKENS)[0] for p in prompts]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("action", "phase"),
    [("sigstop", "decode"), ("sigkill", "decode"), ("sigstop", "prefill"), ("sigkill", "prefill")],
)
def test_a_group_member_lost_mid_step_is_named_and_recovered(tiny_models, start_engine, action, phase):
    """Member 1 of stage 0's group (runner slot 1 on one stage) stops or dies in a step: the face's sum
    waits at most the step deadline (a kill breaks the stream at once), the stage fails, the instance is
    rebuilt, and the request ends with the text it would have had."""
    from shardline.instance.spec import Fault

    model = tiny_models["llama"]
    ref = Reference(model)
    prompt = random_prompt(3 * STEP + 9, seed=5)
    expected, _ = ref.greedy(prompt, 12)
    # The ring's warm-up makes two prefill steps: the fault fires in the request's third chunk, or its
    # first decode step.
    fault = Fault(phase=phase, action=action, after_steps=4)
    engine = start_engine(model, 1, tp=2, faults={1: fault})
    first, generation = runner_pids(engine), engine.generation
    assert engine.submit(prompt, max_tokens=12).tokens(timeout=120) == expected
    assert engine.wait_recovered(1, timeout=60)
    failure = engine.recoveries[0]
    assert failure.generation == generation  # the request's generation failed, not its warm-up
    print(f"\n{action} {phase}: {failure.why}")
    # Named: the face's sum wait (or the stream's end) names the member, or the member's silence does.
    assert "stage 0 member 1 (runner 1)" in failure.why, failure.why
    assert_no_runner_left(first)
    wait_for(lambda: len(runner_pids(engine)) == 2, 30, "the rebuilt group")


def test_group_key_lives_under_its_generation():
    from shardline.dataplane.group import group_key
    from shardline.dataplane.transport import Keys

    assert group_key(Keys("i1", 7), 2) == f"{Keys('i1', 7).root}/group/2"


@pytest.mark.timeout(300)
def test_an_8k_prompt_in_chunks_through_a_group_matches_single_process(tmp_path, start_engine):
    model = make_tiny_model(tmp_path / "long", "llama", context=16384)
    ref = Reference(model)
    prompt = random_prompt(8 * 1024 + 5, seed=81)
    expected, margins = ref.greedy(prompt, 6)
    assert min(margins) > 1e-3, f"reference has a near-tied logit (margins {margins})"
    engine = start_engine(model, 1, tp=2, prefill_step=512)
    assert engine.submit(prompt, max_tokens=6).tokens(timeout=240) == expected
