"""Metric math on raw per-request values: nearest-rank percentiles, summaries, SLOs, goodput, windows.

Percentiles are nearest-rank on the raw values (the value at rank ceil(q/100 * n) of the sorted list),
never interpolated and never computed from per-window aggregates; each comes with its distribution-free
interval (bench/intervals.py). Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tailserve.bench.intervals import DEFAULT_CI_LEVEL, percentile_interval
from tailserve.bench.records import RequestRecord

Interval = tuple[float | None, float | None]

PERCENTILES = (50.0, 90.0, 95.0, 99.0)
# SPEC.md: a well-run service keeps P99 within 1.5x of the mean; alert when P99 > 1.5x its target.
P99_OVER_MEAN_WARN = 1.5


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) of already-sorted values, nearest-rank method."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[rank - 1])


@dataclass(frozen=True)
class Summary:
    """Distribution of one metric over requests (or tokens, for ITL)."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    min: float
    p99_over_mean: float | None
    ci_level: float = DEFAULT_CI_LEVEL
    p50_ci: Interval = (None, None)
    p90_ci: Interval = (None, None)
    p95_ci: Interval = (None, None)
    p99_ci: Interval = (None, None)
    p99_over_mean_ci: Interval = (None, None)


def summarize(values: Iterable[float], ci_level: float = DEFAULT_CI_LEVEL) -> Summary | None:
    """Mean, nearest-rank percentiles with their intervals, extremes; None for no values."""
    data = sorted(values)
    if not data:
        return None
    mean = math.fsum(data) / len(data)
    p50, p90, p95, p99 = (nearest_rank(data, q) for q in PERCENTILES)
    ci50, ci90, ci95, ci99 = (percentile_interval(data, q, ci_level) for q in PERCENTILES)
    ratio = p99 / mean if mean > 0 else None
    ratio_ci: Interval = (None, None)
    if mean > 0:
        ratio_ci = (_over(ci99[0], mean), _over(ci99[1], mean))
    return Summary(
        len(data),
        mean,
        p50,
        p90,
        p95,
        p99,
        data[-1],
        data[0],
        ratio,
        ci_level,
        ci50,
        ci90,
        ci95,
        ci99,
        ratio_ci,
    )


def _over(value: float | None, divisor: float) -> float | None:
    return None if value is None else value / divisor


@dataclass(frozen=True)
class SloTargets:
    """P99 ceilings (seconds) and the largest tolerated error rate; None switches one off."""

    ttft_p99_s: float | None = 2.0
    tpot_p99_s: float | None = 0.030
    e2e_p99_s: float | None = 5.0
    max_error_rate: float | None = 0.01

    def request_meets(self, record: RequestRecord) -> bool:
        """Goodput test for one request: it completed and each of its own latencies is within target."""
        if not record.ok:
            return False
        checks: list[tuple[float | None, float | None]] = [
            (self.ttft_p99_s, record.ttft_s),
            (self.tpot_p99_s, record.tpot_s),
            (self.e2e_p99_s, record.e2e_s),
        ]
        return all(limit is None or value is None or value <= limit for limit, value in checks)


@dataclass(frozen=True)
class SloVerdict:
    """PASS/FAIL of one SLO; `observed` is None when nothing could be measured (then FAIL)."""

    name: str
    threshold: float
    observed: float | None
    passed: bool


def slo_verdicts(measured: Sequence[RequestRecord], targets: SloTargets) -> list[SloVerdict]:
    """One verdict per enabled SLO over the measured requests."""
    ok = [r for r in measured if r.ok]
    verdicts = []
    latency_slos: list[tuple[str, float | None, Callable[[RequestRecord], float | None]]] = [
        ("p99_ttft_s", targets.ttft_p99_s, lambda r: r.ttft_s),
        ("p99_tpot_s", targets.tpot_p99_s, lambda r: r.tpot_s),
        ("p99_e2e_s", targets.e2e_p99_s, lambda r: r.e2e_s),
    ]
    for name, limit, get in latency_slos:
        if limit is None:
            continue
        values = sorted(v for r in ok if (v := get(r)) is not None)
        observed = nearest_rank(values, 99.0) if values else None
        verdicts.append(SloVerdict(name, limit, observed, observed is not None and observed <= limit))
    if targets.max_error_rate is not None:
        rate = error_rate(measured)
        passed = rate is not None and rate <= targets.max_error_rate
        verdicts.append(SloVerdict("error_rate", targets.max_error_rate, rate, passed))
    return verdicts


