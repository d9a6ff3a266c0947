"""One `tailserve bench` run read back into what the comparison judges: every latency's p50 / P99
with its interval, slowdown and queue delay against the server's idle calibration line, each
request's fate (met the SLO, fast 429, slow miss, other error), goodput with its interval, and
P99 per window. Reads the per-request JSONL (every statistic is recomputed from it, as docs/BENCH.md
promises), so it needs nothing from `tailserve bench` beyond the documented rows; pure otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from machine import steal_between

from compare.stats import Interval, quantile_interval, wilson

# The bench's per-request JSONL fields and result JSON keys this module reads: one place to adjust
# if `tailserve bench` renames them (docs/BENCH.md, "Per-request JSONL" and "Result JSON").
ROW_PHASE, ROW_OK, ROW_STATUS, ROW_ERROR = "phase", "ok", "http_status", "error_kind"
ROW_SENT, ROW_DONE, ROW_TTFT, ROW_TPOT, ROW_E2E = "sent_s", "done_s", "ttft_s", "tpot_s", "e2e_s"
ROW_INPUT, ROW_CACHED = "input_tokens", "cached_tokens"
RESULT_DURATION = ("throughput", "duration_s")  # first measured send -> last measured end
RESULT_ITL = ("metrics", "itl_s")  # per-token ITL summary (no interval: tokens of one request correlate)
BENCH_CALIBRATION = ("calibration",)  # {fit: {intercept_s, slope_s_per_token}, medians: [...]} (issue 15)
BENCH_SERVER_SAMPLES = ("server_samples",)  # {start, warmup_end, end, rss_growth_after_warmup} (issue 15)
BENCH_P99_CI = "p99_ci"  # metrics.<m>.p99_ci = [lo, hi]: the bench's own interval, kept as a cross-check

FAST_REFUSAL_S = 1.0  # a 429 answered within this is a fast refusal; later, it is a slow miss
METRICS = ("ttft_s", "tpot_s", "e2e_s", "slowdown", "queue_delay_s")


@dataclasses.dataclass(frozen=True)
class Slo:
    """The targets every run is judged by (P99s), stated with where they came from."""

    ttft_s: float
    tpot_s: float
    error_rate: float = 0.01
    basis: str = ""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A server's idle TTFT as a line in the prompt length, and its idle one-stream TPOT."""

    intercept_s: float
    per_token_s: float
    idle_tpot_s: float
    points: tuple[tuple[int, float], ...] = ()  # (prompt tokens, mean idle TTFT s)

    def isolated_ttft_s(self, input_tokens: int) -> float:
        return max(1e-3, self.intercept_s + self.per_token_s * input_tokens)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x; a flat line through the mean with one distinct x."""
    n = len(points)
    if n == 0:
        raise ValueError("no calibration points")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def read_rows(jsonl: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with jsonl.open() as f:
        for line in f:
            with contextlib.suppress(ValueError):  # a last line cut short by a killed bench
                rows.append(json.loads(line))
    return rows


def measured_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get(ROW_PHASE) == "measured"]


def calibration_from(rows: Sequence[dict[str, Any]]) -> Calibration:
    """The idle line from closed-loop, one-at-a-time requests of several prompt lengths."""
    ok = [r for r in rows if r.get(ROW_OK) and r.get(ROW_TTFT) is not None]
    if not ok:
        raise ValueError("no successful calibration request")
    intercept, slope = fit_line([(float(r[ROW_INPUT]), float(r[ROW_TTFT])) for r in ok])
    tpots = [float(r[ROW_TPOT]) for r in ok if r.get(ROW_TPOT) is not None]
    by_len: dict[int, list[float]] = {}
    for r in ok:
        by_len.setdefault(int(r[ROW_INPUT]), []).append(float(r[ROW_TTFT]))
    points = tuple((n, sum(v) / len(v)) for n, v in sorted(by_len.items()))
    return Calibration(intercept, slope, sum(tpots) / len(tpots) if tpots else 0.0, points)


def fate(row: dict[str, Any], slo: Slo) -> str:
    """met | fast_429 | slow_miss | error: what became of one measured request."""
    if row.get(ROW_OK):
        ttft, tpot = row.get(ROW_TTFT), row.get(ROW_TPOT)
        late = ttft is None or ttft > slo.ttft_s or (tpot is not None and tpot > slo.tpot_s)
        return "slow_miss" if late else "met"
    waited = (row.get(ROW_DONE) or 0.0) - (row.get(ROW_SENT) or 0.0)
    if row.get(ROW_STATUS) == 429:
        return "fast_429" if waited <= FAST_REFUSAL_S else "slow_miss"
    return "slow_miss" if row.get(ROW_ERROR) == "timeout" else "error"


def summary(values: Sequence[float]) -> dict[str, Any]:
    """mean, p50 and P99 with their intervals, P99/mean with the P99's interval over the mean."""
    if not values:
        return {"count": 0}
    mean = sum(values) / len(values)
    p50, p99 = quantile_interval(values, 0.5), quantile_interval(values, 0.99)
    ratio = p99.scaled(1 / mean) if mean > 0 else Interval(None, None, None, len(values))
    return {
        "count": len(values),
        "mean": mean,
        "p50": dataclasses.asdict(p50),
        "p99": dataclasses.asdict(p99),
        "p99_over_mean": dataclasses.asdict(ratio),
        "max": max(values),
    }


