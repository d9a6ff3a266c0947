"""Plain-text views of result documents: the run summary and the capacity curve (`compare`: verdicts.py).

Reads only the result JSON (docs/BENCH.md), so a saved file prints exactly like a live run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tailserve.bench.intervals import order_stat_ranks

# (metric key, label, scale to display unit, unit)
METRIC_ROWS = (
    ("ttft_s", "TTFT", 1.0, "s"),
    ("tpot_s", "TPOT", 1000.0, "ms"),
    ("itl_s", "ITL", 1000.0, "ms"),
    ("e2e_s", "E2E", 1.0, "s"),
    ("slowdown", "slowdown", 1.0, "x"),
    ("queue_delay_s", "queue delay", 1.0, "s"),
    ("queue_s", "server queue", 1.0, "s"),
    ("admission_ratio", "TTFT/admission est", 1.0, "x"),
    ("admission_tpot_ratio", "TPOT/admission est", 1.0, "x"),
    ("client_queue_s", "client queue", 1000.0, "ms"),
    ("input_tokens", "input tokens", 1.0, ""),
    ("output_tokens", "output tokens", 1.0, ""),
)
_STATS = ("mean", "p50", "p90", "p95", "p99", "max")
# Latency rows that get an interval line under them in the terminal table.
_COL = 14
_CI_ROWS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "slowdown", "queue_delay_s")


def _ci_cells(summary: dict[str, Any], scale: float) -> str:
    """The interval row under a metric: blank under mean and max, [lo, hi] under each percentile."""
    cells = []
    for stat in _STATS:
        ci = summary.get(f"{stat}_ci")
        if not ci:
            cells.append(f"{'':>{_COL}}")
            continue
        cells.append(f"{fmt_interval(ci, scale, sep=','):>{_COL}}")
    return "".join(cells)


def fmt_num(value: float | None, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    v = value * scale
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"


def format_summary(result: dict[str, Any]) -> str:
    """The terminal summary of one run."""
    cfg, counts = result["config"], result["counts"]
    lines = [f"tailserve bench: {result['label']}  [{result['status']}]"]
    workload = cfg.get("workload") or {}
    if cfg.get("trace"):
        lines.append(f"workload: trace {cfg['trace']} (speed x{cfg['trace_speed']:g})")
    elif workload:
        lines.append(
            f"workload: {cfg.get('preset') or 'custom'}  input {workload['input_len']}  output {workload['output_len']}"
            f"  arrivals {_arrival_text(cfg['arrival'])}"
        )
    lines.append(
        f"requests: {counts['requests']} sent, {counts['measured']} measured "
        f"({counts['warmup']} warm-up, {counts['cooldown']} cool-down, {counts['cancelled']} cancelled excluded), "
        f"{counts['ok']} ok, {counts['failed']} failed"
    )
    lines.append("")
    lines.append(f"{'metric':<20}" + "".join(f"{s:>{_COL}}" for s in (*_STATS, "p99/mean")))
    for key, label, scale, unit in METRIC_ROWS:
        summary = result["metrics"].get(key)
        if not summary:
            continue
        name = f"{label} ({unit})" if unit else label
        cells = "".join(f"{fmt_num(summary[s], scale):>{_COL}}" for s in _STATS)
        ratio = summary.get("p99_over_mean")
        lines.append(f"{name:<20}{cells}{(f'{ratio:.2f}x' if ratio else '-'):>{_COL}}")
        if key in _CI_ROWS and summary.get("p99_ci"):
            lines.append(f"{'':<20}" + _ci_cells(summary, scale) + f"   n={summary['count']}")
    level = next((m.get("ci_level") for m in result["metrics"].values() if m and m.get("ci_level")), None)
    if level:
        lines.append(
            f"[lo, hi]: {level:.0%} distribution-free interval of each percentile (order statistics); "
            "+inf: too few values for an upper end"
        )
    calibration = result.get("calibration")
    if calibration and calibration.get("fit"):
        fit = calibration["fit"]
        lines.append(
            f"calibration: isolated TTFT = {fit['intercept_s']:.4f} s + {fit['slope_s_per_token'] * 1000:.4f} ms/token"
            f" x prompt tokens ({len(calibration['points'])} idle requests, {fit['min_tokens']}-{fit['max_tokens']}"
            " tokens); slowdown = TTFT / isolated, queue delay = TTFT - isolated"
        )
    tp, slo = result["throughput"], result["slo"]
    lines.append("")
    frac = slo["goodput_fraction"]
    lines.append(
        f"throughput: {tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} output tok/s, "
        f"{tp['total_tokens_per_s']:.1f} total tok/s over {tp['duration_s']:.1f} s; goodput "
        f"{slo['goodput_per_s']:.2f} req/s"
        + (f" ({frac:.0%} of measured requests)" if frac is not None else "")
    )
    cache = result.get("prefix_cache") or {}
    if cache.get("cached_token_fraction") is not None:
        lines.append(f"prefix cache: {cache['cached_token_fraction']:.0%} of prompt tokens served from cache")
    lines.append("SLOs: " + " | ".join(_verdict_text(v) for v in slo["verdicts"]))
    lines += _admission_lines(slo.get("admission"), slo["targets"])
    by_kind = result["errors"]["by_kind"]
    lines.append("errors: " + (", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())) or "none"))
    for kind, message in sorted(result["errors"]["examples"].items()):
        lines.append(f"  {kind}: {message}")
    lines += _client_lines(result.get("client"))
    lines += _attribution_lines(result.get("attribution"))
    lines += _window_lines(result["windows"])
    lines += _server_sample_lines(result.get("server_samples"))
    for warning in result.get("warnings", []):
        lines.append(f"! {warning}")
    return "\n".join(lines)


def _admission_lines(admission: dict[str, Any] | None, targets: dict[str, Any]) -> list[str]:
    """Of the requests the server admitted, the share that missed each per-request target (whether
    its admission kept its promise), and the share it refused with 429."""
    if not admission:
        return []
    admitted, refused = admission["admitted"], admission["refused"]
    asked = admitted + refused
    head = f"admission: {admitted} admitted, {refused} refused (429"
    head += f", {refused / asked:.1%})" if asked else ")"
    misses = []
    for key, target, unit, scale in (
        ("missed_ttft", "ttft_p99_s", "s", 1.0),
        ("missed_tpot", "tpot_p99_s", "ms", 1000.0),
        ("missed_e2e", "e2e_p99_s", "s", 1.0),
    ):
        n = admission.get(key)
        if n is None or not admitted:
            continue
        name = key.removeprefix("missed_").upper()
        misses.append(f"{n} missed {name} <= {fmt_num(targets[target] * scale)} {unit} ({n / admitted:.1%})")
    return [head + ("; of the admitted, " + ", ".join(misses) if misses else "")]


def _arrival_text(arrival: dict[str, Any]) -> str:
    kind = arrival["kind"]
    if kind == "closed":
        return f"closed loop x{arrival['concurrency']}"
    if kind == "ramp":
        return f"ramp {arrival['rate_per_s']:g}->{arrival['ramp_to_per_s']:g} req/s"
    if kind == "gamma":
        return f"gamma {arrival['rate_per_s']:g} req/s (burstiness {arrival['burstiness']:g})"
    return f"{kind} {arrival['rate_per_s']:g} req/s"


def _verdict_text(v: dict[str, Any]) -> str:
    name = "P99 " + v["name"].removeprefix("p99_").removesuffix("_s").upper()
    observed = v["observed"]
    if v["name"] == "error_rate":
        shown = "-" if observed is None else f"{observed:.1%}"
        return f"error rate {shown} <= {v['threshold']:.1%} {'PASS' if v['passed'] else 'FAIL'}"
    shown = "-" if observed is None else f"{observed:.3f}s"
    return f"{name} {shown} <= {v['threshold']:g}s {'PASS' if v['passed'] else 'FAIL'}"


def _client_lines(client: dict[str, Any] | None) -> list[str]:
    if not client:
        return []
    parts = []
    if client["achieved_rate_per_s"] is not None:
        parts.append(f"achieved {client['achieved_rate_per_s']:.2f} req/s")
        if client["scheduled_rate_per_s"]:
            parts.append(f"scheduled {client['scheduled_rate_per_s']:.2f}")
        if client["target_rate_per_s"]:
            parts.append(f"target {client['target_rate_per_s']:.2f}")
    parts.append(f"CPU {client['cpu_util']:.0%} of a core")
    delay = client.get("client_delay_s") or {}
    if delay:
        shown = "/".join(f"{v * 1000:.1f}" for v in delay.values())
        parts.append(f"loop lag p50/p95/p99 {shown} ms (client delay in those percentiles, at most)")
    elif client["loop_lag_p99_s"] is not None:
        parts.append(f"loop lag p99 {client['loop_lag_p99_s'] * 1000:.1f} ms")
    verdict = "CLIENT IS THE BOTTLENECK" if client["bottleneck"] else "client kept up"
    return [f"client: {', '.join(parts)} -> {verdict}"]


def _attribution_lines(att: dict[str, Any] | None) -> list[str]:
    if not att:
        return []
    line = (
        f"slowest 1% (n={att['slowest_count']}), server timings: E2E {att['e2e_s']:.3f}s = queue "
        f"{att['queue_s']:.3f} + prefill {att['prefill_s']:.3f} + decode {att['decode_s']:.3f} + outside server "
        f"{att['outside_server_s']:.3f}; preempted {att['preempted_fraction']:.0%} "
        f"(mean {att['preemptions_mean']:.2f} preemptions)"
    )
    if att.get("preemption_s") is not None:
        line += f", {att['preemption_s']:.3f}s in preemption"
    baseline = (
        f"  all requests: E2E {att['baseline_e2e_s']:.3f}s, queue {att['baseline_queue_s']:.3f}, prefill "
        f"{att['baseline_prefill_s']:.3f}, decode {att['baseline_decode_s']:.3f}"
    )
    return [line, baseline]


def _window_lines(windows: dict[str, Any]) -> list[str]:
    rows = windows["rows"]
    if len(rows) < 2:
        return []
    out = [
        f"{'per ' + format(windows['window_s'], 'g') + ' s window:':<26} start   sent  fail  "
        f"{'P99 TTFT(s) [interval]':<22} {'P99 TPOT(ms) [interval]':<23} P99 E2E(s)  "
        f"{'P95 TTFT(s) [interval]':<22} P95 TPOT(ms) [interval]"
    ]
    for r in rows:
        ttft = with_interval(r["ttft_p99_s"], r.get("ttft_p99_ci"), 1.0)
        tpot = with_interval(r["tpot_p99_s"], r.get("tpot_p99_ci"), 1000.0)
        ttft95 = with_interval(r.get("ttft_p95_s"), r.get("ttft_p95_ci"), 1.0)
        tpot95 = with_interval(r.get("tpot_p95_s"), r.get("tpot_p95_ci"), 1000.0)
        out.append(
            f"{'':26}{r['start_s']:6.0f} {r['sent']:6d} {r['failed']:5d}  {ttft:<22} {tpot:<23} "
            f"{fmt_num(r['e2e_p99_s']):>10}  {ttft95:<22} {tpot95}"
        )
    for key, label in (("ttft_p99_max_over_run", "TTFT"), ("tpot_p99_max_over_run", "TPOT")):
        if windows.get(key) is not None:
            out.append(f"{'':26}highest window P99 {label} = {windows[key]:.2f}x the whole run's P99")
    return out


def _server_sample_lines(samples: dict[str, Any] | None) -> list[str]:
    """RSS and KV blocks in use at start / end of warm-up / end of run, from the server's /metrics."""
    if not samples:
        return []
    taken = [samples.get(k) for k in ("start", "warmup_end", "end")]
    if not any(taken):
        return []

    def row(key: str, scale: float, fmt: str) -> str:
        return " / ".join("-" if not s or s[key] is None else format(s[key] * scale, fmt) for s in taken)

    line = (
        f"server /metrics (start / end of warm-up / end): RSS {row('rss_bytes', 2**-20, '.1f')} MiB, "
        f"KV blocks in use {row('kv_blocks_used', 1.0, 'g')}"
    )
    if samples.get("rss_growth_after_warmup") is not None:
        line += f"; RSS growth after warm-up {samples['rss_growth_after_warmup']:+.1%}"
    return [line, *_engine_window_lines(samples.get("engine_window"))]


