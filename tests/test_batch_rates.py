"""The micro-batch count follows the tokens a second each count really got, not only the cost model."""

from __future__ import annotations

import pytest

from shardline.runner.batch_rates import EXPLORE_EVERY, SEGMENT_RESULTS, BatchRates, CountRate, decide

pytestmark = pytest.mark.timeout(30)


def test_decide_tries_the_predicted_count_first_then_the_others() -> None:
    assert decide({}, [1, 2], predicted=2, segment=0) == 2
    assert decide({2: CountRate(10.0, 0)}, [1, 2], predicted=2, segment=1) == 1


def test_decide_keeps_the_best_measured_and_now_and_then_remeasures_the_stalest() -> None:
    rates = {1: CountRate(12.0, 3), 2: CountRate(10.0, 2)}
    assert decide(rates, [1, 2], predicted=2, segment=4) == 1
    assert decide(rates, [1, 2], predicted=2, segment=EXPLORE_EVERY - 1) == 2
    three = {1: CountRate(5.0, 1), 2: CountRate(9.0, 7), 3: CountRate(8.0, 4)}
    assert decide(three, [1, 2, 3], predicted=3, segment=EXPLORE_EVERY - 1) == 1
    tied = {1: CountRate(10.0, 0), 2: CountRate(10.0, 1)}
    assert decide(tied, [1, 2], predicted=2, segment=2) == 2  # a tie goes to the model's choice


def _run(rates: BatchRates, streams: int, tokens_per_s: dict[int, float], segments: int, now: float) -> float:
    """Feed results as a leader would, each count giving its own rate; returns the clock."""
    start = rates.segments
    while rates.segments < start + segments:
        k = rates.pick(streams, predicted=2, most=2)
        rows = -(-streams // k)
        now += rows / tokens_per_s[k]
        rates.observe(now, rows)
    return now


def test_a_faster_measured_count_wins_over_the_prediction() -> None:
    rates = BatchRates()
    _run(rates, 2, {1: 30.0, 2: 24.0}, segments=2, now=0.0)
    assert set(rates.rates[2]) == {1, 2}
    assert rates.rates[2][1].tokens_per_s == pytest.approx(30.0)
    assert rates.rates[2][2].tokens_per_s == pytest.approx(24.0)
    assert rates.pick(2, predicted=2, most=2) == 1
    # Over many segments the better count runs most of the time.
    before = rates.rates[2][1].last_segment
    _run(rates, 2, {1: 30.0, 2: 24.0}, segments=3 * EXPLORE_EVERY, now=100.0)
    assert rates.rates[2][1].last_segment > before
    assert rates.pick(2, predicted=2, most=2) == 1


def test_a_disturbed_segment_is_not_counted_and_streams_are_kept_apart() -> None:
    rates = BatchRates()
    rates.pick(2, predicted=2, most=2)
    now = 0.0
    for i in range(SEGMENT_RESULTS):
        now += 0.1
        rates.observe(now, 1)
        if i == SEGMENT_RESULTS // 2:
            rates.disturb()  # a prefill chunk went out
    assert rates.segments == 0
    rates.pick(3, predicted=2, most=2)  # another stream count: its own figures
    _run(rates, 3, {1: 20.0, 2: 40.0}, segments=2, now=now)
    assert set(rates.rates) == {3}
    assert rates.pick(3, predicted=1, most=2) == 2


def test_one_stream_is_never_measured() -> None:
    rates = BatchRates()
    assert rates.pick(1, predicted=1, most=1) == 1
    for i in range(4 * SEGMENT_RESULTS):
        rates.observe(float(i), 1)
    assert rates.rates == {} and rates.segments == 0
