"""Prometheus metrics of one node's API: what it served, how fast, and what the cluster went through.

Counters and histograms are updated as requests run; gauges (queue depth, running requests) are read from the
fronts when scraped, so they are never stale, and so are the prefix cache's figures from the leaders' beats.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shardline.front.figures import LeaderFigures
from shardline.trust import refusals

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Gauges(Collector):
    def __init__(
        self, read: Callable[[], dict[str, tuple[int, int, int]]], pending: Callable[[], int]
    ) -> None:
        self._read = read
        self._pending = pending

    def collect(self) -> Iterable[Metric]:
        queued = GaugeMetricFamily(
            "shardline_queue_depth", "requests of this node waiting for the instance", labels=["instance"]
        )
        running = GaugeMetricFamily(
            "shardline_running_requests", "requests of this node the instance is running", labels=["instance"]
        )
        held = GaugeMetricFamily(
            "shardline_leader_requests",
            "requests the instance's leader holds, from every node (its last beat)",
            labels=["instance"],
        )
        for instance, (q, r, h) in sorted(self._read().items()):
            queued.add_metric([instance], q)
            running.add_metric([instance], r)
            held.add_metric([instance], h)
        yield from (queued, running, held)
        yield GaugeMetricFamily(
            "shardline_requests_pending",
            "HTTP requests admitted by this node and not yet ended (at --max-pending, more get 429)",
            value=self._pending(),
        )


class _PrefixCache(Collector):
    """Each instance's prefix cache as its leaders' beats tell every front (so every node's traffic), named
    as vLLM's. The totals span generations (front/figures.py): a new leader's count from zero never makes a
    counter go back."""

    def __init__(self, read: Callable[[], dict[str, LeaderFigures]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        queries = CounterMetricFamily(
            "shardline_prefix_cache_queries",
            "prompt tokens the instance's leaders looked up in the prefix cache",
            labels=["instance"],
        )
        hits = CounterMetricFamily(
            "shardline_prefix_cache_hits",
            "prompt tokens the instance's leaders found in the prefix cache (their KV was not computed)",
            labels=["instance"],
        )
        blocks = GaugeMetricFamily(
            "shardline_prefix_cache_blocks",
            "blocks of prompt KV the instance's leader caches now (its last beat)",
            labels=["instance"],
        )
        for instance, f in sorted(self._read().items()):
            queries.add_metric([instance], f.prefix_queries)
            hits.add_metric([instance], f.prefix_hits)
            blocks.add_metric([instance], f.prefix_blocks)
        yield from (queries, hits, blocks)


class _Refusals(Collector):
    """What this process refused from peers (trust/refusals.py), by what and why."""

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "shardline_refused",
            "commands and frames from peers this node refused (outdated term, unauthorised, malformed)",
            labels=["what", "reason"],
        )
        for (what, reason), n in sorted(refusals.counts().items()):
            family.add_metric([what, reason], n)
        yield family


class Metrics:
    def __init__(
        self,
        gauges: Callable[[], dict[str, tuple[int, int, int]]],
        pending: Callable[[], int] = lambda: 0,
        figures: Callable[[], dict[str, LeaderFigures]] = dict,
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "shardline_requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.tokens_in = Counter("shardline_prompt_tokens", "prompt tokens received", ["model"], registry=r)
        self.tokens_out = Counter("shardline_generated_tokens", "tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "shardline_time_to_first_token_seconds",
            "from a request's arrival to its first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shardline_inter_token_latency_seconds",
            "between consecutive tokens of one request",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cluster_events = Counter(
            "shardline_cluster_events",
            "failures, recoveries and other cluster events seen by this node, by kind",
            ["kind"],
            registry=r,
        )
        self.step = Histogram(
            "shardline_stage_step_seconds",
            "one pipeline step's compute time on a stage",
            ["instance", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_Gauges(gauges, pending))
        r.register(_PrefixCache(figures))
        r.register(_Refusals())
        self._lock = threading.Lock()
        self._stages: dict[str, set[str]] = {}  # instance -> stages with a step series

    def observe_step(self, instance: str, stage: int, seconds: float) -> None:
        with self._lock:
            self._stages.setdefault(instance, set()).add(str(stage))
            self.step.labels(instance, str(stage)).observe(seconds)

    def forget_instance(self, instance: str) -> None:
        """A removed instance's series go: a scrape lists only instances that exist, and a cluster that
        places and removes instances for months does not grow its metrics without end."""
        with self._lock:
            for stage in self._stages.pop(instance, set()):
                self.step.remove(instance, stage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