def _engine_window_lines(window: dict[str, Any] | None) -> list[str]:
    """The measured window's engine busy share and, under tensor parallelism, its all-reduce share."""
    if not window:
        return []
    parts = []
    if window.get("busy_share") is not None:
        parts.append(f"engine busy {window['busy_share']:.0%} of {window['wall_s']:.1f} s")
    if window.get("tp_comm_share") is not None:
        parts.append(
            f"tensor parallel: all-reduce {window['tp_comm_share']:.1%} of rank 0's forward "
            f"({window['tp_allreduce_s']:.2f} s in collectives, {window['tp_compute_s']:.2f} s computing)"
        )
    return ["server engine (measured window): " + "; ".join(parts)] if parts else []


def with_interval(value: float | None, ci: Sequence[float | None] | None, scale: float = 1.0) -> str:
    """`1.20 [1.10, 1.40]`; just the value when there is no interval, `-` when there is no value."""
    if value is None:
        return "-"
    return fmt_num(value, scale) + (f" {fmt_interval(ci, scale)}" if ci else "")


def fmt_interval(ci: Sequence[float | None], scale: float = 1.0, sep: str = ", ") -> str:
    """`[lo, hi]`; an unbounded (None) end shows as -inf / +inf."""
    lo = "-inf" if ci[0] is None else fmt_num(ci[0], scale)
    hi = "+inf" if ci[1] is None else fmt_num(ci[1], scale)
    return f"[{lo}{sep}{hi}]"


