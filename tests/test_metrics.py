"""A node's Prometheus metrics (api/metrics.py), without a cluster: what a scrape lists."""

from __future__ import annotations

import pytest

from shardline.api.metrics import Metrics


@pytest.mark.timeout(10)
def test_the_series_of_a_removed_instance_disappear_and_the_others_stay():
    metrics = Metrics(dict)
    for instance in ("gone", "kept"):
        for stage in (0, 1):
            metrics.observe_step(instance, stage, 0.01)
    before = metrics.render().decode()
    assert 'instance="gone",stage="1"' in before and 'instance="kept",stage="0"' in before
    metrics.forget_instance("gone")
    metrics.forget_instance("never-seen")  # nothing to drop: no error
    after = metrics.render().decode()
    assert 'instance="gone"' not in after
    assert 'instance="kept",stage="0"' in after and 'instance="kept",stage="1"' in after
    metrics.observe_step("gone", 0, 0.01)  # placed again under the same name: counted anew
    assert 'shardline_stage_step_seconds_count{instance="gone",stage="0"} 1.0' in metrics.render().decode()