def interval(data: dict[str, Any] | None) -> Interval:
    """An Interval back from its saved dict (an empty one when missing)."""
    if not data:
        return Interval(None, None, None, 0)
    return Interval(data.get("value"), data.get("low"), data.get("high"), int(data.get("count", 0)))


def dig(doc: dict[str, Any] | None, path: tuple[str, ...]) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def metric_values(rows: Sequence[dict[str, Any]], calibration: Calibration | None) -> dict[str, list[float]]:
    """Per successful measured request: TTFT, TPOT, E2E, and with a calibration its slowdown
    (TTFT over its prompt's idle TTFT) and queue delay (TTFT minus that)."""
    ok = [r for r in measured_rows(rows) if r.get(ROW_OK) and r.get(ROW_TTFT) is not None]
    values: dict[str, list[float]] = {
        "ttft_s": [float(r[ROW_TTFT]) for r in ok],
        "tpot_s": [float(r[ROW_TPOT]) for r in ok if r.get(ROW_TPOT) is not None],
        "e2e_s": [float(r[ROW_E2E]) for r in ok if r.get(ROW_E2E) is not None],
    }
    if calibration is not None:
        isolated = [calibration.isolated_ttft_s(int(r[ROW_INPUT] or 1)) for r in ok]
        values["slowdown"] = [float(r[ROW_TTFT]) / i for r, i in zip(ok, isolated, strict=True)]
        values["queue_delay_s"] = [float(r[ROW_TTFT]) - i for r, i in zip(ok, isolated, strict=True)]
    return values


def analyze(
    rows: Sequence[dict[str, Any]], result: dict[str, Any] | None, slo: Slo, calibration: Calibration | None
) -> dict[str, Any]:
    """The saved figures of one run (JSON-ready): counts, fates, metric summaries, goodput."""
    measured = measured_rows(rows)
    ok = [r for r in measured if r.get(ROW_OK) and r.get(ROW_TTFT) is not None]
    values = metric_values(rows, calibration)
    fates = {k: 0 for k in ("met", "fast_429", "slow_miss", "error")}
    for r in measured:
        fates[fate(r, slo)] += 1
    n = len(measured)
    failed = n - len(ok)
    span = dig(result, RESULT_DURATION) or 0.0
    good = wilson(fates["met"], n)
    goodput = good.scaled(n / span) if span > 0 else Interval(None, None, None, n)
    reporting = [r for r in ok if r.get(ROW_CACHED) is not None]  # null: the server did not say
    cached = sum(int(r[ROW_CACHED]) for r in reporting)
    prompt = sum(int(r.get(ROW_INPUT) or 0) for r in reporting)
    return {
        "measured": n,
        "ok": len(ok),
        "failed": failed,
        "error_rate": failed / n if n else None,
        "fates": fates,
        "span_s": span,
        "goodput_per_s": dataclasses.asdict(goodput),
        "metrics": {name: summary(v) for name, v in values.items()},
        "itl_s": dig(result, RESULT_ITL),
        "bench_p99_ci": {m: (dig(result, ("metrics", m)) or {}).get(BENCH_P99_CI) for m in METRICS},
        "cached_token_fraction": cached / prompt if prompt else None,
    }


