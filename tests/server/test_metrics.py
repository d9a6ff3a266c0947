"""The engine's step metrics as /metrics shows them: histograms by kind, busy time, graph vs eager,
with warm-up subtracted. No engine: EngineStats built by hand from a StepStats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tailserve.engine.stats import EngineStats, StepStats
from tailserve.server.metrics import ServerMetrics


def _stats(steps: StepStats, graph: int, eager: int) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_blocks_total=10,
        kv_blocks_used=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        preemptions_total=0,
        steps_total=graph + eager,
        steps=steps.snapshot(graph, eager),
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_step_metrics_exclude_warmup_and_split_by_kind_and_path() -> None:
    steps = StepStats(now=0.0)
    counts = {"graph": 0, "eager": 0}
    metrics = ServerMetrics(lambda: _stats(steps, counts["graph"], counts["eager"]), lambda: True)
    steps.record("prefill_only", 40, 0.0, 0.5)  # warm-up: never shown
    counts["eager"] = 1
    metrics.exclude_warmup()
    steps.record("prefill_only", 100, 1.0, 1.25)
    steps.record("decode_only", 3, 2.0, 2.5)
    steps.record("decode_only", 3, 3.0, 3.5)
    counts["eager"], counts["graph"] = 2, 2
    m = _samples(metrics.render().decode())
    kind = (("kind", "decode_only"),)
    assert m[("tailserve_step_duration_seconds_count", kind)] == 2
    assert m[("tailserve_step_duration_seconds_sum", kind)] == 1.0
    assert m[("tailserve_step_duration_seconds_bucket", (*kind, ("le", "0.4")))] == 0
    assert m[("tailserve_step_duration_seconds_bucket", (*kind, ("le", "0.5")))] == 2
    assert m[("tailserve_step_duration_seconds_count", (("kind", "prefill_only"),))] == 1
    assert m[("tailserve_step_duration_seconds_count", (("kind", "mixed"),))] == 0
    assert m[("tailserve_step_tokens_sum", (("kind", "prefill_only"),))] == 100
    assert m[("tailserve_step_tokens_bucket", (("kind", "prefill_only"), ("le", "96.0")))] == 0
    assert m[("tailserve_step_tokens_bucket", (("kind", "prefill_only"), ("le", "128.0")))] == 1
    assert m[("tailserve_engine_busy_seconds_total", ())] == 1.25
    assert m[("tailserve_steps_total", (("path", "cuda_graph"),))] == 2
    assert m[("tailserve_steps_total", (("path", "eager"),))] == 1
    assert 0.0 <= m[("tailserve_engine_busy_ratio", ())] <= 1.0


def test_metrics_carry_the_process_rss_a_soak_reads() -> None:
    """A soak's "RSS growth after warm-up" reads process_resident_memory_bytes from /metrics."""
    metrics = ServerMetrics(lambda: _stats(StepStats(now=0.0), 0, 0), lambda: True)
    m = _samples(metrics.render().decode())
    with open("/proc/self/status") as status:
        vm_rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    rss = m[("process_resident_memory_bytes", ())]
    # The same process measured twice a moment apart: within a factor, not equal (it allocates between).
    assert 0.5 * vm_rss_kib * 1024 < rss < 2.0 * vm_rss_kib * 1024
