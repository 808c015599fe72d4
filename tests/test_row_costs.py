"""How the leader sizes its micro-batches: learnt per-stage row costs and the pure choice made from them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardline.runner.row_costs import PRIOR_ROW_SHARE, RowCosts, StageRowCost
from shardline.runner.schedule import micro_batches

pytestmark = pytest.mark.timeout(60)


def linear(per_stage: list[float], per_row: float):  # type: ignore[no-untyped-def]
    return lambda rows: [t * (1 + per_row * (rows - 1)) for t in per_stage]


def test_unequal_stages_run_two_streams_as_one_batch() -> None:
    # The last stage also holds the head: two one-row batches would queue there.
    cost = linear([0.033, 0.045], 0.03)
    assert micro_batches(2, 2, 16, cost, 0.003) == 1


def test_equal_stages_keep_one_batch_per_stage() -> None:
    cost = linear([0.040, 0.040], 0.03)
    assert micro_batches(2, 2, 16, cost, 0.003) == 2
    assert micro_batches(8, 2, 16, cost, 0.003) == 2


def test_costly_rows_split_even_on_unequal_stages() -> None:
    # When every row costs much, halving the rows per batch wins back what queueing loses.
    cost = linear([0.033, 0.045], 0.10)
    assert micro_batches(8, 2, 16, cost, 0.003) == 2


def test_unknown_costs_and_single_stage_take_the_default() -> None:
    assert micro_batches(5, 3, 16, lambda rows: None, 0.0) == 3
    assert micro_batches(2, 3, 16, lambda rows: None, 0.0) == 2
    assert micro_batches(4, 1, 16, linear([0.05], 0.1), 0.0) == 1
    assert micro_batches(0, 2, 16, linear([0.05, 0.05], 0.1), 0.0) == 1


@given(
    streams=st.integers(0, 40),
    stages=st.integers(1, 4),
    max_batch=st.integers(1, 16),
    times=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
    per_row=st.floats(0.0, 1.0),
    rest=st.floats(0.0, 1.0),
)
def test_choice_is_between_one_and_a_batch_per_stage(
    streams: int, stages: int, max_batch: int, times: list[float], per_row: float, rest: float
) -> None:
    k = micro_batches(streams, stages, max_batch, linear(times[:stages], per_row), rest)
    assert 1 <= k <= max(1, min(stages, streams))


def test_stage_cost_is_a_line_through_the_sizes_seen() -> None:
    stage = StageRowCost()
    assert stage.estimate(3) is None
    stage.observe(1, 0.040)
    assert stage.estimate(1) == pytest.approx(0.040)
    assert stage.estimate(3) == pytest.approx(0.040 * (1 + 2 * PRIOR_ROW_SHARE))
    stage.observe(4, 0.055)
    assert stage.estimate(2) == pytest.approx(0.045)
    assert stage.estimate(8) == pytest.approx(0.075)
    # A running mean: one slow step moves it, not all the way.
    stage.observe(1, 0.080)
    assert 0.040 < stage.estimate(1) < 0.080  # type: ignore[operator]


def test_a_cheaper_bigger_step_never_gives_a_negative_slope() -> None:
    stage = StageRowCost()
    stage.observe(1, 0.050)
    stage.observe(4, 0.040)
    assert stage.estimate(16) >= stage.estimate(4)  # type: ignore[operator]


def test_row_costs_learn_every_stage_and_the_rest_only_from_lone_steps() -> None:
    costs = RowCosts.for_stages(2)
    costs.observe(2, [0.03, 0.04], None)
    assert costs.estimate(2) == pytest.approx([0.03, 0.04])
    assert costs.rest_s == 0.0
    costs.observe(2, [0.03, 0.04], 0.075)
    assert costs.rest_s == pytest.approx(0.005)
    costs.observe(2, [0.03], 0.5)  # a trace from a ring of another size: ignored
    assert costs.rest_s == pytest.approx(0.005)
    assert RowCosts.for_stages(2).estimate(1) is None
