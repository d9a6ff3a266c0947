"""The `bench` actions behind the CLI: turn arguments into settings, run, save, print, pick an exit code.

Imported only when a bench command runs (it pulls in numpy and httpx). Errors raised on purpose
are `BenchError`s; `handle` maps each to its message and exit code in one place.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.bench.arrivals import OPEN_LOOP_KINDS, ArrivalSpec, schedule_offsets
from tailserve.bench.calibration import Calibration, calibrate, calibration_lengths
from tailserve.bench.capacity_search import (
    CapacityPoint,
    CapacitySearch,
    capacity_section,
    find_capacity,
    point_from_result,
)
from tailserve.bench.corpus import PromptSource
from tailserve.bench.errors import BenchConfigError, BenchError
from tailserve.bench.html_report import render_html
from tailserve.bench.load_loop import LoadLoop
from tailserve.bench.records import RequestRecord
from tailserve.bench.result import (
    BenchSettings,
    build_result,
    exit_code,
    load_result,
    write_json,
    write_jsonl,
)
from tailserve.bench.server_samples import ServerSampler
from tailserve.bench.settings import settings_from_args
from tailserve.bench.summary import format_capacity, format_summary
from tailserve.bench.tokenizers import PromptTokenizer, load_tokenizer
from tailserve.bench.trace import load_trace
from tailserve.bench.verdicts import compare_document, format_compare
from tailserve.bench.workload import (
    WorkloadGenerator,
    build_conversations,
    conversations_from_trace,
)

EXIT_SLO_FAILED = 3
EXIT_INTERRUPTED = 130


def handle(args: argparse.Namespace) -> int:
    """Entry point of `tailserve bench`: dispatch the action, map errors to messages and exit codes."""
    action = args.action or "run"
    try:
        if action == "compare":
            return cmd_compare(args)
        if args.files:
            raise BenchConfigError(f"unexpected arguments {args.files} (only `compare` takes files)")
        if action == "capacity":
            return cmd_capacity(args)
        return cmd_run(args)
    except BenchError as exc:
        print(f"tailserve bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("tailserve bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def make_load_loop(settings: BenchSettings, tokenizer: PromptTokenizer, source: PromptSource) -> LoadLoop:
    """Draw the schedule and the prompts (seeded) and wire up a LoadLoop."""
    control, arrival = settings.control, settings.arrival
    workload_rng = np.random.default_rng([settings.seed, 1])
    if settings.trace:
        entries = load_trace(settings.trace, settings.trace_speed)
        if control.num_requests is not None:
            entries = entries[: control.num_requests]
        if control.duration_s is not None:
            entries = [e for e in entries if e.offset_s < control.duration_s]
        plans = conversations_from_trace(entries, source, workload_rng)
        return LoadLoop(settings.target, control, tokenizer, conversations=plans)
    assert settings.workload is not None
    generator = WorkloadGenerator(settings.workload, source, workload_rng)
    if arrival.kind in OPEN_LOOP_KINDS:
        turns = settings.workload.turns
        n_conv = None if control.num_requests is None else -(-control.num_requests // turns)
        offsets = schedule_offsets(
            arrival, np.random.default_rng([settings.seed, 2]), n_conv, control.duration_s
        )
        plans = build_conversations(generator, len(offsets) * turns, offsets)
        rate = None if arrival.kind == "ramp" else arrival.rate_per_s
        return LoadLoop(
            settings.target,
            control,
            tokenizer,
            conversations=plans,
            generator=generator,
            target_rate_per_s=rate,
        )
    return LoadLoop(settings.target, control, tokenizer, generator=generator)


async def run_calibration(
    settings: BenchSettings, tokenizer: PromptTokenizer, source: PromptSource
) -> Calibration | None:
    """The idle-server TTFT-vs-length line, when the settings ask for it (before any load)."""
    if not settings.calibrate or settings.workload is None:
        return None
    lengths = calibration_lengths(settings.workload.input_len, settings.seed)
    print(
        f"calibrating: {len(lengths)} prompt lengths x {settings.calibration_repeats}, one at a time ...",
        file=sys.stderr,
    )
    return await calibrate(
        settings.target, tokenizer, source, lengths, settings.calibration_repeats, settings.seed
    )


async def run_once(
    settings: BenchSettings,
    tokenizer: PromptTokenizer,
    source: PromptSource,
    calibration: Calibration | None = None,
    calibrate_now: bool = True,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One complete run: calibrate (unless given, or `calibrate_now` is off), schedule, send, measure,
    build the result document."""
    if calibration is None and calibrate_now:
        calibration = await run_calibration(settings, tokenizer, source)
    loop = make_load_loop(settings, tokenizer, source)
    sampler = ServerSampler(settings.target, _warmup_end_s(settings, loop))
    await sampler.start()
    outcome = await loop.run()
    await sampler.finish()
    return build_result(outcome, settings, calibration, sampler.to_json()), outcome.records


