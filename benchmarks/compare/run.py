"""Measuring one server: start it, warm it up, calibrate it, sweep rates, search its capacity and run
it at the shared reference rate, recording every `tailserve bench` run as it ends.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loadgen import load_json, run_bench
from peers import launch
from peers.envs import HF_DIR, ROOT
from peers.launch import Limits, ServerSpec
from proc import ServerProcess

from compare.records import REFERENCE, BenchContext, RunRecord, ServerOutcome, Slo, capacity_of, run_of


def log(message: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


def server_spec(key: str, port: int, gguf: Path, limits: Limits, slo: Slo) -> ServerSpec:
    """The command line of one server of the comparison, matched to `limits`."""
    if key in ("ts-slo", "ts-fcfs"):
        return launch.tailserve(key.removeprefix("ts-"), port, limits, (slo.ttft_s, slo.tpot_ms / 1000))
    if key in ("hf", "hf-cb"):
        return launch.transformers_serve(port, limits, continuous_batching=key == "hf-cb")
    # llama.cpp twice: with the threads every server gets, and with 1. Its threads meet at a barrier
    # after every op, so when another process holds one of the 2 cores a 2-thread llama.cpp waits for
    # its descheduled twin hundreds of times a token (seen here: 64 tokens in > 100 s, vs 0.7 s with 1
    # thread on the same busy box). The 1-thread run shows what it does when that happens.
    if key == "llamacpp":
        return launch.llamacpp(port, gguf, limits)
    if key == "llamacpp-1t":
        return launch.llamacpp(port, gguf, dataclasses.replace(limits, threads=1), key="llamacpp-1t")
    if key == "vllm":
        return launch.vllm_cpu(port, limits)
    raise ValueError(f"unknown server {key!r}")


def new_outcome(spec: ServerSpec) -> ServerOutcome:
    # The launcher code is shown by name, not inlined into the documented command line.
    command = shlex.join(spec.command).replace(shlex.quote(launch.HF_LAUNCH), '"$HF_LAUNCH"')
    return ServerOutcome(
        spec.key, spec.label, command, spec.env, spec.notes, spec.extra_body, spec.bench_args
    )


def bench(
    ctx: BenchContext, spec: ServerSpec, url: str, kind: str, rate: float | None, extra: list[str]
) -> RunRecord:
    """One `tailserve bench run|capacity` against `url`; the result JSON lands in the server's folder."""
    name = kind if rate is None or kind == "capacity" else f"{kind}-{rate:g}"
    prefix = ctx.out_dir / spec.key / name
    action = "capacity" if kind == "capacity" else "run"
    label = spec.label + ("" if rate is None or kind == "capacity" else f" @ {rate:g} req/s")
    args = [
        "--base-url", url, "--preset", "cpu-chat", "--tokenizer", str(HF_DIR), "--seed", str(ctx.seed),
        "--timeout", str(ctx.plan.timeout_s), "--slo-ttft", str(ctx.slo.ttft_s),
        "--slo-tpot-ms", str(ctx.slo.tpot_ms), "--slo-e2e", "off", "--slo-error-rate", str(ctx.slo.error_rate),
        "--label", label, "--extra-body", json.dumps(spec.extra_body), *spec.bench_args, *extra,
    ]  # fmt: skip
    log(f"{spec.key}: {kind}" + (f" @ {rate:g} req/s" if rate else ""))
    done = run_bench(args, prefix, action)
    if done.exit_code not in (0, 3):
        log(f"{spec.key}: bench exited {done.exit_code}; see {done.log_path}")
    return RunRecord(
        kind, rate, str(done.json_path), done.exit_code, done.wall_s, done.load_before, done.load_after
    )


def highest_passing_rate(outcome: ServerOutcome) -> float | None:
    best: float | None = None
    for run in outcome.runs:
        data = load_json(run.json_path) if run.kind == "rate" else None
        if data and data["slo"]["all_pass"] and run.rate is not None:
            best = max(best or 0.0, run.rate)
    return best


