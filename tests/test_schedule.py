"""The leader's schedule: a simulated leader drives plan() against a FIFO ring with results arriving late.

The simulation mirrors runner/process.py's Leader: feed() applies the step and queues it, on_result()
decrements in-flight and applies the token unless the request is done, release() pops the request.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.dataplane.messages import RequestSpec
from shardline.runner.schedule import (
    FeedBatch,
    FeedStep,
    LeaderRequest,
    ReleaseRequest,
    apply_step_sent,
    apply_token,
    grown_blocks,
    make_room,
    next_chunk,
    plan,
)

STOP_TOKENS = [0, 1, 2]


def spec(rid: str, prompt: list[int], max_tokens: int, generated: list[int] | None = None) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt=prompt,
        generated=generated or [],
        max_tokens=max_tokens,
        stop_tokens=STOP_TOKENS,
    )


@dataclass
class Trace:
    steps: dict[str, list[FeedStep]] = field(default_factory=dict)
    fed_tokens: dict[str, list[int]] = field(default_factory=dict)
    releases: Counter[str] = field(default_factory=Counter)
    cancelled: set[str] = field(default_factory=set)
    max_in_flight: int = 0
    max_batch: int = 0


def check_step(
    step: FeedStep,
    req: LeaderRequest,
    active: list[LeaderRequest],
    prefill_step: int,
    last_slot: bool,
    batches_full: bool = False,
) -> None:
    """Invariants of one step, checked against the request's state just before it is sent."""
    assert not req.done and not req.released
    assert step.pos == req.fed, "positions must be contiguous: each token fed exactly once, in order"
    assert 1 <= step.n <= prefill_step
    assert step.pos + step.n <= len(req.known), "cannot feed a token that is not known yet"
    if step.pos < req.prompt_len:
        # Prompt chunks are as large as allowed and never run past the prompt into generated tokens.
        assert step.n == min(prefill_step, req.prompt_len - step.pos)
    else:
        assert step.n == 1, "generated tokens (resumed or new) go one at a time"
    assert step.sample == (step.pos + step.n == len(req.known))
    if last_slot:
        # The window's last slot: a ready prefill chunk goes first, so decoding streams cannot starve it.
        assert not req.decoding or all(next_chunk(r, prefill_step) is None for r in active if not r.decoding)
    elif not req.decoding and not batches_full:
        # Otherwise prefill runs only when no decoding stream has a step ready (or may go: every stage
        # has a decode batch already, and ready rows wait to join the next).
        assert all(next_chunk(r, prefill_step) is None for r in active if r.decoding)
    if batches_full:
        assert not req.decoding, "no decode step while every stage has a batch"