def _warmup_end_s(settings: BenchSettings, loop: LoadLoop) -> float | None:
    """When warm-up ends, from the run start: its seconds, else the due time of the first measured
    request of an open-loop schedule; None when it cannot be known ahead (closed loop by count)."""
    control = settings.control
    if control.warmup_s > 0:
        return control.warmup_s
    if control.warmup_requests and loop.conversations:
        turns = max(1, len(loop.conversations[0].turns))
        offsets = sorted(c.offset_s for c in loop.conversations if c.offset_s is not None)
        if offsets:
            return offsets[min(len(offsets) - 1, -(-control.warmup_requests // turns))]
    return None


def output_paths(prefix: str | None, action: str) -> tuple[Path, Path, Path]:
    base = prefix or f"bench-results/{action}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    base = base.removesuffix(".json")
    return Path(base + ".json"), Path(base + ".jsonl"), Path(base + ".html")


def save(
    result: dict[str, Any], records: list[RequestRecord], prefix: str | None, action: str, html: bool
) -> None:
    json_path, jsonl_path, html_path = output_paths(prefix, action)
    write_json(result, json_path)
    write_jsonl(records, jsonl_path)
    written = [json_path, jsonl_path]
    if html:
        html_path.write_text(render_html(result, records), encoding="utf-8")
        written.append(html_path)
    print("saved: " + "  ".join(str(p) for p in written), file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    source = PromptSource(tokenizer)
    result, records = asyncio.run(run_once(settings, tokenizer, source))
    print(format_summary(result))
    save(result, records, args.out, "run", not args.no_html)
    if result["status"] == "aborted":
        print(f"tailserve bench: error: {result['abort_reason']}", file=sys.stderr)
    elif not result["counts"]["measured"]:
        print(
            "tailserve bench: error: no request was measured (all in warm-up or cool-down)", file=sys.stderr
        )
    code = exit_code(result)
    if code == 0 and args.fail_on_slo and not result["slo"]["all_pass"]:
        return EXIT_SLO_FAILED
    return code


def cmd_capacity(args: argparse.Namespace) -> int:
    search = CapacitySearch(
        start_rate=args.rate_start, max_rate=args.rate_max, growth=args.growth, tolerance=args.tolerance
    )
    base = settings_from_args(args, ArrivalSpec(kind="poisson", rate_per_s=search.start_rate))
    if base.trace:
        raise BenchConfigError("capacity drives its own Poisson arrivals; --trace cannot be used with it")
    probe_control = replace(
        base.control,
        duration_s=None if args.requests else args.probe_duration,
        warmup_s=args.warmup
        if args.warmup is not None
        else min(base.control.warmup_s, args.probe_duration / 4),
    )
    tokenizer = load_tokenizer(args.tokenizer)
    source = PromptSource(tokenizer)
    runs: dict[float, tuple[dict[str, Any], list[RequestRecord]]] = {}
    calibration = asyncio.run(run_calibration(base, tokenizer, source))

    async def probe(rate: float) -> CapacityPoint:
        settings = replace(base, arrival=ArrivalSpec(kind="poisson", rate_per_s=rate), control=probe_control)
        print(f"capacity: probing {rate:.3g} req/s ...", file=sys.stderr)
        result, records = await run_once(settings, tokenizer, source, calibration, calibrate_now=False)
        runs[rate] = (result, records)
        point = point_from_result(rate, result, args.conservative)
        print(f"capacity: {rate:.3g} req/s -> {'PASS' if point.passed else 'FAIL'}", file=sys.stderr)
        return point

    best, points, note = asyncio.run(find_capacity(search, probe))
    slo = base.slo
    lines = {k: v for k, v in (("TTFT", slo.ttft_p99_s), ("E2E", slo.e2e_p99_s)) if v is not None}
    shown_rate = best if best is not None else points[-1].rate_per_s
    result, records = runs[shown_rate]
    section = capacity_section(best, points, note, lines, args.conservative)
    result = dict(result, kind="capacity", capacity=section)
    print(format_capacity(result["capacity"]))
    if note:
        print(f"note: {note}")
    save(result, records, args.out, "capacity", not args.no_html)
    if any(p.status == "interrupted" for p in points):
        return EXIT_INTERRUPTED
    if any(p.status == "aborted" for p in points):
        return 1
    return 0 if best is not None else EXIT_SLO_FAILED


def cmd_compare(args: argparse.Namespace) -> int:
    if len(args.files) < 2:
        raise BenchConfigError("compare needs at least two result files")
    docs = [load_result(path) for path in args.files]
    names = [Path(p).stem for p in args.files]
    print(format_compare(docs, names))
    if args.out:
        path = Path(args.out.removesuffix(".json") + ".json")
        write_json(compare_document(docs, names), path)
        print(f"saved: {path}", file=sys.stderr)
    return 0
