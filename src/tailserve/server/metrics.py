"""Prometheus metrics of one server (names as in docs/INTERFACES.md), on a per-app CollectorRegistry.

Latency histograms are observed once per finished request from the engine's own timings; engine gauges
and the step histograms (counted by the engine thread, engine/stats.py) are read at scrape time. The
same snapshot is also shown under vLLM's names (the model-server protocol that the Kubernetes inference
gateway's endpoint picker reads). Never uses the global registry, so two apps can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tailserve.config import CacheConfig
from tailserve.engine.request import RequestOutput, SloTarget
from tailserve.engine.stats import (
    LATENCY_BUCKETS_S,
    STEP_KINDS,
    TOKEN_BUCKETS,
    BucketCounts,
    EngineStats,
    StepSnapshot,
)


@dataclass(frozen=True)
class _CounterBaseline:
    """Engine counters at the end of warm-up; subtracted so warm-up never shows in /metrics."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_total: int = 0
    steps: StepSnapshot = field(default_factory=StepSnapshot)
    prefix_cache_collisions: int = 0


# Rank 0's forward per step under tensor parallelism, in two parts: histogram -> (what, StepSnapshot field).
_TENSOR_PARALLEL_HISTOGRAMS = {
    "tailserve_tp_allreduce_seconds": (
        "time per step in collectives (all-reduce, logits gather)",
        "allreduce_s",
    ),
    "tailserve_tp_compute_seconds": ("forward time per step outside collectives", "compute_s"),
}


def _histogram(
    name: str, doc: str, bounds: tuple[float, ...], per_kind: tuple[BucketCounts, ...] | None
) -> Metric:
    """A histogram family labelled by step kind, from counts the engine thread kept."""
    family = HistogramMetricFamily(name, doc, labels=["kind"])
    for kind, counts in zip(STEP_KINDS, per_kind or (), strict=False):
        les = [repr(b) for b in bounds] + ["+Inf"]  # as Histogram prints them: 0.0001, 1.0, 120.0
        family.add_metric([kind], list(zip(les, counts.cumulative(), strict=True)), counts.sum)
    return family


@dataclass(frozen=True)
class ProtocolLabels:
    """What the vLLM-named series say about this server beside the engine snapshot."""

    model_name: str = ""
    cache: CacheConfig = field(default_factory=CacheConfig)


def vllm_protocol_families(s: EngineStats | None, labels: ProtocolLabels, now_s: float) -> list[Metric]:
    """The model-server protocol's series under the names the endpoint picker (EPP) reads by default,
    labelled `model_name` as vLLM labels them. tailserve serves no LoRA adapters: `lora_requests_info`
    is the series vLLM shows with LoRA on and none loaded (both adapter lists empty, which the EPP
    skips without an error), its value the scrape time as vLLM's is a timestamp."""
    model = [labels.model_name]

    def gauge(name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        if s is not None:
            family.add_metric(model, value)
        return family

    total = s.kv_blocks_total if s else 0
    cache_info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "The KV cache's configuration, in labels (value 1); as vLLM's cache_config_info.",
        labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo"],
    )
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "LoRA adapters running and waiting (none: tailserve serves no adapters); value: scrape time.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    if s is not None:
        cc = labels.cache
        cache_info.add_metric(
            [str(cc.block_size), str(total), str(cc.enable_prefix_caching), "sha256_cbor"], 1.0
        )
        lora.add_metric(["0", "", ""], now_s)
    return [
        gauge(
            "vllm:num_requests_waiting",
            "Requests queued in the engine (tailserve_requests_waiting).",
            s.num_waiting if s else 0,
        ),
        gauge(
            "vllm:num_requests_running",
            "Requests being prefilled or decoded (tailserve_requests_running).",
            s.num_running if s else 0,
        ),
        gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use, 0..1 (tailserve_kv_cache_usage_ratio).",
            (s.kv_blocks_used / total) if s and total else 0.0,
        ),
        cache_info,
        lora,
    ]


