"""`tailserve bench compare`: do two runs' percentiles differ? Decided by their intervals, not a ratio.

"differ" only when the two confidence intervals do not overlap (a conservative test); an unbounded
end that leaves it open is "not enough data". A ratio is printed only beside "differ": a ratio of
two noisy P99s, alone, is what this module exists to stop. Reads result documents only.
"""

from __future__ import annotations

from typing import Any

from tailserve.bench.intervals import intervals_overlap
from tailserve.bench.summary import fmt_num, lookup, with_interval

COMPARE_SCHEMA = "tailserve-bench-compare"
DIFFER = "differ"
NO_DIFFERENCE = "no difference shown"
NOT_ENOUGH_DATA = "not enough data"
_VERDICT_TEXT = {NO_DIFFERENCE: "no difference shown (intervals overlap)", NOT_ENOUGH_DATA: NOT_ENOUGH_DATA}

# (metrics key, label, display scale)
COMPARED_METRICS = (
    ("ttft_s", "TTFT (s)", 1.0),
    ("tpot_s", "TPOT (ms)", 1000.0),
    ("itl_s", "ITL (ms)", 1000.0),
    ("e2e_s", "E2E (s)", 1.0),
    ("slowdown", "slowdown (x)", 1.0),
    ("queue_delay_s", "queue delay (s)", 1.0),
)
COMPARED_STATS = ("p50", "p90", "p95", "p99")
# Shown for context only: these have no interval, so no verdict and no ratio.
CONTEXT_ROWS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("measured requests", ("counts", "measured"), 1.0),
    ("failed requests", ("counts", "failed"), 1.0),
    ("requests/s", ("throughput", "requests_per_s"), 1.0),
    ("output tok/s", ("throughput", "output_tokens_per_s"), 1.0),
    ("goodput req/s", ("slo", "goodput_per_s"), 1.0),
    ("max rate meeting SLOs", ("capacity", "max_rate_per_s"), 1.0),
)

Interval = tuple[float | None, float | None]


def interval_of(doc: dict[str, Any], metric: str, stat: str) -> tuple[float | None, Interval]:
    """(value, interval) of one percentile in a result document; missing pieces are None."""
    summary = (doc.get("metrics") or {}).get(metric) or {}
    ci = summary.get(f"{stat}_ci") or (None, None)
    return summary.get(stat), (ci[0], ci[1])


def verdict(a: Interval, b: Interval) -> str:
    """DIFFER, NO_DIFFERENCE or NOT_ENOUGH_DATA for two intervals of the same percentile."""
    overlap = intervals_overlap(a, b)
    if overlap is None:
        return NOT_ENOUGH_DATA
    return NO_DIFFERENCE if overlap else DIFFER


def compare_rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric and percentile present in any run: values, intervals, verdicts vs the first."""
    rows = []
    for metric, _, _ in COMPARED_METRICS:
        for stat in COMPARED_STATS:
            cells = [interval_of(d, metric, stat) for d in docs]
            if all(value is None for value, _ in cells):
                continue
            base_value, base_ci = cells[0]
            verdicts = []
            for i, (value, ci) in enumerate(cells[1:], start=1):
                text = (
                    verdict(base_ci, ci) if base_value is not None and value is not None else NOT_ENOUGH_DATA
                )
                ratio = value / base_value if text == DIFFER and value is not None and base_value else None
                verdicts.append({"against": 0, "run": i, "verdict": text, "ratio": ratio})
            rows.append(
                {
                    "metric": metric,
                    "stat": stat,
                    "values": [{"value": v, "ci": list(ci)} for v, ci in cells],
                    "verdicts": verdicts,
                }
            )
    return rows


def compare_document(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The `compare --out` JSON (docs/BENCH.md)."""
    levels = {(d.get("config") or {}).get("ci_level") for d in docs}
    return {
        "schema": COMPARE_SCHEMA,
        "schema_version": 1,
        "runs": names,
        "ci_level": levels.pop() if len(levels) == 1 else None,
        "rows": compare_rows(docs),
    }


def format_compare(docs: list[dict[str, Any]], names: list[str]) -> str:
    """The side-by-side table with a verdict per percentile for every run after the first."""
    width = 26
    header = f"{'metric':<16}{'stat':<5}" + "".join(f"{n[:24]:>{width}}" for n in names)
    header += "".join(f"  {n[:20]} vs {names[0][:20]}" for n in names[1:])
    lines = [header, "-" * len(header)]
    scales = {m: (label, scale) for m, label, scale in COMPARED_METRICS}
    for row in compare_rows(docs):
        label, scale = scales[row["metric"]]
        cells = "".join(
            f"{with_interval(c['value'], (c['ci'][0], c['ci'][1]), scale):>{width}}" for c in row["values"]
        )
        said = []
        for v in row["verdicts"]:
            said.append(
                f"differ ({v['ratio']:.2f}x)"
                if v["ratio"] is not None
                else _VERDICT_TEXT.get(v["verdict"], v["verdict"])
            )
        lines.append(f"{label:<16}{row['stat']:<5}{cells}  " + "  |  ".join(said))
    lines.append("")
    for label, path, scale in CONTEXT_ROWS:
        values = [lookup(d, path) for d in docs]
        if all(v is None for v in values):
            continue
        shown = [
            f"{v:.0f}" if v is not None and v == int(v) and v >= 1 else fmt_num(v, scale) for v in values
        ]
        lines.append(f"{label:<21}" + "".join(f"{text:>{width}}" for text in shown))
    passes = ["PASS" if d["slo"]["all_pass"] else "FAIL" for d in docs]
    lines.append(f"{'all SLOs':<21}" + "".join(f"{v:>{width}}" for v in passes))
    levels = sorted({(d.get("config") or {}).get("ci_level") or 0.95 for d in docs})
    lines.append(
        f"[lo, hi]: {' / '.join(f'{lv:.0%}' for lv in levels)} distribution-free intervals; 'differ' means they do "
        "not overlap (ratio = run / first); throughput rows carry no interval and no verdict"
    )
    return "\n".join(lines)
