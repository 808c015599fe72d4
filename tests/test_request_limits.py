"""One request cannot hurt another: its settings travel once, and what cannot travel fails it alone.

- Steps stay small: a request's settings (logit_bias, its constraint) ride its first step only, and no step
  carries its output so far; the stage that samples holds both (runner/stage.py's Held).
- On an engine whose frames are limited to 16 KiB (SHARDLINE_MAX_HEADER_BYTES, in its runners too): eight
  choices at the largest logit_bias the APIs take and another client's request are all served, and a
  request whose Submit could not fit is refused at submit; the generation never changes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import stub_leader_spec

from shardline.compute.sampling import MAX_LOGIT_BIAS, SamplingParams
from shardline.dataplane import frame
from shardline.dataplane import messages as m
from shardline.errors import RequestTooLargeError
from shardline.runner.leader import Leader
from shardline.runner.stage import Held

FULL_BIAS = tuple((t, 1.5) for t in range(MAX_LOGIT_BIAS))  # the largest logit_bias the APIs accept


class Ring:
    """A one-stage ring: every step is recorded and answered at once, as a sampling stage would: it holds
    each request's settings from its first step and appends what it samples (token 100 + seq % 300). At
    every sampled row, what it holds must be what the leader sent every step before settings travelled
    once: the newest known tokens (repetition penalty) and the output so far (penalties, constraints)."""

    def __init__(self) -> None:
        self.steps: list[m.Step] = []
        self.events: list[Any] = []
        self.held: dict[str, Held] = {}
        self.leader: Leader | None = None
        self.checked = 0

    def compute(self, step: m.Step, x: Any) -> tuple[m.StepResult, None]:
        self.steps.append(step)
        if step.prime is not None:
            self.held[step.request_id] = Held.of(step.prime)
        token = 100 + step.seq % 300
        if step.rows:
            rows = [
                m.RowResult(
                    request_id=r.request_id, token=self._took(r.request_id, token) if r.sample else None
                )
                for r in step.rows
            ]
            return m.StepResult(seq=step.seq, request_id=step.request_id, rows=rows, trace=[0.001]), None
        sampled = self._took(step.request_id, token) if step.sample else None
        return m.StepResult(seq=step.seq, request_id=step.request_id, token=sampled, trace=[0.001]), None

    def _took(self, rid: str, token: int) -> int:
        assert self.leader is not None
        req = self.leader.requests[rid]
        sp, h = req.spec.sampling, self.held[rid]
        assert list(h.context) == (
            req.known[-sp.repetition_context :] if sp.repetition_penalty != 1.0 else []
        )
        assert h.output == (req.known[req.prompt_len - req.spec.index_base :] if sp.needs_output else [])
        self.checked += 1
        h.took(token)
        return token

    def send(self, event: Any, tensor: Any = None) -> None:
        self.events.append(event)


def stub_leader(ring: Ring, max_batch: int) -> Leader:
    spec: Any = stub_leader_spec(
        max_batch=max_batch, in_flight_window=2, watchdog_factor=3.0, load_timeout=10.0, generation=1
    )
    stage: Any = SimpleNamespace(
        kv_bytes_per_token=8, steps=0, release=lambda rid: None, evict=lambda b: None
    )
    inbox: Any = SimpleNamespace(drop=lambda why: None, get_nowait=lambda: None)
    policy: Any = SimpleNamespace(clamp=lambda s: s)
    faults: Any = SimpleNamespace(take_drop=lambda *a: False)
    events: Any = ring
    ring.leader = Leader(
        spec, stage, ring.compute, inbox, None, events, policy=policy, faults=faults, received={}
    )
    return ring.leader


def _submit(leader: Leader, rid: str, seq: int, max_tokens: int, **resumed: Any) -> None:
    sampling = SamplingParams(presence_penalty=0.5, repetition_penalty=1.1, logit_bias=FULL_BIAS)
    prompt = resumed.pop("prompt", list(range(20)))
    spec = m.RequestSpec(request_id=rid, prompt=prompt, max_tokens=max_tokens, sampling=sampling, **resumed)
    leader.handle(SimpleNamespace(message=m.Submit(front="f", seq=seq, request=spec)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("max_batch", [1, 4], ids=["alone", "batched"])
def test_steps_carry_settings_once_and_the_sampler_holds_what_they_carried(max_batch: int) -> None:
    ring = Ring()
    leader = stub_leader(ring, max_batch)
    _submit(leader, "r0", 1, max_tokens=60)
    # Resubmitted after a failure: with the tokens streamed already, replayed (exact) or folded into the
    # prompt (fast); the sampler continues from them.
    _submit(leader, "r1", 2, max_tokens=60, generated=list(range(300, 330)))
    _submit(leader, "r2", 3, max_tokens=45, prompt=list(range(35)), index_base=15)
    leader.act()
    done = [e.request_id for e in ring.events if isinstance(e, m.Finished)]
    assert sorted(done) == ["r0", "r1", "r2"]
    assert ring.checked == 60 + 30 + 45
    firsts = [s for s in ring.steps if s.prime is not None]
    assert sorted(s.request_id for s in firsts) == ["r0", "r1", "r2"]
    assert all(s.pos == 0 and s.prime.sampling.logit_bias == FULL_BIAS for s in firsts)  # type: ignore[union-attr]
    rest = [s for s in ring.steps if s.prime is None]
    if max_batch > 1:
        assert any(s.rows for s in rest)
    sizes = [len(frame.encode(s)) for s in rest]
    # A step is ids, positions and lengths: a few hundred bytes, the same at the 60th token as at the first
    # (the settings alone are several kilobytes; each output token would add a few bytes).
    assert max(sizes) < 400, max(sizes)
    singles = [len(frame.encode(s)) for s in rest if not s.rows and s.sample]
    assert max(singles) - min(singles) <= 4  # the position's digits


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> int:
    """Frames of at most 16 KiB, here and in every runner the engine starts."""
    limit = 16 << 10
    monkeypatch.setenv("SHARDLINE_MAX_HEADER_BYTES", str(limit))
    monkeypatch.setattr(frame, "MAX_HEADER_BYTES", limit)
    return limit


@pytest.mark.timeout(240)
def test_largest_settings_and_an_oversized_request_never_touch_the_generation(
    tiny_models, start_engine, small_frames
):
    engine = start_engine(tiny_models["llama"], 2, max_batch=8)
    generation = engine.generation
    # Eight choices with the largest logit_bias (each once through every stage as settings), and another
    # client's plain request, at once: settings in every step would be 8 x 3 KB, past the frame limit.
    biased = SamplingParams(temperature=1.0, seed=3, presence_penalty=0.3, logit_bias=FULL_BIAS)
    choices = [engine.submit([1, 2, 3, 4], max_tokens=12, sampling=biased) for _ in range(8)]
    other = engine.submit([5, 6, 7], max_tokens=12)
    for h in [*choices, other]:
        assert len(h.tokens(timeout=120)) == 12
    # A Submit that could not fit a frame fails its own request at once, with a typed error.
    with pytest.raises(RequestTooLargeError):
        engine.submit(list(range(500)) * 6, sampling=biased)
    assert len(engine.submit([9, 10], max_tokens=4).tokens(timeout=60)) == 4
    assert engine.generation == generation


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bias",
    [((1, 2.0), (1, -2.0)), ((1, 100.5),), ((-1, 1.0),), tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))],
    ids=["twice", "past-100", "negative", "301-tokens"],
)
def test_settings_refuse_what_the_apis_refuse(bias: tuple[tuple[int, float], ...]) -> None:
    """Every entrance (an engine's callers too), and every stage parsing a first step, holds to the bounds."""
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.mark.timeout(30)
def test_a_submit_dropped_by_a_full_inbox_is_not_counted_as_received() -> None:
    """The leader's beat says which Submits reached it: one its full inbox dropped did not, so the front
    finds it lost (instead of waiting for a request the leader never had)."""
    from conftest import wait_for

    from shardline.dataplane.transport import Inbox, Keys, Outbox, open_session

    session = open_session(["tcp/127.0.0.1:0"], [])
    keys = Keys(f"full-inbox-{id(session)}")
    inbox = Inbox(session, 1, name="leader", capacity=1)
    heard: list[int] = []
    inbox.subscribe(keys.at(1).control, m.CONTROL, "control")
    inbox.watch("control", lambda env: heard.append(env.message.seq), queued_only=True)
    control = Outbox(session, keys.at(1).control, 1)
    try:
        control.wait_matched(10)
        spec = m.RequestSpec(request_id="r", prompt=[1], max_tokens=1)
        for seq in (1, 2):
            control.send(m.Submit(front="f", seq=seq, request=spec))
        wait_for(lambda: inbox.dropped == 1, 10, "the second Submit dropped")
        assert heard == [1]
        assert [e.seq for e in inbox.queued("control")] == [1]
    finally:
        control.close()
        inbox.close()
        session.close()