class _EngineCollector:
    """Reads engine.stats() at scrape time into gauges, counters and the step histograms, and the same
    snapshot into the vLLM-named protocol series."""

    def __init__(
        self, stats: Callable[[], EngineStats], is_ready: Callable[[], bool], protocol: ProtocolLabels
    ) -> None:
        self._stats = stats
        self._is_ready = is_ready
        self._protocol = protocol
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
        steps = s.steps.minus(b.steps) if s else None
        step_paths = CounterMetricFamily(
            "tailserve_steps",
            "Engine steps, by how the model ran: cuda_graph (replayed) or eager.",
            labels=["path"],
        )
        if steps is not None:
            step_paths.add_metric(["cuda_graph"], steps.graph_steps)
            step_paths.add_metric(["eager"], steps.eager_steps)
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
                "tailserve_prefix_cache_collisions",
                "Prefix-cache lookups that found a block's key holding other tokens (a key collision); "
                "that block is never reused.",
                (s.prefix_cache_collisions - b.prefix_cache_collisions) if s else 0,
            ),
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
            _histogram(
                "tailserve_step_duration_seconds",
                "Wall time of one engine step (plan, model, sampling, outputs), by kind.",
                LATENCY_BUCKETS_S,
                steps.duration_s if steps else None,
            ),
            _histogram(
                "tailserve_step_tokens",
                "Tokens computed in one engine step (decodes + prompt chunk tokens), by kind.",
                TOKEN_BUCKETS,
                steps.tokens if steps else None,
            ),
            counter(
                "tailserve_engine_busy_seconds",
                "Seconds the engine spent in steps; rate() is the busy fraction over any window.",
                steps.busy_s_total if steps else 0.0,
            ),
            gauge(
                "tailserve_engine_busy_ratio",
                "Share of wall time the engine spent in steps over the last minute (0..1).",
                steps.busy.ratio(time.monotonic()) if steps else 0.0,
            ),
            *(
                _histogram(
                    name,
                    f"Tensor parallelism: rank 0's {what}, by kind.",
                    LATENCY_BUCKETS_S,
                    getattr(steps, part, None),
                )
                for name, (what, part) in _TENSOR_PARALLEL_HISTOGRAMS.items()
            ),
            step_paths,
            *vllm_protocol_families(s, self._protocol, time.time()),
        ]


class ServerMetrics:
    """Every metric one server exposes, registered on its own registry."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        is_ready: Callable[[], bool],
        protocol: ProtocolLabels | None = None,
    ) -> None:
        """`protocol`: the model name and cache config the vLLM-named series carry."""
        self.registry = CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes and friends: a soak reads RSS growth from here, as from any
        # server on prometheus_client's default registry.
        ProcessCollector(registry=r)

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
        self.held = Counter(
            "tailserve_admission_held",
            "Requests admitted with a hold: queued until a stream is expected to end, since starting at "
            "once would push a stream over its TPOT target (--admission-hold).",
            registry=r,
        )
        # One series per configured SLO class (a bounded set: --slo-classes), met or missed.
        self.slo_requests = Counter(
            "tailserve_slo_requests",
            "Finished requests by SLO class, and whether they met its TTFT and TPOT targets.",
            ["slo_class", "result"],
            registry=r,
        )
        self.admission_correction = Gauge(
            "tailserve_admission_correction",
            "What admission multiplies the engine's TTFT predictions by: the median actual / predicted "
            "TTFT of recent admitted requests that waited (1 until enough have).",
            registry=r,
        )
        self.admission_correction.set(1.0)  # the app reads the live factor (set_function)
        self.errors = Counter(
            "tailserve_request_errors", "Error responses, by HTTP status.", ["status"], registry=r
        )
        self._engine = _EngineCollector(stats, is_ready, protocol or ProtocolLabels())
        r.register(self._engine)
        self._stats = stats

    def exclude_warmup(self) -> None:
        """Start the engine counters from here: what warm-up did is not shown."""
        s = self._stats()
        self._engine.baseline = _CounterBaseline(
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.preemptions_total,
            s.steps,
            s.prefix_cache_collisions,
        )

    def observe_finished(self, out: RequestOutput, slo: SloTarget | None = None) -> None:
        """One finished request: latency histograms from its timings, token counts, finish reason, and
        whether it met its SLO class's targets."""
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
        tpot_s = t.tpot_s
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if slo is not None and t.ttft_s is not None:
            met = slo.ttft_s is None or t.ttft_s <= slo.ttft_s
            met = met and (tpot_s is None or slo.tpot_s is None or tpot_s <= slo.tpot_s)
            self.slo_requests.labels(slo_class=slo.slo_class, result="met" if met else "missed").inc()

    def observe_aborted(self) -> None:
        """A request that ended before finishing (client gone, server stopping)."""
        self.finished.labels(finish_reason="abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
