"""The self-contained HTML report: summary tables and inline-SVG plots, no script, no network.

Plots: latency CDFs (TTFT, TPOT, ITL, E2E), TTFT and TPOT over time with the window P99, the window
P99s with their intervals ("P99 over time"), throughput over time, the calibration line, and the
capacity curve when the result holds one. Warm-up and cool-down are shaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape
from typing import Any

from tailserve.bench.html_soak import calibration_html, ci_html, p99_over_time_charts, server_samples_html
from tailserve.bench.records import RequestRecord
from tailserve.bench.summary import METRIC_ROWS, fmt_num, format_summary
from tailserve.bench.svg import Band, Chart, Series

_CDF_POINTS = 400
_CDF_TAIL_POINTS = 100
_SCATTER_POINTS = 3000
_THROUGHPUT_BINS = 120

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.pass{background:#2e7d32;color:#fff;padding:2px 8px;border-radius:4px}
.fail{background:#c62828;color:#fff;padding:2px 8px;border-radius:4px}
.warn{color:#b26a00} .grid{display:flex;flex-wrap:wrap;gap:12px} svg.chart{border:1px solid #eee}
pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto}
"""


def render_html(result: dict[str, Any], records: list[RequestRecord]) -> str:
    """The whole report as one HTML string."""
    body = [
        f"<h1>tailserve bench: {escape(result['label'])}</h1>",
        f"<p>status <b>{escape(result['status'])}</b> &middot; started {escape(result.get('started_at') or '')}"
        f" &middot; model {escape(str(result.get('model')))} &middot; schema v{result['schema_version']}</p>",
        _verdicts_html(result),
        _warnings_html(result),
        "<h2>Latency</h2>",
        _metrics_table(result),
    ]
    body.append("<h2>Capacity curve</h2>")
    if result.get("capacity"):
        body.append(_capacity_section(result["capacity"]))
    else:
        body.append(
            "<p>One run at one load; <code>tailserve bench capacity</code> draws the latency-vs-rate curve.</p>"
        )
    ok = [r for r in records if r.phase == "measured" and r.ok]
    bands = _phase_bands(result, records)
    body += [
        "<h2>Latency CDFs (measured requests)</h2>",
        '<div class="grid">' + "".join(c.render() for c in _cdf_charts(ok)) + "</div>",
        "<h2>Over time</h2>",
        '<div class="grid">' + "".join(c.render() for c in _time_charts(result, records, bands)) + "</div>",
        "<h2>P99 over time (per window, with intervals)</h2>",
        '<div class="grid">' + "".join(c.render() for c in p99_over_time_charts(result, bands)) + "</div>",
        _windows_table(result["windows"]),
        server_samples_html(result.get("server_samples")),
        calibration_html(result.get("calibration")),
        _attribution_html(result.get("attribution")),
        "<h2>Text summary</h2>",
        f"<pre>{escape(format_summary(result))}</pre>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>tailserve bench: {escape(result['label'])}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _verdicts_html(result: dict[str, Any]) -> str:
    items = []
    for v in result["slo"]["verdicts"]:
        cls = "pass" if v["passed"] else "fail"
        observed = "-" if v["observed"] is None else f"{v['observed']:.4g}"
        items.append(f'<span class="{cls}">{escape(v["name"])} {observed} &le; {v["threshold"]:g}</span>')
    goodput = result["slo"]["goodput_per_s"]
    return f"<p>SLOs: {' '.join(items)} &middot; goodput {goodput:.3g} req/s</p>"


def _warnings_html(result: dict[str, Any]) -> str:
    warnings = result.get("warnings") or []
    if not warnings:
        return ""
    return "<ul>" + "".join(f'<li class="warn">{escape(w)}</li>' for w in warnings) + "</ul>"


def _metrics_table(result: dict[str, Any]) -> str:
    stats = ("mean", "p50", "p90", "p95", "p99", "max")
    rows = [
        "<table><tr><th>metric</th><th>n</th>"
        + "".join(f"<th>{s}</th>" for s in stats)
        + "<th>p99/mean</th></tr>"
    ]
    level = None
    for key, label, scale, unit in METRIC_ROWS:
        summary = result["metrics"].get(key)
        if not summary:
            continue
        level = level or summary.get("ci_level")
        cells = "".join(
            f"<td>{fmt_num(summary[s], scale)}{ci_html(summary.get(f'{s}_ci'), scale)}</td>" for s in stats
        )
        ratio = summary.get("p99_over_mean")
        ratio_text = "-" if not ratio else f"{ratio:.2f}x" + ci_html(summary.get("p99_over_mean_ci"), 1.0)
        name = f"{label} ({unit})" if unit else label
        rows.append(
            f"<tr><td>{escape(name)}</td><td>{summary['count']}</td>{cells}<td>{ratio_text}</td></tr>"
        )
    tp = result["throughput"]
    rows.append("</table>")
    if level:
        rows.append(
            f"<p>[lo, hi] under a percentile: its {level:.0%} distribution-free interval (binomial order "
            "statistics); +inf: too few values for an upper end.</p>"
        )
    rows.append(
        f"<p>{tp['requests_per_s']:.3g} req/s &middot; {tp['output_tokens_per_s']:.4g} output tok/s &middot; "
        f"{tp['total_tokens_per_s']:.4g} total tok/s over {tp['duration_s']:.1f} s</p>"
    )
    return "".join(rows)


def cdf_points(values: list[float]) -> list[tuple[float, float]]:
    """(value, cumulative fraction) pairs, thinned evenly but keeping the whole top tail."""
    data = sorted(values)
    n = len(data)
    if n == 0:
        return []
    keep = (
        {round(i * (n - 1) / (_CDF_POINTS - 1)) for i in range(_CDF_POINTS)}
        if n > _CDF_POINTS
        else set(range(n))
    )
    keep |= set(range(max(0, n - _CDF_TAIL_POINTS), n))
    # Start the step at 0 on the smallest value, so even a single request draws a visible step.
    return [(data[0], 0.0)] + [(data[i], (i + 1) / n) for i in sorted(keep)]


def _cdf_charts(ok: list[RequestRecord]) -> list[Chart]:
    groups = (
        ("TTFT", "s", 1.0, [v for r in ok if (v := r.ttft_s) is not None]),
        ("TPOT", "ms", 1000.0, [v for r in ok if (v := r.tpot_s) is not None]),
        ("ITL", "ms", 1000.0, [g for r in ok for g in r.itl_s()]),
        ("E2E", "s", 1.0, [v for r in ok if (v := r.e2e_s) is not None]),
    )
    charts = []
    for name, unit, scale, values in groups:
        pts = [(v * scale, f) for v, f in cdf_points(values)]
        rules = []
        if values:
            data = sorted(values)
            for q in (50, 99):
                rules.append((data[max(1, math.ceil(q / 100 * len(data))) - 1] * scale, f"p{q}"))
        charts.append(
            Chart(
                f"{name} CDF",
                f"{name} ({unit})",
                "fraction of requests",
                [Series(name, pts, "step")],
                vlines=rules,
            )
        )
    return charts


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most _SCATTER_POINTS points: all of the top 1% by value plus an even sample of the rest."""
    if len(points) <= _SCATTER_POINTS:
        return points
    by_value = sorted(points, key=lambda p: p[1])
    cut = len(by_value) - max(1, len(by_value) // 100)
    tail, rest = by_value[cut:], by_value[:cut]
    step = len(rest) / (_SCATTER_POINTS - len(tail))
    return sorted([rest[int(i * step)] for i in range(_SCATTER_POINTS - len(tail))] + tail)


def _phase_bands(result: dict[str, Any], records: list[RequestRecord]) -> list[Band]:
    bands = []
    warmup = float(result["config"]["run"].get("warmup_s") or 0.0)
    if warmup > 0:
        bands.append(Band(0.0, warmup, "warm-up"))
    cool = [r.sent_s for r in records if r.phase == "cooldown"]
    if cool:
        bands.append(Band(min(cool), max(cool), "cool-down"))
    return bands


def _time_charts(result: dict[str, Any], records: list[RequestRecord], bands: list[Band]) -> list[Chart]:
    done = [r for r in records if r.ok]
    rows = result["windows"]["rows"]
    charts = []
    series: list[tuple[str, str, float, Callable[[RequestRecord], float | None], str]] = [
        ("TTFT", "s", 1.0, lambda r: r.ttft_s, "ttft_p99_s"),
        ("TPOT", "ms", 1000.0, lambda r: r.tpot_s, "tpot_p99_s"),
    ]
    for name, unit, scale, get, key in series:
        pts = _thin([(r.sent_s, v * scale) for r in done if (v := get(r)) is not None])
        p99 = _window_steps(rows, key, scale)
        target = result["slo"]["targets"].get(f"{key.split('_')[0]}_p99_s")
        highest = max((y for _, y in pts + p99), default=0.0)
        title = f"{name} over time"
        hlines = []
        if target and target * scale <= 3 * highest:
            hlines = [(target * scale, f"SLO p99 {target * scale:g} {unit}")]
        elif target:
            # A far-away SLO line would flatten the data to the axis; name it in the title instead.
            title += f" (SLO p99 {target * scale:g} {unit}, off scale)"
        charts.append(
            Chart(
                title,
                "request sent at (s from start)",
                f"{name} ({unit})",
                [Series(f"{name} per request", pts, "scatter"), Series("window P99", p99, "step", "#d62728")],
                bands=bands,
                hlines=hlines,
            )
        )
    charts.append(_throughput_chart(records, bands))
    return charts


def _window_steps(rows: list[dict[str, Any]], key: str, scale: float) -> list[tuple[float, float]]:
    pts: list[tuple[float, float]] = []
    for row in rows:
        if row[key] is not None:
            pts += [(row["start_s"], row[key] * scale), (row["end_s"], row[key] * scale)]
    return pts


def _throughput_chart(records: list[RequestRecord], bands: list[Band]) -> Chart:
    """Output tokens/s and completed requests/s per time bin, over every request the server saw."""
    arrivals = [(t, k) for r in records for t, k in r.token_times_s()]
    ends = [r.end_s for r in records if r.ok]
    if not arrivals:
        return Chart("Throughput over time", "time (s from start)", "per second", [], bands=bands)
    span = max(t for t, _ in arrivals)
    width = max(1.0, math.ceil(span / _THROUGHPUT_BINS))
    bins = int(span // width) + 1
    tokens = [0.0] * bins
    finished = [0.0] * bins
    for t, k in arrivals:
        tokens[min(bins - 1, int(max(t, 0.0) // width))] += k
    for t in ends:
        finished[min(bins - 1, int(max(t, 0.0) // width))] += 1
    tok_pts = [(i * width + width / 2, v / width) for i, v in enumerate(tokens)]
    req_pts = [(i * width + width / 2, v / width) for i, v in enumerate(finished)]
    scale = max(tokens) / max(max(finished), 1.0) / width if max(finished) else 1.0
    return Chart(
        f"Throughput over time ({width:g} s bins)",
        "time (s from start)",
        "output tokens/s",
        [
            Series("output tok/s", tok_pts, "line"),
            Series(
                f"completed req/s (x{scale:.3g})", [(x, y * scale) for x, y in req_pts], "line", dashed=True
            ),
        ],
        bands=bands,
    )


def _windows_table(windows: dict[str, Any]) -> str:
    rows = windows["rows"]
    if not rows:
        return ""
    out = [
        f"<h2>P99 per {windows['window_s']:g} s window</h2><table><tr><th>start (s)</th><th>sent</th>"
        "<th>ok</th><th>failed</th><th>TTFT p99 (s)</th><th>TPOT p99 (ms)</th><th>E2E p99 (s)</th></tr>"
    ]
    for r in rows:
        out.append(
            f"<tr><td>{r['start_s']:.0f}</td><td>{r['sent']}</td><td>{r.get('ok', '-')}</td><td>{r['failed']}</td>"
            f"<td>{fmt_num(r['ttft_p99_s'])}{ci_html(r.get('ttft_p99_ci'), 1.0)}</td>"
            f"<td>{fmt_num(r['tpot_p99_s'], 1000)}{ci_html(r.get('tpot_p99_ci'), 1000.0)}</td>"
            f"<td>{fmt_num(r['e2e_p99_s'])}{ci_html(r.get('e2e_p99_ci'), 1.0)}</td></tr>"
        )
    out.append("</table>")
    for key, name in (("ttft_p99_max_over_run", "TTFT"), ("tpot_p99_max_over_run", "TPOT")):
        if windows.get(key) is not None:
            out.append(f"<p>highest window P99 {name}: {windows[key]:.2f}x the whole run's P99</p>")
    return "".join(out)


def _attribution_html(att: dict[str, Any] | None) -> str:
    if not att:
        return "<h2>Server-side attribution</h2><p>The server returned no per-request timings.</p>"
    parts = ("queue_s", "prefill_s", "decode_s", "outside_server_s")
    head = "".join(f"<th>{p.removesuffix('_s')} (s)</th>" for p in parts)
    slow = "".join(f"<td>{att[p]:.4f}</td>" for p in parts)
    base = "".join(f"<td>{att.get('baseline_' + p, float('nan')):.4f}</td>" for p in parts[:3]) + "<td>-</td>"
    return (
        f"<h2>Server-side attribution</h2><table><tr><th>requests</th><th>E2E (s)</th>{head}"
        f"<th>preempted</th></tr><tr><td>slowest 1% (n={att['slowest_count']})</td><td>{att['e2e_s']:.4f}</td>"
        f"{slow}<td>{att['preempted_fraction']:.0%}</td></tr><tr><td>all</td><td>{att['baseline_e2e_s']:.4f}</td>"
        f"{base}<td>-</td></tr></table>"
    )


def _capacity_section(capacity: dict[str, Any]) -> str:
    # An interrupted or aborted probe measured nothing worth a point on the curve.
    points = sorted(
        (p for p in capacity["points"] if p["status"] == "complete"), key=lambda p: p["rate_per_s"]
    )
    latency = Chart(
        "P99 latency vs request rate",
        "offered rate (req/s)",
        "P99 (s)",
        [
            Series(
                "TTFT p99",
                [(p["rate_per_s"], p["ttft_p99_s"]) for p in points if p["ttft_p99_s"] is not None],
            ),
            Series(
                "E2E p99", [(p["rate_per_s"], p["e2e_p99_s"]) for p in points if p["e2e_p99_s"] is not None]
            ),
        ],
        hlines=[(v, f"SLO {k}") for k, v in capacity.get("slo_lines", {}).items()],
    )
    goodput = Chart(
        "Goodput vs request rate",
        "offered rate (req/s)",
        "req/s",
        [
            Series("goodput", [(p["rate_per_s"], p["goodput_per_s"] or 0.0) for p in points]),
            Series(
                "achieved",
                [
                    (p["rate_per_s"], p["achieved_rate_per_s"])
                    for p in points
                    if p["achieved_rate_per_s"] is not None
                ],
                dashed=True,
            ),
        ],
    )
    best = capacity["max_rate_per_s"]
    answer = f"{best:.3g} req/s" if best is not None else "none"
    return f"<p>highest rate meeting every SLO: <b>{answer}</b></p>" + (
        '<div class="grid">' + latency.render() + goodput.render() + "</div>"
    )