def measure(
    spec: ServerSpec, outcome: ServerOutcome, ctx: BenchContext, reference_rate: float | None, port: int
) -> float | None:
    """Start one server, warm it up, run the sweep, the capacity search and the reference run, recording
    each run in `outcome` as it ends (so an interrupted run keeps what it measured). Returns the
    reference rate (set here from tailserve (slo)'s capacity when it was not given)."""
    plan = ctx.plan
    log(f"{spec.key}: starting {spec.label}")
    server = ServerProcess(
        spec.command, port, ctx.out_dir / spec.key / "server.log", spec.ready_path, spec.env, ROOT
    )
    with server:
        try:
            server.wait_ready()
        except RuntimeError as exc:
            outcome.error = f"did not start: {exc}"
            log(f"{spec.key}: {outcome.error}")
            return reference_rate
        # Warm-up (excluded from everything): short and long prompts, two at a time, so lazy
        # allocations, graph builds and the first continuous-batching init happen now.
        warm = ["--arrival", "closed", "--concurrency", "2", "-n", "6", "--input-len", "uniform:64,1600",
                "--output-len", "fixed:16", "--warmup", "0", "--no-html"]  # fmt: skip
        warm_ctx = dataclasses.replace(ctx, plan=dataclasses.replace(plan, timeout_s=300))
        outcome.runs.append(bench(warm_ctx, spec, server.url, "warmup", None, warm))
        outcome.startup_s = time.monotonic() - server.started_at
        # Unloaded speed, one request at a time: TTFT = a 1600-token prefill, TPOT = one stream's decode.
        calib = ["--arrival", "closed", "--concurrency", "1", "-n", str(plan.calibration_requests)]
        calib += ["--input-len", "fixed:1600", "--output-len", "fixed:64", "--warmup", "0", "--no-html"]
        outcome.runs.append(bench(ctx, spec, server.url, "calibration", None, calib))
        calibration = run_of(outcome, "calibration")
        if not calibration or calibration["counts"]["ok"] == 0:
            outcome.error = f"warm-up failed (no request succeeded); see {outcome.runs[-1].json_path}"
            log(f"{spec.key}: {outcome.error}")
            return reference_rate
        for rate in plan.rates:
            args = ["--arrival", "poisson", "--rate", f"{rate:g}", "--duration", f"{plan.duration_s:g}",
                    "--warmup", f"{plan.warmup_s:g}"]  # fmt: skip
            outcome.runs.append(bench(ctx, spec, server.url, "rate", rate, args))
        # The capacity search starts at the highest sweep rate that met the SLO (it probes it again).
        start_rate = highest_passing_rate(outcome) or min(plan.rates) / 2
        args = ["--rate-start", f"{start_rate:g}", "--rate-max", f"{max(plan.rate_max, start_rate):g}",
                "--growth", "2", "--tolerance", f"{plan.tolerance:g}", "--probe-duration", f"{plan.probe_s:g}",
                "--warmup", f"{plan.probe_warmup_s:g}"]  # fmt: skip
        outcome.runs.append(bench(ctx, spec, server.url, "capacity", start_rate, args))
        if reference_rate is None and spec.key == REFERENCE:
            # 80% of tailserve (slo)'s capacity; the lowest sweep rate when it has none.
            capacity = capacity_of(outcome)
            reference_rate = round(plan.reference_fraction * capacity, 3) if capacity else min(plan.rates)
        if reference_rate:
            args = ["--arrival", "poisson", "--rate", f"{reference_rate:g}", "--duration",
                    f"{plan.reference_s:g}", "-n", str(plan.reference_requests), "--warmup", f"{plan.warmup_s:g}"]  # fmt: skip
            outcome.runs.append(bench(ctx, spec, server.url, "reference", reference_rate, args))
    log(f"{spec.key}: done")
    return reference_rate


def ordered_keys(keys: Sequence[str], all_servers: Sequence[str]) -> list[str]:
    """tailserve (slo) first: its capacity sets the reference rate every server is then run at."""
    return sorted(keys, key=lambda k: (k != REFERENCE, list(all_servers).index(k)))
