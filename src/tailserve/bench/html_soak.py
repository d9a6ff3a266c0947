"""HTML parts of the report for intervals, soaks and calibration: interval cells, the "P99 over time"
charts with interval bars, server samples (RSS, KV blocks) and the calibration line.

Reads the result document only; drawn with bench/svg.py like the rest of the report.
"""

from __future__ import annotations

from typing import Any

from tailserve.bench.summary import fmt_interval
from tailserve.bench.svg import Band, Chart, Series


def ci_html(ci: list[float | None] | None, scale: float) -> str:
    """An interval as a small second line in a table cell; nothing when there is none."""
    if not ci:
        return ""
    return f'<br><small class="ci">{fmt_interval(ci, scale)}</small>'


def p99_over_time_charts(result: dict[str, Any], bands: list[Band]) -> list[Chart]:
    """Each window's P99 TTFT and TPOT with its interval bar, against the whole run's P99, and its P95
    with its own (a soak's window may hold too few requests for an upper end on its P99)."""
    windows = result["windows"]
    rows = windows["rows"]
    if not rows:
        return []
    charts = []
    for key, name, unit, scale in (("ttft", "TTFT", "s", 1.0), ("tpot", "TPOT", "ms", 1000.0)):
        series = []
        for stat, color in (("p99", None), ("p95", "#2ca02c")):
            kept = [r for r in rows if r.get(f"{key}_{stat}_s") is not None]
            points = [((r["start_s"] + r["end_s"]) / 2, r[f"{key}_{stat}_s"] * scale) for r in kept]
            intervals = [_scaled(r.get(f"{key}_{stat}_ci"), scale) for r in kept]
            if points:
                label = f"window {stat.upper()} {name} with interval"
                series.append(Series(label, points, "line", color=color, intervals=intervals))
        whole = (result["metrics"].get(f"{key}_s") or {}).get("p99")
        hlines = [(whole * scale, f"whole run P99 {whole * scale:.3g} {unit}")] if whole else []
        charts.append(
            Chart(
                f"P99 {name} over time ({windows['window_s']:g} s windows)",
                "window (s from start)",
                f"P99 and P95 {name} ({unit})",
                series,
                bands=bands,
                hlines=hlines,
            )
        )
    return charts


def _scaled(ci: list[float | None] | None, scale: float) -> tuple[float | None, float | None]:
    if not ci:
        return None, None
    return (None if ci[0] is None else ci[0] * scale, None if ci[1] is None else ci[1] * scale)


def server_samples_html(samples: dict[str, Any] | None) -> str:
    if not samples or not any(samples.get(k) for k in ("start", "warmup_end", "end")):
        return "<h2>Server memory and KV blocks</h2><p>The server exposes no /metrics.</p>"
    out = [
        "<h2>Server memory and KV blocks</h2><table><tr><th>sample</th><th>at (s)</th><th>RSS (MiB)</th>"
        "<th>KV blocks in use</th></tr>"
    ]
    for key, label in (("start", "start"), ("warmup_end", "end of warm-up"), ("end", "end of run")):
        s = samples.get(key)
        if not s:
            out.append(f"<tr><td>{label}</td><td>-</td><td>-</td><td>-</td></tr>")
            continue
        rss = "-" if s["rss_bytes"] is None else f"{s['rss_bytes'] / 2**20:.1f}"
        blocks = "-" if s["kv_blocks_used"] is None else f"{s['kv_blocks_used']:g}"
        out.append(f"<tr><td>{label}</td><td>{s['at_s']:.1f}</td><td>{rss}</td><td>{blocks}</td></tr>")
    out.append("</table>")
    if samples.get("rss_growth_after_warmup") is not None:
        out.append(f"<p>RSS growth after warm-up: {samples['rss_growth_after_warmup']:+.1%}</p>")
    window = samples.get("engine_window") or {}
    if window.get("busy_share") is not None:
        out.append(f"<p>Engine busy over the measured window: {window['busy_share']:.0%}</p>")
    if window.get("tp_comm_share") is not None:
        out.append(
            "<p>Tensor parallel: all-reduce took "
            f"{window['tp_comm_share']:.1%} of rank 0's forward time ({window['tp_allreduce_s']:.2f} s of "
            f"{window['tp_allreduce_s'] + window['tp_compute_s']:.2f} s).</p>"
        )
    return "".join(out)


def calibration_html(calibration: dict[str, Any] | None) -> str:
    if not calibration:
        return ""
    fit = calibration.get("fit")
    if not fit:
        return "<h2>Calibration</h2><p>Calibration measured nothing (every request failed).</p>"
    points = [(p["input_tokens"], p["ttft_s"]) for p in calibration["points"]]
    lo, hi = fit["min_tokens"], fit["max_tokens"]
    line = [(x, fit["intercept_s"] + fit["slope_s_per_token"] * x) for x in (lo, hi)]
    chart = Chart(
        "Calibration: idle TTFT vs prompt length",
        "prompt tokens",
        "TTFT (s)",
        [Series("idle request", points, "scatter"), Series("fitted line", line, "line", "#d62728")],
    )
    return (
        "<h2>Calibration</h2>"
        f"<p>isolated TTFT = {fit['intercept_s']:.4f} s + {fit['slope_s_per_token'] * 1000:.4f} ms/token "
        f"&times; prompt tokens, least squares over the per-length medians of {len(points)} sequential requests "
        f"on the idle server ({calibration['failed']} failed). Slowdown = TTFT / isolated TTFT; queue delay = "
        "TTFT &minus; isolated TTFT.</p>" + chart.render()
    )