def error_rate(records: Sequence[RequestRecord]) -> float | None:
    """Failed / all; None for no requests."""
    return sum(not r.ok for r in records) / len(records) if records else None


@dataclass(frozen=True)
class AdmissionAccuracy:
    """Whether a server's admission keeps its promise: of the measured requests it answered (it
    admitted them), how many then missed each per-request target, and how many it refused (429).
    A miss count is None where that target is off."""

    admitted: int
    refused: int
    missed_ttft: int | None
    missed_tpot: int | None
    missed_e2e: int | None


def admission_accuracy(measured: Sequence[RequestRecord], targets: SloTargets) -> AdmissionAccuracy:
    """Counts over the measured requests: answered ones against each target, and the 429s."""
    ok = [r for r in measured if r.ok]

    def missed(limit: float | None, get: Callable[[RequestRecord], float | None]) -> int | None:
        if limit is None:
            return None
        return sum(1 for r in ok if (v := get(r)) is not None and v > limit)

    return AdmissionAccuracy(
        admitted=len(ok),
        refused=sum(r.error_kind == "rate_limited" for r in measured),
        missed_ttft=missed(targets.ttft_p99_s, lambda r: r.ttft_s),
        missed_tpot=missed(targets.tpot_p99_s, lambda r: r.tpot_s),
        missed_e2e=missed(targets.e2e_p99_s, lambda r: r.e2e_s),
    )


@dataclass(frozen=True)
class Throughput:
    """Rates over the measured span: first measured send -> last measured request's end."""

    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    goodput_per_s: float
    goodput_fraction: float | None


