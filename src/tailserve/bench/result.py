"""The result file (versioned JSON schema, docs/BENCH.md) and the per-request JSONL, built from a run.

`build_result` is where measured requests become the numbers a user reads; everything downstream
(terminal table, HTML report, compare, capacity) reads the result document, never the raw run.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tailserve import __version__
from tailserve.bench.arrivals import ArrivalSpec
from tailserve.bench.calibration import Calibration
from tailserve.bench.client import TargetConfig
from tailserve.bench.errors import ResultFileError
from tailserve.bench.intervals import DEFAULT_CI_LEVEL, min_count_for_upper_bound
from tailserve.bench.load_loop import RunControl, RunOutcome
from tailserve.bench.records import FATAL_ERROR_KINDS, RequestRecord
from tailserve.bench.stats import (
    P99_OVER_MEAN_WARN,
    SloTargets,
    SloVerdict,
    admission_accuracy,
    assign_phases,
    attribute_slowest,
    slo_verdicts,
    summarize,
    throughput,
    windows,
)
from tailserve.bench.workload import WorkloadSpec

SCHEMA = "tailserve-bench-result"
SCHEMA_VERSION = 1
# An output this much shorter than max_tokens means the server stopped early (EOS not ignored).
_SHORT_OUTPUT = 0.9
_ALERT_OVER_TARGET = 1.5
PROMPT_DRIFT = 0.05  # warn when the served prompt lengths are off the planned ones by more than this share
# Below this many values, nearest-rank P99 is the largest one (ceil(0.99 n) = n exactly when n < 100).
SMALL_SAMPLE = 100


def admission_ratios(ok: list[RequestRecord]) -> list[float]:
    """Server TTFT over the TTFT that the server's admission predicted on arrival (tailserve's
    `admission_estimate_s`), for the requests it predicted (0: nothing was ahead, not priced).
    Above 1: it took longer than admission expected (it let in a likely miss); below 1: admission
    was pessimistic (near the target, it refuses requests that would have made it)."""
    out = []
    for r in ok:
        t = r.server_timings or {}
        estimate, ttft = t.get("admission_estimate_s", 0.0), t.get("ttft_s", 0.0)
        if estimate > 0 and ttft > 0:
            out.append(ttft / estimate)
    return out


def admission_tpot_ratios(ok: list[RequestRecord]) -> list[float]:
    """Server TPOT (its decode time over its output's gaps) over the TPOT that the server's admission
    priced on arrival (tailserve's `admission_tpot_estimate_s`), for the requests it priced with two
    or more output tokens. Below 1: the price was pessimistic (near a target, it refuses requests
    whose streams would have kept it); above 1: optimistic."""
    out = []
    for r in ok:
        t = r.server_timings or {}
        estimate, decode_s = t.get("admission_tpot_estimate_s", 0.0), t.get("decode_s", 0.0)
        gaps = int(t.get("output_tokens", r.output_tokens)) - 1
        if estimate > 0 and decode_s > 0 and gaps > 0:
            out.append(decode_s / gaps / estimate)
    return out


@dataclass(frozen=True)
class BenchSettings:
    """Everything that defined a run, recorded in the result so it can be reproduced."""

    target: TargetConfig
    arrival: ArrivalSpec
    control: RunControl
    slo: SloTargets
    workload: WorkloadSpec | None
    tokenizer: str
    window_s: float = 30.0
    preset: str | None = None
    trace: str | None = None
    trace_speed: float = 1.0
    label: str | None = None
    seed: int = 0
    ci_level: float = DEFAULT_CI_LEVEL
    calibrate: bool = False
    calibration_repeats: int = 3

    def to_json(self) -> dict[str, Any]:
        workload = None
        if self.workload is not None:
            w = self.workload
            workload = {
                "input_len": w.input_len.spec(),
                "output_len": w.output_len.spec(),
                "shared_prefix_tokens": w.shared_prefix_tokens,
                "shared_prefix_fraction": w.shared_prefix_fraction,
                "turns": w.turns,
                "think_time_s": w.think_time_s,
            }
        return {
            "target": self.target.redacted(),
            "arrival": asdict(self.arrival),
            "run": asdict(self.control),
            "slo": asdict(self.slo),
            "workload": workload,
            "tokenizer": self.tokenizer,
            "window_s": self.window_s,
            "preset": self.preset,
            "trace": self.trace,
            "trace_speed": self.trace_speed,
            "seed": self.seed,
            "ci_level": self.ci_level,
            "calibrate": self.calibrate,
        }


def build_result(
    outcome: RunOutcome,
    settings: BenchSettings,
    calibration: Calibration | None = None,
    server_samples: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Classify phases, compute every metric on the measured requests, return the result document."""
    records = outcome.records
    control = settings.control
    assign_phases(records, control.warmup_s, control.cooldown_s, outcome.send_end_s, control.warmup_requests)
    measured = [r for r in records if r.phase == "measured"]
    ok = [r for r in measured if r.ok]
    phases = Counter(r.phase for r in records)
    errors = Counter(r.error_kind for r in measured if r.error_kind)
    all_errors = Counter(r.error_kind for r in records if r.error_kind and r.error_kind != "cancelled")
    examples = {}
    for r in records:
        if r.error_kind and r.error_kind not in examples and r.error_message:
            examples[r.error_kind] = r.error_message
    verdicts = slo_verdicts(measured, settings.slo)
    rates = throughput(measured, settings.slo)
    attribution = attribute_slowest(measured)
    queue = [r.server_timings["queue_s"] for r in ok if r.server_timings and "queue_s" in r.server_timings]
    level = settings.ci_level
    slowdown, queue_delay = interference(ok, calibration)
    metrics = {
        "ttft_s": summarize((v for r in ok if (v := r.ttft_s) is not None), level),
        "tpot_s": summarize((v for r in ok if (v := r.tpot_s) is not None), level),
        "itl_s": summarize((g for r in ok for g in r.itl_s()), level),
        "e2e_s": summarize((v for r in ok if (v := r.e2e_s) is not None), level),
        "slowdown": summarize(slowdown, level),
        "queue_delay_s": summarize(queue_delay, level),
        "queue_s": summarize(queue, level),
        "admission_ratio": summarize(admission_ratios(ok), level),
        "admission_tpot_ratio": summarize(admission_tpot_ratios(ok), level),
        "client_queue_s": summarize((r.client_queue_s for r in measured if r.scheduled_s is not None), level),
        "input_tokens": summarize((float(r.input_tokens) for r in ok), level),
        "output_tokens": summarize((float(r.output_tokens) for r in ok), level),
    }
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kind": "run",
        "tailserve_version": __version__,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "started_at": outcome.started_at,
        "label": settings.label or f"{outcome.model} @ {settings.target.root}",
        "status": outcome.status,
        "abort_reason": outcome.abort_reason,
        "model": outcome.model,
        "wall_s": outcome.wall_s,
        "config": settings.to_json(),
        "counts": {
            "requests": len(records),
            "measured": len(measured),
            "ok": len(ok),
            "failed": len(measured) - len(ok),
            "warmup": phases.get("warmup", 0),
            "cooldown": phases.get("cooldown", 0),
            "cancelled": phases.get("cancelled", 0),
        },
        "metrics": {k: asdict(v) if v else None for k, v in metrics.items()},
        "throughput": asdict(rates),
        "errors": {"by_kind": dict(errors), "all_phases": dict(all_errors), "examples": examples},
        "slo": {
            "targets": asdict(settings.slo),
            "verdicts": _verdicts_with_intervals(verdicts, metrics),
            "all_pass": bool(verdicts) and all(v.passed for v in verdicts),
            "goodput_per_s": rates.goodput_per_s,
            "goodput_fraction": rates.goodput_fraction,
            "admission": asdict(admission_accuracy(measured, settings.slo)),
        },
        "windows": _windows_section(measured, settings, metrics),
        "calibration": calibration.to_json() if calibration else None,
        "server_samples": server_samples,
        "attribution": asdict(attribution) if attribution else None,
        "client": asdict(outcome.client) if outcome.client else None,
        "output_length": _output_length(ok),
        "prefix_cache": _prefix_cache(ok),
        "capacity": None,
    }
    result["warnings"] = _warnings(result, records, settings)
    return result


def _verdicts_with_intervals(verdicts: list[SloVerdict], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Each latency verdict also carries its P99's interval and whether the interval's upper end is
    within the target (the conservative reading; None when the interval has no upper end)."""
    out = []
    for v in verdicts:
        row = asdict(v)
        summary = metrics.get(v.name.removeprefix("p99_"))
        if v.name != "error_rate":
            ci = summary.p99_ci if summary else (None, None)
            row["observed_ci"] = list(ci)
            row["passed_upper"] = None if ci[1] is None else ci[1] <= v.threshold
        out.append(row)
    return out


def interference(ok: list[RequestRecord], calibration: Calibration | None) -> tuple[list[float], list[float]]:
    """Per-request slowdown (TTFT / isolated TTFT at its prompt length) and queue delay (TTFT -
    isolated TTFT), from the calibration line; empty without one."""
    if calibration is None or calibration.fit is None:
        return [], []
    slowdown, delay = [], []
    for r in ok:
        ttft = r.ttft_s
        if ttft is None:
            continue
        isolated = calibration.fit.isolated_ttft_s(r.input_tokens or r.planned_input_tokens)
        if isolated > 0:
            slowdown.append(ttft / isolated)
        delay.append(ttft - isolated)
    return slowdown, delay


def _windows_section(
    measured: list[RequestRecord], settings: BenchSettings, metrics: dict[str, Any]
) -> dict[str, Any]:
    rows = windows(measured, settings.window_s, settings.ci_level)
    section: dict[str, Any] = {
        "window_s": settings.window_s,
        "ci_level": settings.ci_level,
        "rows": [asdict(w) for w in rows],
    }
    for key, attr in (("ttft", "ttft_p99_s"), ("tpot", "tpot_p99_s")):
        whole = metrics[f"{key}_s"]
        values = [v for w in rows if (v := getattr(w, attr)) is not None]
        ratio = max(values) / whole.p99 if len(rows) >= 2 and values and whole and whole.p99 > 0 else None
        section[f"{key}_p99_max_over_run"] = ratio
    return section


def _output_length(ok: list[RequestRecord]) -> dict[str, Any]:
    """Did the server honour max_tokens (and ignore_eos)? Where it did not, outputs come back short."""
    if not ok:
        return {"requested_mean": None, "received_mean": None, "short_fraction": None, "token_sources": {}}
    short = sum(r.output_tokens < _SHORT_OUTPUT * r.requested_output_tokens for r in ok)
    return {
        "requested_mean": sum(r.requested_output_tokens for r in ok) / len(ok),
        "received_mean": sum(r.output_tokens for r in ok) / len(ok),
        "short_fraction": short / len(ok),
        "token_sources": dict(Counter(r.output_tokens_source for r in ok)),
    }


def _prefix_cache(ok: list[RequestRecord]) -> dict[str, Any]:
    """Share of prompt tokens the server reported as served from its prefix cache (usage details)."""
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.input_tokens for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    return {"requests_reporting": len(reported), "cached_token_fraction": cached / prompt if prompt else None}


def _warnings(result: dict[str, Any], records: list[RequestRecord], settings: BenchSettings) -> list[str]:
    out: list[str] = []
    if result["status"] != "complete":
        out.append(
            f"run {result['status']}: {result['abort_reason'] or 'stopped by the user'}; results are partial"
        )
    if not result["counts"]["measured"]:
        out.append("no request was measured (all in warm-up/cool-down, or none sent)")
    client = result["client"]
    if client and client["bottleneck"]:
        out.append("THE CLIENT IS THE BOTTLENECK: " + "; ".join(client["reasons"]))
    out += client["notes"] if client else []
    for name, summary in result["metrics"].items():
        if (
            name in ("ttft_s", "tpot_s", "e2e_s")
            and summary
            and (summary["p99_over_mean"] or 0) > P99_OVER_MEAN_WARN
        ):
            out.append(
                f"{name[:-2].upper()} P99 is {summary['p99_over_mean']:.1f}x its mean (well-run: <= 1.5x)"
            )
    out += _small_sample_warnings(result["metrics"])
    calibration = result.get("calibration")
    if calibration and calibration["failed"]:
        total = calibration["failed"] + len(calibration["points"])
        out.append(
            f"calibration: {calibration['failed']} of {total} idle requests failed"
            + ("; no slowdown or queue delay without a fit" if not calibration["fit"] else "")
        )
    elif settings.calibrate and not calibration:
        out.append("calibration did not run (target unreachable): no slowdown or queue delay")
    for verdict in result["slo"]["verdicts"]:
        observed = verdict["observed"]
        if (
            verdict["name"] != "error_rate"
            and observed
            and observed > _ALERT_OVER_TARGET * verdict["threshold"]
        ):
            out.append(
                f"ALERT: {verdict['name']} {observed:.3f} s is over 1.5x its target {verdict['threshold']:g} s"
            )
    length = result["output_length"]
    if length["short_fraction"] and length["short_fraction"] > 0.05:
        hint = (
            " (ignore_eos not sent)"
            if not settings.target.ignore_eos
            else " (server may not support ignore_eos)"
        )
        out.append(f"{length['short_fraction']:.0%} of outputs came back under 90% of max_tokens{hint}")
    if "usage" not in length["token_sources"] and length["token_sources"]:
        out.append(
            "the server reported no usage: token counts are local estimates " + str(length["token_sources"])
        )
    off = _prompt_length_drift(records)
    if off is not None:
        served, planned = off
        hint = (
            "the prompts were sized by an approximate tokenizer: pass --tokenizer (the model's) for exact lengths"
            if settings.tokenizer == "approx"
            else f"the server's tokenizer is not {settings.tokenizer}'s"
        )
        out.append(
            f"the server counted {served:.0f} prompt tokens a request on average against {planned:.0f} "
            f"planned: {hint}"
        )
    fatal = {k: v for k, v in result["errors"]["all_phases"].items() if k in FATAL_ERROR_KINDS}
    if fatal:
        out.append(f"requests failed in ways that point at the setup, not the load: {fatal}")
    return out


def _prompt_length_drift(records: list[RequestRecord]) -> tuple[float, float] | None:
    """(mean prompt tokens the server counted, mean planned) over the measured successful requests,
    where the two differ by more than PROMPT_DRIFT of the planned (a prefill figure at "512 tokens"
    that ran at 556 misleads); None otherwise, or with no server counts (they equal the plan then)."""
    ok = [r for r in records if r.phase == "measured" and r.ok and r.planned_input_tokens > 0]
    if not ok:
        return None
    served = sum(r.input_tokens for r in ok) / len(ok)
    planned = sum(r.planned_input_tokens for r in ok) / len(ok)
    return (served, planned) if abs(served - planned) > PROMPT_DRIFT * planned else None


def _small_sample_warnings(metrics: dict[str, Any]) -> list[str]:
    """A P99 of fewer than 100 values is their maximum (nearest rank); say so where it is reported."""
    out = []
    for name in ("ttft_s", "tpot_s", "e2e_s", "slowdown", "queue_delay_s"):
        summary = metrics.get(name)
        if summary and summary["count"] < SMALL_SAMPLE:
            label = name.removesuffix("_s").replace("_", " ")
            label = label.upper() if label in ("ttft", "tpot", "e2e") else label
            out.append(
                f"{label} P99 of {summary['count']} requests = their maximum "
                f"(fewer than {SMALL_SAMPLE}; its interval has no upper end below "
                f"{min_count_for_upper_bound(99.0, summary['ci_level'])} requests)"
            )
    return out


def exit_code(result: dict[str, Any]) -> int:
    """0 complete; 1 aborted, nothing measured, or failed in a way that points at the setup; 130
    interrupted."""
    if result["status"] == "interrupted":
        return 130
    if result["status"] == "aborted" or not result["counts"]["measured"]:
        return 1
    fatal = [k for k in result["errors"]["all_phases"] if k in FATAL_ERROR_KINDS]
    return 1 if fatal else 0


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def write_jsonl(records: list[RequestRecord], path: Path) -> None:
    """One line per request, in send order, every phase (the `phase` field tells them apart)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in sorted(records, key=lambda r: r.sent_s):
            f.write(json.dumps(r.to_json(), allow_nan=False) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    return [
        RequestRecord.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()
    ]


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a result file and check its schema and version."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultFileError(f"{path}: cannot read a result file ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ResultFileError(f"{path}: not a tailserve bench result (schema {SCHEMA!r} expected)")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ResultFileError(
            f"{path}: schema version {doc.get('schema_version')} (this tool reads {SCHEMA_VERSION})"
        )
    return doc
