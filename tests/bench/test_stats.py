"""Metric math on constructed data: percentiles, per-request metrics, warm-up exclusion, SLOs, goodput."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest

from tailserve.bench.records import RequestRecord, allocate_tokens
from tailserve.bench.stats import (
    SloTargets,
    admission_accuracy,
    assign_phases,
    attribute_slowest,
    nearest_rank,
    slo_verdicts,
    summarize,
    throughput,
    windows,
)
from tailserve.bench.summary import _window_lines, fmt_interval
from tests.bench.conftest import make_record


def test_nearest_rank_matches_the_definition() -> None:
    values = list(range(1, 101))  # 1..100
    assert nearest_rank(values, 50) == 50
    assert nearest_rank(values, 99) == 99
    assert nearest_rank(values, 100) == 100
    assert nearest_rank([7.0], 99) == 7.0
    # 10 values: p99 is rank ceil(9.9) = 10 -> the maximum; p90 is rank 9.
    ten = [float(v) for v in range(10)]
    assert nearest_rank(ten, 99) == 9.0
    assert nearest_rank(ten, 90) == 8.0
    with pytest.raises(ValueError):
        nearest_rank([], 50)


def test_summary_of_a_sharp_tail() -> None:
    values = [0.1] * 98 + [2.0] * 2
    s = summarize(values)
    assert s is not None
    assert s.p50 == 0.1 and s.p90 == 0.1 and s.p95 == 0.1
    assert s.p99 == 2.0 and s.max == 2.0 and s.min == 0.1
    assert s.mean == pytest.approx(0.138)
    assert s.p99_over_mean == pytest.approx(2.0 / 0.138)
    assert summarize([]) is None


def test_summary_carries_an_interval_for_every_percentile() -> None:
    values = [float(v) for v in range(1, 1001)]  # 1..1000
    s = summarize(values)
    assert s is not None and s.ci_level == 0.95
    for q, (lo, hi) in ((50, s.p50_ci), (90, s.p90_ci), (95, s.p95_ci), (99, s.p99_ci)):
        assert lo is not None and hi is not None and lo <= q * 10 <= hi  # the point estimate inside
    # Value k is rank k: ranks binom.ppf(0.025, 1000, 0.5) and binom.ppf(0.975, ...) + 1 (scipy).
    assert s.p50_ci == (469.0, 532.0)
    assert s.p99_over_mean_ci == (s.p99_ci[0] / s.mean, s.p99_ci[1] / s.mean)  # type: ignore[operator]
    wider = summarize(values, ci_level=0.99)
    assert wider is not None and wider.p50_ci[0] < 469.0 and wider.p50_ci[1] > 532.0  # type: ignore[operator]
    few = summarize([0.1] * 22 + [2.0])  # 23 requests: P99 is their maximum, with no upper end
    assert few is not None and few.p99 == 2.0 and few.p99_ci == (0.1, None)


def test_per_request_metrics_follow_the_spec() -> None:
    r = make_record(0, 1.0, ttft_s=0.5, itl_s=0.1, tokens=11)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx(0.1)  # (1.5 - 0.5) / (11 - 1)
    assert r.itl_s() == pytest.approx([0.1] * 10)
    single = make_record(1, 0.0, ttft_s=0.2, itl_s=0.0, tokens=1)
    assert single.tpot_s is None and single.itl_s() == []


def test_itl_splits_a_multi_token_chunk_evenly() -> None:
    r = RequestRecord(0, 0, 0, 9, 10, sent_s=0.0)
    r.chunk_times_s = [0.3, 0.6, 0.9]
    r.chunk_tokens = [3, 3, 3]
    r.output_tokens = 9
    itl = r.itl_s()
    # First chunk: 2 extra tokens arrived with the first one (gap 0); then 0.3 s / 3 tokens each.
    assert itl == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert math.fsum(itl) / len(itl) == pytest.approx(r.tpot_s or 0.0)


def test_allocate_tokens_is_proportional_and_exact() -> None:
    assert allocate_tokens([1, 1, 1], 3) == [1, 1, 1]
    assert allocate_tokens([1, 3, 1], 5) == [1, 3, 1]
    assert allocate_tokens([1, 1, 1, 1], 8) == [2, 2, 2, 2]
    assert sum(allocate_tokens([2, 5, 1, 1], 40)) == 40
    assert allocate_tokens([1, 1, 1], 2) == [1, 0, 1]  # first and last chunk keep TTFT and E2E
    assert allocate_tokens([], 5) == []


def test_warmup_and_cooldown_exclude_by_send_time() -> None:
    records = [make_record(i, sent_s=float(i), ttft_s=0.1, itl_s=0.01, tokens=3) for i in range(10)]
    records[5].error_kind = "cancelled"
    assign_phases(records, warmup_s=2.0, cooldown_s=2.5, send_end_s=9.0)
    phases = [r.phase for r in records]
    # sent 0,1 -> warm-up; sent 7,8,9 > 9 - 2.5 -> cool-down; 5 was cancelled.
    assert phases == [
        "warmup", "warmup", "measured", "measured", "measured",
        "cancelled", "measured", "cooldown", "cooldown", "cooldown",
    ]  # fmt: skip
    # A request that *finishes* after the warm-up but was sent in it stays excluded.
    late = make_record(0, sent_s=1.9, ttft_s=5.0, itl_s=0.1, tokens=3)
    assign_phases([late], warmup_s=2.0, cooldown_s=0.0, send_end_s=10.0)
    assert late.phase == "warmup"


def test_slo_verdicts_and_goodput() -> None:
    # 100 requests: 97 fast, 3 with slow TTFT (3 s). P99 TTFT is then 3 s -> FAIL at 2 s.
    records = [make_record(i, i * 0.1, 0.2, 0.02, 11) for i in range(97)]
    records += [make_record(97 + i, 9.7 + i * 0.1, 3.0, 0.02, 11) for i in range(3)]
    targets = SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.030, e2e_p99_s=5.0, max_error_rate=0.01)
    verdicts = {v.name: v for v in slo_verdicts(records, targets)}
    assert verdicts["p99_ttft_s"].observed == pytest.approx(3.0) and not verdicts["p99_ttft_s"].passed
    assert verdicts["p99_tpot_s"].observed == pytest.approx(0.02) and verdicts["p99_tpot_s"].passed
    assert verdicts["p99_e2e_s"].observed == pytest.approx(3.2) and verdicts["p99_e2e_s"].passed
    assert verdicts["error_rate"].observed == 0.0 and verdicts["error_rate"].passed
    # Loosen TTFT to 5 s: everything passes.
    assert all(v.passed for v in slo_verdicts(records, SloTargets(ttft_p99_s=5.0)))
    tp = throughput(records, targets)
    assert tp.goodput_fraction == pytest.approx(0.97)
    span = max(r.end_s for r in records) - min(r.sent_s for r in records)
    assert tp.duration_s == pytest.approx(span)
    assert tp.goodput_per_s == pytest.approx(97 / span)
    assert tp.requests_per_s == pytest.approx(100 / span)
    assert tp.output_tokens_per_s == pytest.approx(1100 / span)


def test_admission_accuracy_counts_what_the_admitted_then_missed_and_the_429s() -> None:
    records = [make_record(i, i * 0.1, 0.2, 0.02, 11) for i in range(90)]
    records += [make_record(90 + i, 9.0, 3.0, 0.02, 11) for i in range(4)]  # TTFT 3 s, E2E 3.2 s
    records += [make_record(94 + i, 9.4, 0.2, 0.05, 11) for i in range(3)]  # TPOT 50 ms
    records += [make_record(97 + i, 9.7, 0, 0, 0, error="rate_limited") for i in range(3)]
    records.append(make_record(100, 10.0, 0, 0, 0, error="timeout"))  # neither admitted nor refused
    acc = admission_accuracy(records, SloTargets(ttft_p99_s=2.0, tpot_p99_s=0.030, e2e_p99_s=3.0))
    assert (acc.admitted, acc.refused) == (97, 3)
    assert (acc.missed_ttft, acc.missed_tpot, acc.missed_e2e) == (4, 3, 4)
    off = admission_accuracy(records, SloTargets(ttft_p99_s=None, tpot_p99_s=0.060, e2e_p99_s=None))
    assert (off.missed_ttft, off.missed_tpot, off.missed_e2e) == (None, 0, None)


def test_errors_count_against_goodput_and_error_rate() -> None:
    records = [make_record(i, i * 0.1, 0.2, 0.01, 5) for i in range(95)]
    records += [make_record(95 + i, 9.5 + i * 0.1, 0, 0, 0, error="rate_limited") for i in range(5)]
    targets = SloTargets()
    verdicts = {v.name: v for v in slo_verdicts(records, targets)}
    assert verdicts["error_rate"].observed == pytest.approx(0.05) and not verdicts["error_rate"].passed
    assert verdicts["p99_ttft_s"].passed  # latency SLOs are over successful requests only
    assert throughput(records, targets).goodput_fraction == pytest.approx(0.95)
    # With no successful request a latency SLO cannot pass.
    failed_only = [make_record(0, 0.0, 0, 0, 0, error="timeout")]
    assert not any(v.passed for v in slo_verdicts(failed_only, targets))


def test_tpot_slo_is_per_request_for_goodput() -> None:
    slow_decode = make_record(0, 0.0, ttft_s=0.1, itl_s=0.05, tokens=10)  # TPOT 50 ms > 30 ms
    fast = make_record(1, 0.0, ttft_s=0.1, itl_s=0.01, tokens=10)
    one_token = make_record(2, 0.0, ttft_s=0.1, itl_s=0.0, tokens=1)  # no TPOT: not held against it
    targets = SloTargets()
    assert [targets.request_meets(r) for r in (slow_decode, fast, one_token)] == [False, True, True]


def test_window_p99_shows_drift() -> None:
    records = [make_record(i, i * 1.0, 0.1 if i < 30 else 1.0, 0.01, 3) for i in range(60)]
    rows = windows(records, 30.0)
    assert len(rows) == 2
    assert rows[0].ttft_p99_s == pytest.approx(0.1) and rows[1].ttft_p99_s == pytest.approx(1.0)
    assert rows[0].sent == 30 and rows[1].sent == 30
    # 30 requests a window: the P99s have a lower end but no upper one.
    assert (
        rows[0].ok == 30 and rows[0].ttft_p99_ci[1] is None and rows[1].ttft_p99_ci[0] == pytest.approx(1.0)
    )


def test_windows_of_300_requests_have_finite_intervals() -> None:
    records = [make_record(i, i * 0.1, 0.1 + (i % 100) * 0.001, 0.01, 3) for i in range(600)]
    rows = windows(records, 30.0)
    assert [r.ok for r in rows] == [300, 300]
    for r in rows:
        lo, hi = r.ttft_p99_ci
        assert lo is not None and hi is not None and lo <= r.ttft_p99_s <= hi  # type: ignore[operator]


def test_a_soak_window_too_small_for_its_p99_upper_end_has_one_for_its_p95() -> None:
    # 60 requests a 60 s window (a soak at 1 req/s): TTFTs 100-159 ms, TPOT 10 ms.
    records = [make_record(i, i * 1.0, 0.1 + (i % 60) * 0.001, 0.01, 3) for i in range(120)]
    rows = windows(records, 60.0)
    assert [r.ok for r in rows] == [60, 60]
    for r in rows:
        assert r.ttft_p99_ci[1] is None  # 60 values: a P99 has no upper end below 299
        assert r.ttft_p95_s == pytest.approx(0.156)  # the 57th of 60 by nearest rank
        lo, hi = r.ttft_p95_ci
        assert lo is not None and hi is not None and lo <= r.ttft_p95_s <= hi
        assert r.tpot_p95_s == pytest.approx(0.01)
    result = {"window_s": 60.0, "rows": [asdict(r) for r in rows]}
    text = "\n".join(_window_lines(result))
    assert "P95 TTFT(s) [interval]" in text and f"0.156 {fmt_interval(rows[0].ttft_p95_ci)}" in text


def test_attribution_of_the_slowest_percent() -> None:
    def timings(queue: float, prefill: float, decode: float, preemptions: int) -> dict[str, float]:
        return {"queue_s": queue, "prefill_s": prefill, "decode_s": decode, "preemptions": preemptions}

    records = [make_record(i, 0.0, 0.1, 0.01, 11, timings=timings(0.01, 0.09, 0.1, 0)) for i in range(199)]
    slow = make_record(199, 0.0, 2.1, 0.01, 11, timings=timings(1.9, 0.2, 0.1, 1))
    slow2 = make_record(200, 0.0, 1.1, 0.01, 11, timings=timings(0.9, 0.2, 0.1, 0))
    att = attribute_slowest([*records, slow, slow2])
    assert att is not None
    assert att.slowest_count == 3  # ceil(1% of 201)
    slowest = sorted([*records, slow, slow2], key=lambda r: r.e2e_s or 0)[-3:]
    assert att.queue_s == pytest.approx(sum((r.server_timings or {})["queue_s"] for r in slowest) / 3)
    assert att.preempted_fraction == pytest.approx(1 / 3)
    assert att.baseline_queue_s < att.queue_s
    assert attribute_slowest([make_record(0, 0.0, 0.1, 0.01, 3)]) is None


def test_client_health_verdict_uses_the_event_loop_lag() -> None:
    """A loop that wakes 20 ms late inflates every chunk time by that much: the verdict must say so,
    with how much of each percentile could be client delay."""
    from tailserve.bench.client_health import client_health

    calm = client_health([], [0.0005] * 99 + [0.001], 0.2, None)
    assert not calm.bottleneck and not calm.notes
    assert calm.client_delay_s == {"p50": 0.0005, "p95": 0.0005, "p99": 0.0005}
    busy = client_health([], [0.004] * 50 + [0.02] * 50, 0.3, None)
    assert busy.bottleneck
    assert busy.client_delay_s == {"p50": 0.004, "p95": 0.02, "p99": 0.02}
    (reason,) = busy.reasons
    assert "4.0 / 20.0 / 20.0 ms" in reason and "client delay" in reason
    some = client_health([], [0.001] * 90 + [0.005] * 10, 0.3, None)
    assert not some.bottleneck and some.notes  # a few milliseconds: a note, not a verdict