def lookup(doc: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """Follow `path` through nested dicts; None where anything is missing."""
    node: Any = doc
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node) if isinstance(node, int | float) else None


def format_capacity(capacity: dict[str, Any]) -> str:
    """Latency-vs-rate curve and the answer."""
    lines = [
        f"{'rate (req/s)':>13} {'achieved':>9} {'TTFT p99':>9} {'TPOT p99':>9} {'E2E p99':>8} "
        f"{'goodput':>8} {'errors':>7}  verdict"
    ]
    for p in sorted(capacity["points"], key=lambda p: p["rate_per_s"]):
        tpot = "-" if p["tpot_p99_s"] is None else fmt_num(p["tpot_p99_s"], 1000) + "ms"
        lines.append(
            f"{p['rate_per_s']:13.4g} {fmt_num(p['achieved_rate_per_s']):>9} {fmt_num(p['ttft_p99_s']):>9} "
            f"{tpot:>9} {fmt_num(p['e2e_p99_s']):>8} {fmt_num(p['goodput_per_s']):>8} "
            f"{fmt_num(p['error_rate']):>7}  {'PASS' if p['passed'] else 'FAIL'}"
            + ("  (client bottleneck)" if p.get("client_bottleneck") else "")
            + (f"  TTFT p99 interval {fmt_interval(p['ttft_p99_ci'])}" if p.get("ttft_p99_ci") else "")
        )
    best = capacity["max_rate_per_s"]
    definition = capacity.get("definition") or "p99 within the SLOs"
    lines.append(
        "highest rate meeting every SLO: "
        + (f"{best:.2f} req/s" if best is not None else "none (even the lowest failed)")
        + f" (a pass: {definition})"
    )
    counts = [p["latency_count"] for p in capacity["points"] if p.get("latency_count")]
    if counts and definition.startswith("p99 interval upper ends"):
        lines.append(upper_end_note(min(counts)))
    return "\n".join(lines)


def _slowest_rank(n: int) -> int | None:
    """Which slowest value (1 = the largest) is the upper end of the P99 interval of n values."""
    upper = order_stat_ranks(n, 99.0)[1]
    return None if upper is None else n - upper + 1


def upper_end_note(n: int) -> str:
    """What a conservative probe of n requests turns on: its P99 interval's upper end is its k-th
    slowest request, so near capacity its k slowest requests (say, two long prompts arriving
    together) decide it."""
    k = _slowest_rank(n)
    if k is None:
        return f"note: {n} requests a probe give the P99 no upper end: no probe can pass conservatively"
    which = "its slowest request" if k == 1 else f"its {_ordinal(k)} slowest request"
    text = (
        f"note: with {n} requests a probe, the upper end of the 95% P99 interval is {which}, so near capacity "
        + ("that one request decides a probe" if k == 1 else f"its {k} slowest requests decide a probe")
    )
    if k < 8:
        fewest = next(m for m in range(n, 10**6) if (_slowest_rank(m) or 0) >= 8)
        text += f"; {fewest} requests a probe would make it the 8th slowest (-n or --probe-duration)"
    return text


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"