def throughput(measured: Sequence[RequestRecord], targets: SloTargets) -> Throughput:
    """Request, token and goodput rates of the measured requests."""
    if not measured:
        return Throughput(0.0, 0.0, 0.0, 0.0, 0.0, None)
    start = min(r.sent_s for r in measured)
    duration = max(max(r.end_s for r in measured) - start, 1e-9)
    ok = [r for r in measured if r.ok]
    good = sum(targets.request_meets(r) for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    return Throughput(
        duration_s=duration,
        requests_per_s=len(ok) / duration,
        output_tokens_per_s=out_tokens / duration,
        total_tokens_per_s=(out_tokens + in_tokens) / duration,
        goodput_per_s=good / duration,
        goodput_fraction=good / len(measured),
    )


@dataclass(frozen=True)
class WindowRow:
    """P99s of the requests sent within one time window (seconds from the run start)."""

    start_s: float
    end_s: float
    sent: int
    failed: int
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p99_s: float | None
    ok: int = 0
    ttft_p99_ci: Interval = (None, None)
    tpot_p99_ci: Interval = (None, None)
    e2e_p99_ci: Interval = (None, None)
    # A window of a soak at a low rate holds too few requests for an upper end on its P99 (fewer
    # than 299 at 95%); its P95 has one from 59 requests.
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    ttft_p95_ci: Interval = (None, None)
    tpot_p95_ci: Interval = (None, None)


def windows(
    measured: Sequence[RequestRecord], window_s: float, ci_level: float = DEFAULT_CI_LEVEL
) -> list[WindowRow]:
    """Per-window P99 of TTFT, TPOT and E2E, and P95 of TTFT and TPOT, with intervals, by send time, to
    show tail drift over a soak."""
    if not measured or window_s <= 0:
        return []
    origin = min(r.sent_s for r in measured)
    last = max(r.sent_s for r in measured)
    rows = []
    for k in range(int((last - origin) // window_s) + 1):
        lo, hi = origin + k * window_s, origin + (k + 1) * window_s
        inside = [r for r in measured if lo <= r.sent_s < hi]
        ok = [r for r in inside if r.ok]
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tpot = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
        e2e = sorted(r.e2e_s for r in ok if r.e2e_s is not None)
        ttft99, tpot99, e2e99 = (_percentile(99.0, ci_level, v) for v in (ttft, tpot, e2e))
        ttft95, tpot95 = (_percentile(95.0, ci_level, v) for v in (ttft, tpot))
        rows.append(
            WindowRow(
                lo,
                hi,
                len(inside),
                len(inside) - len(ok),
                ttft99[0],
                tpot99[0],
                e2e99[0],
                len(ok),
                ttft99[1],
                tpot99[1],
                e2e99[1],
                ttft_p95_s=ttft95[0],
                tpot_p95_s=tpot95[0],
                ttft_p95_ci=ttft95[1],
                tpot_p95_ci=tpot95[1],
            )
        )
    return rows


def _percentile(q: float, ci_level: float, data: list[float]) -> tuple[float | None, Interval]:
    """The nearest-rank q-th percentile of sorted `data` and its interval; None for no values."""
    if not data:
        return None, (None, None)
    return nearest_rank(data, q), percentile_interval(data, q, ci_level)


@dataclass(frozen=True)
class Attribution:
    """Where the slowest requests spent their time, from the server's own per-request timings."""

    slowest_count: int
    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    preemption_s: float | None
    preemptions_mean: float
    preempted_fraction: float
    outside_server_s: float
    baseline_e2e_s: float
    baseline_queue_s: float
    baseline_prefill_s: float
    baseline_decode_s: float


def attribute_slowest(measured: Sequence[RequestRecord], fraction: float = 0.01) -> Attribution | None:
    """Mean breakdown of the slowest `fraction` by E2E (at least one), next to all requests' means."""
    timed = sorted((r for r in measured if r.ok and r.server_timings), key=lambda r: r.e2e_s or 0.0)
    if not timed:
        return None
    slow = timed[-max(1, math.ceil(fraction * len(timed))) :]

    def mean(records: Sequence[RequestRecord], key: str) -> float:
        return math.fsum((r.server_timings or {}).get(key, 0.0) for r in records) / len(records)

    has_preemption_s = all("preemption_s" in (r.server_timings or {}) for r in slow)
    server_e2e = [
        sum((r.server_timings or {}).get(k, 0.0) for k in ("queue_s", "prefill_s", "decode_s")) for r in slow
    ]
    client_e2e = [r.e2e_s or 0.0 for r in slow]
    return Attribution(
        slowest_count=len(slow),
        e2e_s=math.fsum(client_e2e) / len(slow),
        queue_s=mean(slow, "queue_s"),
        prefill_s=mean(slow, "prefill_s"),
        decode_s=mean(slow, "decode_s"),
        preemption_s=mean(slow, "preemption_s") if has_preemption_s else None,
        preemptions_mean=mean(slow, "preemptions"),
        preempted_fraction=sum((r.server_timings or {}).get("preemptions", 0.0) > 0 for r in slow)
        / len(slow),
        outside_server_s=math.fsum(c - s for c, s in zip(client_e2e, server_e2e, strict=True)) / len(slow),
        baseline_e2e_s=math.fsum(r.e2e_s or 0.0 for r in timed) / len(timed),
        baseline_queue_s=mean(timed, "queue_s"),
        baseline_prefill_s=mean(timed, "prefill_s"),
        baseline_decode_s=mean(timed, "decode_s"),
    )


def assign_phases(
    records: Sequence[RequestRecord],
    warmup_s: float,
    cooldown_s: float,
    send_end_s: float,
    warmup_requests: int = 0,
) -> None:
    """Mark each request warmup / measured / cooldown by when it was *sent* (cancelled ones stay so).

    Warm-up: sent before `warmup_s` from the run start, or among the first `warmup_requests` sent.
    Cool-down: sent after `send_end_s - cooldown_s`. Excluded requests still loaded the server; they
    are only left out of the statistics.
    """
    cooldown_from = send_end_s - cooldown_s if cooldown_s > 0 else math.inf
    first_sent = {id(r) for r in sorted(records, key=lambda r: r.sent_s)[:warmup_requests]}
    for r in records:
        if r.phase == "cancelled" or r.error_kind == "cancelled":
            r.phase = "cancelled"
        elif r.sent_s < warmup_s or id(r) in first_sent:
            r.phase = "warmup"
        elif r.sent_s > cooldown_from:
            r.phase = "cooldown"
        else:
            r.phase = "measured"