def passes(figures: dict[str, Any], slo: Slo, conservative: bool = True) -> tuple[bool, str]:
    """The conservative verdict of a capacity probe: both P99s' upper ends within their targets and
    the error rate within its bound; with the reason when not. `conservative=False` (quick runs,
    too small for any interval) judges the point P99s instead."""
    reasons = []
    for name, target in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s)):
        p99 = interval(figures["metrics"].get(name, {}).get("p99"))
        if not conservative:
            p99 = Interval(p99.value, p99.value, p99.value, p99.count)
        if p99.high is None:
            reasons.append(f"P99 {name} unbounded (too few requests)")
        elif p99.high > target:
            end = "upper end " if conservative else ""
            reasons.append(f"P99 {name} {end}{p99.high:.3g} > {target:g}")
    rate = figures.get("error_rate")
    if rate is None or rate > slo.error_rate:
        reasons.append(f"error rate {rate if rate is None else f'{rate:.1%}'} > {slo.error_rate:.0%}")
    return not reasons, "; ".join(reasons)


def windows(rows: Sequence[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """P99 TTFT and TPOT with intervals per `window_s` of send time from the first measured send."""
    measured = measured_rows(rows)
    if not measured:
        return []
    t0 = min(float(r[ROW_SENT]) for r in measured)
    buckets: dict[int, list[dict[str, Any]]] = {}
    for r in measured:
        buckets.setdefault(int((float(r[ROW_SENT]) - t0) // window_s), []).append(r)
    out = []
    for i in sorted(buckets):
        group = buckets[i]
        ok = [r for r in group if r.get(ROW_OK) and r.get(ROW_TTFT) is not None]
        tpots = [float(r[ROW_TPOT]) for r in ok if r.get(ROW_TPOT) is not None]
        out.append(
            {
                "start_s": i * window_s,
                "end_s": (i + 1) * window_s,
                "sent": len(group),
                "failed": len(group) - len(ok),
                "ttft_p99": dataclasses.asdict(quantile_interval([float(r[ROW_TTFT]) for r in ok], 0.99)),
                "tpot_p99": dataclasses.asdict(quantile_interval(tpots, 0.99)),
            }
        )
    return out


def tail_steal(
    rows: Sequence[dict[str, Any]],
    run_start: float,
    p99_ttft_s: float,
    samples: Sequence[tuple[float, tuple[int, ...]]],
) -> dict[str, Any] | None:
    """What the machine did to the requests that set the P99 TTFT: the CPU steal share while each
    of them waited for its first token (from a 1-second CpuLog, `run_start` the bench's start in unix
    time, good to about a second), averaged over those the log covers (`tail_requests` of `tail_of`),
    beside the steal over the whole measured run (None unless the log covers all of it). None when
    the log covers none of the tail."""
    done = [r for r in measured_rows(rows) if r.get("ok") and r.get("ttft_s") is not None]
    if not done:
        return None
    whole = steal_between(
        samples,
        run_start + min(r["sent_s"] for r in done),
        run_start + max(r["sent_s"] + (r.get("done_s") or r["ttft_s"]) for r in done),
    )
    tail = [r for r in done if r["ttft_s"] >= p99_ttft_s]
    seen = [s for r in tail if (s := steal_between(samples, run_start + r["sent_s"], run_start + r["sent_s"] + r["ttft_s"])) is not None]  # fmt: skip
    if not seen:
        return None
    return {"run": whole, "tail": sum(seen) / len(seen), "tail_requests": len(seen), "tail_of": len(tail)}
