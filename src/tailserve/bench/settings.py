"""Parsed `tailserve bench` flags -> the settings of a run: target, SLO, workload, arrivals, warm-up.

Checks how the flags combine (BenchConfigError names the flag to fix); sends nothing and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tailserve.bench.arrivals import ArrivalSpec
from tailserve.bench.client import TargetConfig
from tailserve.bench.errors import BenchConfigError
from tailserve.bench.lengths import parse_length_dist
from tailserve.bench.load_loop import RunControl
from tailserve.bench.result import BenchSettings
from tailserve.bench.stats import SloTargets
from tailserve.bench.workload import PRESETS, Preset, WorkloadSpec


def target_from_args(args: argparse.Namespace) -> TargetConfig:
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise BenchConfigError(f"--extra-body is not JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise BenchConfigError("--extra-body must be a JSON object")
    if args.timeout <= 0:
        raise BenchConfigError("--timeout must be > 0")
    return TargetConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        timeout_s=args.timeout,
        ignore_eos=not args.no_ignore_eos,
        include_usage=not args.no_usage,
        extra_body=extra,
    )


def slo_from_args(args: argparse.Namespace) -> SloTargets:
    def opt(value: str | None, default: float | None, scale: float = 1.0) -> float | None:
        if value is None:
            return default
        if value.lower() in ("off", "none"):
            return None
        try:
            return float(value) * scale
        except ValueError:
            raise BenchConfigError(f"bad SLO value {value!r} (a number or 'off')") from None

    defaults = SloTargets()
    return SloTargets(
        ttft_p99_s=opt(args.slo_ttft, defaults.ttft_p99_s),
        tpot_p99_s=opt(args.slo_tpot_ms, defaults.tpot_p99_s, 0.001),
        e2e_p99_s=opt(args.slo_e2e, defaults.e2e_p99_s),
        max_error_rate=opt(args.slo_error_rate, defaults.max_error_rate),
    )


def settings_from_args(
    args: argparse.Namespace, arrival_override: ArrivalSpec | None = None
) -> BenchSettings:
    """Preset values, overridden by anything given explicitly on the command line."""
    preset = PRESETS.get(args.preset) if args.preset else None
    if args.preset and preset is None:
        raise BenchConfigError(f"unknown preset {args.preset!r}; use one of {sorted(PRESETS)}")
    workload = None
    if not args.trace:
        workload = WorkloadSpec(
            input_len=parse_length_dist(args.input_len or (preset.input_len if preset else "fixed:128")),
            output_len=parse_length_dist(args.output_len or (preset.output_len if preset else "fixed:64")),
            shared_prefix_tokens=args.shared_prefix_tokens,
            shared_prefix_fraction=args.shared_prefix_fraction,
            turns=args.turns,
            think_time_s=args.think_time,
            seed=args.seed,
        )
    arrival = arrival_override or _arrival_from_args(args, preset)
    if args.requests is None and args.duration is None:
        duration: float | None = preset.duration_s if preset else None
        requests = None if duration is not None else 100
    else:
        requests, duration = args.requests, args.duration
    if requests is not None and requests < 1:
        raise BenchConfigError("--requests must be >= 1")
    if duration is not None and duration <= 0:
        raise BenchConfigError("--duration must be > 0")
    warmup, warmup_requests = _warmup(args, preset, requests)
    if not 0.5 <= args.ci_level < 1.0:
        raise BenchConfigError("--ci-level must be in [0.5, 1) (e.g. 0.95)")
    if args.calibration_repeats < 1:
        raise BenchConfigError("--calibration-repeats must be >= 1")
    calibrate_on = args.calibrate
    if calibrate_on is None:
        calibrate_on = workload is not None and workload.input_len.kind == "longtail"
    if calibrate_on and workload is None:
        raise BenchConfigError("--calibrate needs a length distribution (not --trace)")
    control = RunControl(
        num_requests=requests,
        duration_s=duration,
        warmup_s=warmup,
        warmup_requests=warmup_requests,
        cooldown_s=args.cooldown,
        max_concurrency=args.max_concurrency,
        concurrency=arrival.concurrency,
        progress=args.progress if args.progress is not None else sys.stderr.isatty(),
    )
    return BenchSettings(
        target=target_from_args(args),
        arrival=arrival,
        control=control,
        slo=slo_from_args(args),
        workload=workload,
        tokenizer=args.tokenizer or "approx",
        window_s=args.window,
        preset=args.preset,
        trace=args.trace,
        trace_speed=args.trace_speed,
        label=args.label,
        seed=args.seed,
        ci_level=args.ci_level,
        calibrate=calibrate_on,
        calibration_repeats=args.calibration_repeats,
    )


def _warmup(args: argparse.Namespace, preset: Preset | None, requests: int | None) -> tuple[float, int]:
    """(warm-up seconds, warm-up requests). A run bounded by -n counts its warm-up in requests: a
    time warm-up (the preset's 30 s) could swallow a short run and leave nothing measured."""
    counted = getattr(args, "warmup_requests", None)
    if counted is not None and counted < 0:
        raise BenchConfigError("--warmup-requests must be >= 0")
    if args.requests is not None:
        if args.warmup:
            raise BenchConfigError(
                "with -n the warm-up is counted in requests: use --warmup-requests N "
                "(--warmup SECONDS goes with --duration)"
            )
        if counted is None:
            counted = 0 if args.warmup == 0 else (requests or 0) // 10
        if requests is not None and counted >= requests:
            raise BenchConfigError(
                f"--warmup-requests {counted} leaves none of the {requests} requests measured"
            )
        return 0.0, counted
    warmup = args.warmup if args.warmup is not None else (preset.warmup_s if preset else 0.0)
    return warmup, counted or 0


def _arrival_from_args(args: argparse.Namespace, preset: Preset | None) -> ArrivalSpec:
    if args.trace:
        if args.trace_speed <= 0:
            raise BenchConfigError("--trace-speed must be > 0")
        return ArrivalSpec(kind="trace")
    base = preset.arrival if preset else ArrivalSpec(kind="poisson", rate_per_s=1.0)
    kind = args.arrival or base.kind
    if args.arrival is None and args.rate is not None and not args.concurrency:
        kind = "poisson"  # a rate on a closed-loop preset means an open loop
    elif args.arrival is None and args.concurrency and args.rate is None:
        kind = "closed"
    return ArrivalSpec(
        kind=kind,
        rate_per_s=args.rate if args.rate is not None else base.rate_per_s,
        burstiness=args.burstiness,
        ramp_to_per_s=args.ramp_to,
        ramp_duration_s=args.ramp_duration,
        concurrency=args.concurrency or base.concurrency,
    )
