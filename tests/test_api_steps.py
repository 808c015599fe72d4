"""The API's record of stage step counts stays bounded however many instances come and go, and the auto-place
query says it wants no second instance."""

from __future__ import annotations

import pytest

from shardline.api.steps import StepCounts
from shardline.cluster import messages as cm


@pytest.mark.timeout(30)
def test_a_new_step_is_observed_once_and_only_for_a_known_stage():
    steps = StepCounts()
    assert not steps.advance("i1", 0, 5)  # first beat: nothing to compare with
    assert steps.advance("i1", 0, 6)
    assert not steps.advance("i1", 0, 6)  # the same beat again
    assert not steps.advance("i1", 0, 4)  # an older one, late
    assert steps.advance("i1", 0, 9)


@pytest.mark.timeout(30)
def test_step_counts_stay_bounded_and_forget_removed_instances():
    steps = StepCounts(limit=64)
    for n in range(10_000):  # instances placed and removed for as long as a node runs
        steps.advance(f"inst-{n}", n % 3, 1)
    assert len(steps) == 64
    assert steps.advance("inst-9999", 9999 % 3, 2)  # the most recent ones are kept
    assert not steps.advance("inst-0", 0, 2)  # the oldest were forgotten
    steps.advance("gone", 0, 1)
    steps.advance("gone", 1, 1)
    steps.forget("gone")
    assert not steps.advance("gone", 0, 2) and len(steps) <= 64


@pytest.mark.timeout(30)
def test_place_if_absent_defaults_off_and_round_trips():
    assert cm.Place(model="m").if_absent is False
    q = cm.Place(model="m", if_absent=True, nonce="n")
    assert cm.QUERY.validate_json(q.model_dump_json()) == q