def check_batch(batch: FeedBatch, active: list[LeaderRequest], stages: int, max_batch: int) -> None:
    """A batch: decode positions only, each request once, no bigger than its share of the streams."""
    ids = [r.request_id for r in batch.rows]
    assert len(set(ids)) == len(ids) >= 1
    assert all(r.n == 1 for r in batch.rows)
    decoding = sum(r.decoding for r in active)
    assert len(ids) <= min(max_batch, -(-decoding // stages))
    # The least recently served go first: a stream left out was served more recently than every row.
    chosen = set(ids)
    ready = [r for r in active if r.decoding and next_chunk(r, 1) is not None]
    served = [r.last_served for r in ready if r.spec.request_id in chosen]
    left = [r.last_served for r in ready if r.spec.request_id not in chosen]
    assert not left or not served or max(served) <= min(left)


def simulate(
    specs: list[RequestSpec],
    prefill_step: int,
    window: int,
    rnd: random.Random,
    deliver_p: float,
    cancel_p: float,
    stages: int = 1,
    max_batch: int = 1,
) -> tuple[dict[str, LeaderRequest], Trace]:
    pending = deque(specs)
    active: list[LeaderRequest] = []
    everyone: dict[str, LeaderRequest] = {}
    ring: deque[FeedBatch | tuple[FeedStep]] = deque()  # results return in the order steps were sent
    in_flight = tick = arrivals = 0
    next_token = 1000
    trace = Trace()
    budget = 20 * sum(len(s.prompt) + s.max_tokens for s in specs) + 100
    for _ in range(budget):
        if pending and (rnd.random() < 0.3 or (not active and not ring)):
            s = pending.popleft()
            req = LeaderRequest(spec=s, arrival=arrivals)
            arrivals += 1
            active.append(req)
            everyone[s.request_id] = req
            trace.steps[s.request_id] = []
            trace.fed_tokens[s.request_id] = []
        if cancel_p and active and rnd.random() < cancel_p:
            victim = rnd.choice(active)
            if not victim.done:
                victim.done = True
                trace.cancelled.add(victim.spec.request_id)
        deliver = bool(ring) and rnd.random() < deliver_p
        if not deliver:
            batches = sum(1 for rows in ring if isinstance(rows, FeedBatch))
            action = plan(active, in_flight, window, prefill_step, stages, max_batch, batches)
            if isinstance(action, ReleaseRequest):
                req = everyone[action.request_id]
                assert req in active and req.done and req.in_flight == 0
                active.remove(req)
                req.released = True
                trace.releases[action.request_id] += 1
                continue
            if isinstance(action, FeedStep | FeedBatch):
                rows = action.rows if isinstance(action, FeedBatch) else (action,)
                assert in_flight < window
                if isinstance(action, FeedBatch):
                    check_batch(action, active, stages, max_batch)
                for row in rows:
                    req = everyone[row.request_id]
                    check_step(
                        row,
                        req,
                        active,
                        prefill_step,
                        in_flight == window - 1,
                        max_batch > 1 and batches >= stages,
                    )
                    tick += 1
                    apply_step_sent(req, row, tick)
                    trace.steps[row.request_id].append(row)
                    trace.fed_tokens[row.request_id] += req.known[row.pos : row.pos + row.n]
                in_flight += 1
                trace.max_in_flight = max(trace.max_in_flight, in_flight)
                trace.max_batch = max(trace.max_batch, len(rows))
                if isinstance(action, FeedBatch):
                    assert batches < stages  # one batch per stage in flight, at most
                ring.append(action if isinstance(action, FeedBatch) else rows)
                continue
            assert action is None
            if not ring:
                if pending:
                    continue
                break  # nothing to send, nothing in flight, nobody waiting: the leader is idle
            deliver = True
        in_flight -= 1
        out = ring.popleft()
        for step in out.rows if isinstance(out, FeedBatch) else out:
            req = everyone[step.request_id]
            req.in_flight -= 1
            assert req.in_flight >= 0
            if step.sample and not req.done:
                apply_token(req, next_token)
                next_token += 1
    else:
        pytest.fail("simulated leader did not terminate")
    assert not active and not ring and in_flight == 0
    return everyone, trace


@st.composite
def request_specs(draw: st.DrawFn) -> list[RequestSpec]:
    count = draw(st.integers(1, 6))
    out = []
    for i in range(count):
        prompt = draw(st.lists(st.integers(3, 999), min_size=1, max_size=60))
        max_tokens = draw(st.integers(1, 8))
        resumed = draw(st.lists(st.integers(3, 999), max_size=max_tokens - 1)) if draw(st.booleans()) else []
        out.append(spec(f"r{i}", prompt, max_tokens, resumed))
    return out


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=request_specs(),
    prefill_step=st.integers(1, 16),
    window=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    deliver_p=st.floats(0.05, 0.95),
    cancels=st.booleans(),
    stages=st.integers(1, 3),
    max_batch=st.integers(1, 4),
)
def test_simulated_leader(
    specs: list[RequestSpec],
    prefill_step: int,
    window: int,
    seed: int,
    deliver_p: float,
    cancels: bool,
    stages: int,
    max_batch: int,
) -> None:
    reqs, trace = simulate(
        specs,
        prefill_step,
        window,
        random.Random(seed),
        deliver_p,
        0.02 if cancels else 0.0,
        stages,
        max_batch,
    )
    assert trace.max_in_flight <= window
    assert trace.max_batch <= max_batch
    for s in specs:
        rid = s.request_id
        req = reqs[rid]
        assert trace.releases[rid] == 1, "released exactly once"
        assert req.released and req.in_flight == 0
        steps = trace.steps[rid]
        # Tokens fed are exactly the known tokens, in order, each once; the last sampled one is never fed.
        assert trace.fed_tokens[rid] == req.known[: req.fed]
        assert req.known[: len(s.prompt) + len(s.generated)] == [*s.prompt, *s.generated]
        assert [st_.pos for st_ in steps] == [sum(x.n for x in steps[:i]) for i in range(len(steps))]
        samples = sum(x.sample for x in steps)
        if rid in trace.cancelled:
            assert req.generated <= s.max_tokens
            continue
        assert req.generated == s.max_tokens
        assert req.fed == len(req.known) - 1
        # One sampling step per token produced here; resumed tokens are replayed, not sampled again.
        assert samples == s.max_tokens - len(s.generated)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("prompt_len", "generated", "prefill_step", "want"),
    [
        (20, [], 8, [(0, 8, False), (8, 8, False), (16, 4, True)]),
        (16, [], 8, [(0, 8, False), (8, 8, True)]),
        (1, [], 16, [(0, 1, True)]),
        # A resumed request replays its generated tokens one at a time, then samples after the last.
        (5, [7, 8], 8, [(0, 5, False), (5, 1, False), (6, 1, True)]),
        (3, [7], 2, [(0, 2, False), (2, 1, False), (3, 1, True)]),
    ],
)
def test_next_chunk_sequence(
    prompt_len: int, generated: list[int], prefill_step: int, want: list[tuple[int, int, bool]]
) -> None:
    req = LeaderRequest(spec=spec("a", list(range(10, 10 + prompt_len)), 8, generated), arrival=0)
    got = []
    while (step := next_chunk(req, prefill_step)) is not None:
        got.append((step.pos, step.n, step.sample))
        apply_step_sent(req, step, len(got))
    assert got == want
    # After the sampling step nothing more can go until its token is back.
    assert next_chunk(req, prefill_step) is None
    assert apply_token(req, 500) is None
    assert next_chunk(req, prefill_step) == FeedStep("a", req.fed, 1, sample=True)


