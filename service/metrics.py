"""Prometheus metrics: requests by status (499: the client left first), latency, batch sizes,
decisions, queue depth, admission, model jobs run and dropped, and the engine's prefix cache
(hits, misses, tokens reused, evictions, bytes held).

Each app gets its own registry, so several apps in one process (tests) never collide. A
request's route label is the path template of the operation its route serves (the front door
routes it once), so that profile names do not become label values; a request no operation
serves (no such path, or not that method) is "other".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from judge import PrefixCacheStats

if TYPE_CHECKING:
    from service.log.health import ProfileHealth

__all__ = ["ServiceMetrics"]


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Every metric lives in this app's registry (see the module docstring).
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.requests = counter(
            "judge_http_requests",
            "HTTP requests by method, route and status code.",
            ["method", "route", "status"],
        )
        self.latency = histogram(
            "judge_http_request_duration_seconds",
            "Time from request to the end of the response.",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.batch_size = histogram(
            "judge_batch_size",
            "Judgments per coalesced forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.decisions = counter("judge_decisions", "Routing decisions by outcome.", ["decision"])
        self.cascade_decisions = counter(
            "judge_cascade_decisions",
            "Cascade requests by the stage that decided (person: escalated past the last).",
            ["stage"],
        )
        self.cascade_failures = counter(
            "judge_cascade_stage_failures",
            "Cascade stages that failed or ran out of time, by stage and reason code.",
            ["stage", "reason"],
        )
        self.decisions_logged = counter(
            "judge_decisions_logged", "Decisions appended to the decision log."
        )
        self.decision_log_errors = counter(
            "judge_decision_log_errors",
            "Requests refused (503) because the decision log could not be written.",
        )
        self.labels = counter(
            "judge_labels",
            "Labels given for logged decisions, by outcome: labeled, relabeled, unchanged, error.",
            ["outcome"],
        )
        self.queue_depth = gauge("judge_queue_depth", "Jobs waiting for the model.")
        self.admission_waiting = gauge(
            "judge_admission_waiting",
            "Requests waiting at the door for a slot, their bodies unread.",
        )
        self.jobs = gauge(
            "judge_model_jobs",
            "Model jobs since start, by outcome: run, or dropped unrun (client gone, deadline).",
            ["outcome"],
        )

    def watch_prefix_cache(self, stats: Callable[[], PrefixCacheStats]) -> None:
        """Export the engine's prefix-cache counters, read at every scrape."""
        self.registry.register(_PrefixCacheCollector(stats))

    def watch_health(self, health: Callable[[], Sequence[ProfileHealth]]) -> None:
        """Export each profile's health (``service.log.health``), read at every scrape."""
        self.registry.register(_HealthCollector(health))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, method: str, route: str, status: int, start: float) -> None:
        """Count one response (status 499: the client left first) to ``route`` (its operation's
        path template, else "other") and time it from ``start``."""
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - start)


class _PrefixCacheCollector:
    """The cache keeps its own counters; this reads them when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, doc, value in (
            ("hits", "Lookups that reused at least one cached block.", s.hits),
            ("misses", "Lookups that reused nothing.", s.misses),
            (
                "tokens_reused",
                "Prompt tokens read from the cache instead of computed.",
                s.tokens_reused,
            ),
            ("evictions", "Blocks evicted to stay within the budget.", s.evictions),
        ):
            yield CounterMetricFamily(f"judge_prefix_cache_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "judge_prefix_cache_bytes", "Bytes of keys and values held.", value=s.bytes
        )
        yield GaugeMetricFamily(
            "judge_prefix_cache_budget_bytes", "The cache's budget.", value=s.budget_bytes
        )


class _HealthCollector:
    """Each profile's health checks as gauges, labeled by profile (its current version)."""

    def __init__(self, health: Callable[[], Sequence[ProfileHealth]]) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        checks = self._health()

        def family(name: str, doc: str, labels: Sequence[str] = ("profile",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"judge_profile_{name}", doc, labels=list(labels))

        healthy = family("healthy", "1 when no check of the profile's health fired, else 0.")
        alarm = family(
            "alarm",
            "1 when the check fired: precision, drift, prior or model.",
            ("profile", "check"),
        )
        decisions = family("decisions", "Logged decisions of the profile's current version.")
        labeled = family("audited_labeled", "Audited decisions of it that carry a label.")
        precision = family(
            "audited_precision",
            "Precision of audited accepted decisions, and its confidence sequence's bounds "
            "(valid however often read).",
            ("profile", "bound"),
        )
        capital = family(
            "precision_bet",
            "The most the bet against the certified precision has held (starts at 1; the "
            "precision alarm fires at 1/alpha, a false alarm at most alpha over all time).",
        )
        drift = family(
            "drift_p_value",
            "p-value of the drift test of live traffic against the profile's reference.",
            ("profile", "test"),
        )
        for h in checks:
            healthy.add_metric([h.profile], float(h.healthy))
            for check in ("precision", "drift", "prior", "model"):
                alarm.add_metric([h.profile, check], float(check in h.alarms))
            decisions.add_metric([h.profile], h.n_decisions)
            labeled.add_metric([h.profile], h.n_audited_labeled)
            p = h.precision
            if p is not None and p.precision is not None:
                for bound, value in (
                    ("estimate", p.precision),
                    ("lower", p.lower),
                    ("upper", p.upper),
                ):
                    if value is not None:
                        precision.add_metric([h.profile, bound], value)
                if p.max_capital is not None:
                    capital.add_metric([h.profile], p.max_capital)
            d = h.drift
            if d is not None:
                for test, value in (("confidence", d.confidence_p), ("choice", d.choice_p)):
                    if value is not None:
                        drift.add_metric([h.profile, test], value)
        yield from (healthy, alarm, decisions, labeled, precision, capital, drift)
