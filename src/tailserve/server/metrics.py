"""Prometheus metrics of one server (names as in docs/INTERFACES.md), on a per-app CollectorRegistry.

Latency histograms are observed once per finished request from the engine's own timings; engine gauges
are read at scrape time. Never uses the global registry, so two apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tailserve.engine.request import RequestOutput
from tailserve.engine.stats import EngineStats

_MANTISSAS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.5)
# About 10 buckets per decade from 0.1 ms to 120 s: a P99 read from them is off by at most ~25%.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    *(round(m * 10.0**e, 6) for e in range(-4, 2) for m in _MANTISSAS),
    100.0,
    120.0,
)
TOKEN_BUCKETS: tuple[float, ...] = tuple(
    float(b * 2**e) for e in range(17) for b in (1, 1.5) if float(b * 2**e).is_integer()
)


@dataclass(frozen=True)
class _CounterBaseline:
    """Engine counters at the end of warm-up; subtracted so warm-up never shows in /metrics."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_total: int = 0


class _EngineCollector:
    """Reads engine.stats() at scrape time into gauges and counters."""

    def __init__(self, stats: Callable[[], EngineStats], is_ready: Callable[[], bool]) -> None:
        self._stats = stats
        self._is_ready = is_ready
        self.baseline = _CounterBaseline()

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    def _families(self, s: EngineStats | None) -> list[Metric]:
        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc)
            if s is not None:
                family.add_metric([], value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc)
            if s is not None:
                family.add_metric([], value)
            return family

        b = self.baseline
        total = s.kv_blocks_total if s else 0
        used = s.kv_blocks_used if s else 0
        queries = (s.prefix_cache_queries - b.prefix_cache_queries) if s else 0
        hits = (s.prefix_cache_hits - b.prefix_cache_hits) if s else 0
        return [
            gauge(
                "tailserve_requests_running",
                "Requests being prefilled or decoded.",
                s.num_running if s else 0,
            ),
            gauge("tailserve_requests_waiting", "Requests queued in the engine.", s.num_waiting if s else 0),
            gauge(
                "tailserve_kv_cache_usage_ratio",
                "Fraction of KV blocks in use (0..1).",
                used / total if total else 0.0,
            ),
            gauge("tailserve_kv_blocks_capacity", "KV blocks in the preallocated pool.", total),
            gauge("tailserve_kv_blocks_used", "KV blocks held by requests.", used),
            gauge(
                "tailserve_prefix_cache_hit_rate",
                "Prefix-cache hits / queries, in tokens.",
                hits / queries if queries else 0.0,
            ),
            counter(
                "tailserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries
            ),
            counter("tailserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits),
            counter(
                "tailserve_preemptions",
                "Requests preempted (recompute).",
                (s.preemptions_total - b.preemptions_total) if s else 0,
            ),
            gauge(
                "tailserve_ready",
                "1 when the model is loaded, warmed up and not draining.",
                1.0 if self._is_ready() else 0.0,
            ),
        ]


class ServerMetrics:
    """Every metric one server exposes, registered on its own registry."""

    def __init__(self, stats: Callable[[], EngineStats], is_ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS_S, registry=r)

        self.ttft = latency("tailserve_time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = latency(
            "tailserve_inter_token_latency_seconds", "Gap between consecutive generated tokens."
        )
        self.tpot = latency("tailserve_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1).")
        self.e2e = latency("tailserve_e2e_request_latency_seconds", "Arrival to last generated token.")
        self.queue = latency("tailserve_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = Histogram(
            "tailserve_prompt_tokens", "Prompt tokens per request.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens = Histogram(
            "tailserve_generation_tokens", "Generated tokens per request.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.finished = Counter(
            "tailserve_requests_finished", "Requests finished, by reason.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "tailserve_requests_rejected", "Requests refused by admission control.", ["reason"], registry=r
        )
        self.errors = Counter(
            "tailserve_request_errors", "Error responses, by HTTP status.", ["status"], registry=r
        )
        self._engine = _EngineCollector(stats, is_ready)
        r.register(self._engine)
        self._stats = stats

    def exclude_warmup(self) -> None:
        """Start the engine counters from here: what warm-up did is not shown."""
        s = self._stats()
        self._engine.baseline = _CounterBaseline(
            s.prefix_cache_queries, s.prefix_cache_hits, s.preemptions_total
        )

    def observe_finished(self, out: RequestOutput) -> None:
        """One finished request: latency histograms from its timings, token counts, finish reason."""
        self.finished.labels(finish_reason=out.finish_reason or "abort").inc()
        self.prompt_tokens.observe(out.num_prompt_tokens)
        self.generation_tokens.observe(len(out.token_ids))
        t = out.timings
        if t is None:
            return
        self.queue.observe(t.queue_s)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        if t.e2e_s is not None:
            self.e2e.observe(t.e2e_s)
        times = t.token_times
        for earlier, later in zip(times, times[1:], strict=False):
            self.itl.observe(later - earlier)
        if len(times) > 1 and t.first_token is not None and t.finish is not None:
            self.tpot.observe((t.finish - t.first_token) / (len(times) - 1))

    def observe_aborted(self) -> None:
        """A request that ended before finishing (client gone, server stopping)."""
        self.finished.labels(finish_reason="abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