@pytest.mark.timeout(60)
def test_apply_token_stop_and_length() -> None:
    req = LeaderRequest(spec=spec("a", [5, 6], 2), arrival=0)
    assert apply_token(req, 1) == "stop"
    assert req.done and req.known == [5, 6], "a stop token is not appended"
    req = LeaderRequest(spec=spec("b", [5, 6], 2, [9]), arrival=0)
    assert req.generated == 1
    assert apply_token(req, 10) == "length"
    assert req.done and req.known == [5, 6, 9, 10]


@pytest.mark.timeout(60)
def test_release_waits_for_in_flight_and_comes_first() -> None:
    req = LeaderRequest(spec=spec("a", [5, 6, 7], 4), arrival=0)
    step = plan([req], 0, 2, 8)
    assert isinstance(step, FeedStep)
    apply_step_sent(req, step, 1)
    req.done = True  # cancelled with a step still on the ring
    assert plan([req], 1, 2, 8) is None
    req.in_flight = 0
    # Release is due even when the window is full: it frees state and needs no credit.
    assert plan([req], 5, 2, 8) == ReleaseRequest("a")


@pytest.mark.timeout(60)
def test_decode_before_prefill_and_round_robin() -> None:
    early = LeaderRequest(spec=spec("early", list(range(3, 40)), 4), arrival=0)
    a = LeaderRequest(spec=spec("a", [3], 4, [4]), arrival=1)
    b = LeaderRequest(spec=spec("b", [3], 4, [4]), arrival=2)
    for r, t in ((a, 1), (b, 2)):  # feed the one-token prompts: both are now decoding
        first = next_chunk(r, 8)
        assert first is not None
        apply_step_sent(r, first, t)
        r.in_flight = 0
    reqs = [early, a, b]
    order = []
    for tick in range(3, 20):
        action = plan(reqs, 0, 4, 8)
        if not isinstance(action, FeedStep):
            break
        req = next(r for r in reqs if r.spec.request_id == action.request_id)
        order.append(action.request_id)
        apply_step_sent(req, action, tick)
        req.in_flight = 0  # result back at once
        if action.sample:
            apply_token(req, 100 + tick)
    # Decoding streams alternate (least recently served first) and go before the earlier-arrived prefill;
    # a's third token finishes it, and its release outranks b's next step.
    assert order == ["a", "b", "a", "b", "a"]
    assert action == ReleaseRequest("a")
    assert early.fed == 0


@pytest.mark.timeout(60)
def test_last_slot_goes_to_prefill_so_decoders_cannot_starve_it() -> None:
    decoders = [LeaderRequest(spec=spec(f"d{i}", [3], 50, [4]), arrival=i) for i in range(3)]
    for i, r in enumerate(decoders):
        first = next_chunk(r, 8)
        assert first is not None
        apply_step_sent(r, first, i)
        r.in_flight = 0
    new = LeaderRequest(spec=spec("new", list(range(3, 20)), 4), arrival=9)
    reqs = [*decoders, new]
    # With slots to spare, decoding streams go first ...
    step = plan(reqs, 0, 3, 8)
    assert isinstance(step, FeedStep) and step.request_id == "d0"
    # ... but the last slot takes the waiting prompt, however many streams are decoding.
    step = plan(reqs, 2, 3, 8)
    assert isinstance(step, FeedStep) and step.request_id == "new" and step.pos == 0


# ---- KV as it is used -------------------------------------------------------------------------------------


def test_a_reservation_grows_a_block_at_a_time() -> None:
    assert grown_blocks(covered=16, positions=16, block=8) == 0
    assert grown_blocks(covered=16, positions=17, block=8) == 1
    assert grown_blocks(covered=0, positions=20, block=8) == 3
    assert grown_blocks(covered=24, positions=9, block=8) == 0


def test_out_of_kv_the_newest_goes_back_then_a_lone_one_ends() -> None:
    old = LeaderRequest(spec("old", [5] * 4, 100), arrival=0)
    new = LeaderRequest(spec("new", [5] * 4, 100), arrival=1)
    assert make_room([old, new], "old") == ("preempt", "new")
    assert make_room([old, new], "new") == ("preempt", "new")  # the newest is the one that needs the block
    new.done = True  # preempted, with a step still in flight: its blocks come back with it
    assert make_room([old, new], "old") == ("wait", None)
    new.released = True
    assert make_room([old, new], "old") == ("truncate", "old")
