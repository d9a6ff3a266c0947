"""The online section: `tailserve serve` in its own process and `tailserve bench` against it at a few
Poisson rates, as many as the budget leaves room for, lowest first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loadgen import run_bench
from proc import ServerProcess

from gpu.suite import Plan, Suite, log

ROOT = Path(__file__).resolve().parents[2]
RUN_OVERHEAD_S = 5.0  # bench start-up and result writing, per online run


def server_process(args: argparse.Namespace, plan: Plan, log_path: Path) -> ServerProcess:
    cmd = [
        sys.executable, "-m", "tailserve.cli", "serve",
        "--model", args.model,
        "--device", args.device,
        "--weight-format", args.weight_format,
        "--port", str(args.port),
        "--kv-cache-memory", plan.server_kv,
        "--max-model-len", str(plan.server_max_model_len),
        "--max-num-seqs", str(plan.max_num_seqs),
        "--max-num-batched-tokens", str(plan.server_batched_tokens),
        "--log-level", "warning",
    ]  # fmt: skip
    log("starting: " + " ".join(cmd[3:]))
    return ServerProcess(cmd, args.port, log_path, "/ready", cwd=ROOT).start()


def section_online(
    rec: dict[str, Any],
    server: ServerProcess | None,
    args: argparse.Namespace,
    plan: Plan,
    suite: Suite,
    tmp: Path,
) -> ServerProcess:
    if server is None:
        server = server_process(args, plan, tmp / "server.log")
    rec["server_log"] = str(server.log_path)
    ready_s = server.wait_ready(min(plan.server_start_timeout_s, max(10.0, suite.remaining_s() - 30)), 1.0)
    rec |= {
        "server_ready_after_s": round(ready_s, 1),
        "preset": plan.online_preset,
        "arrival": "poisson",
        "runs": [],
    }
    log(f"server ready ({ready_s:.0f} s after start)")
    rates = list(plan.online_rates)
    # As many rates as fit with at least a third of the planned duration each, lowest rates first.
    min_duration = max(3.0, plan.online_duration_s / 3)
    fit = int((suite.remaining_s() - 10) // (min_duration + plan.online_tail_s + RUN_OVERHEAD_S))
    fit = max(0, min(len(rates), fit))
    for i, rate in enumerate(rates):
        run: dict[str, Any] = {"rate_per_s": rate}
        rec["runs"].append(run)
        slot = (suite.remaining_s() - 10) / max(fit - i, 1) - RUN_OVERHEAD_S
        duration = min(plan.online_duration_s, slot - plan.online_tail_s)
        if i >= fit or duration < min_duration:
            run["skipped"] = f"{suite.remaining_s():.0f} s of budget left"
            log(f"online rate {rate}: skipped")
            continue
        bench_args = [
            "--base-url", server.url,
            "--endpoint", "chat",
            "--preset", plan.online_preset,
            "--arrival", "poisson", "--rate", str(rate),
            "--duration", f"{duration:.1f}", "--warmup", str(plan.online_warmup_s),
            "--tokenizer", "byte", "--seed", str(i),
            "--no-html", "--label", f"poisson-{rate:g}",
            *plan.online_lengths,
        ]  # fmt: skip
        run["duration_s"] = round(duration, 1)
        log(f"online rate {rate}/s for {duration:.0f} s")
        # Past its slot the bench gets SIGINT: it cancels what is in flight and still writes its result.
        done = run_bench(
            bench_args,
            tmp / f"bench-rate{rate:g}",
            deadline_s=duration + plan.online_tail_s + RUN_OVERHEAD_S,
            tailserve=(sys.executable, "-m", "tailserve.cli"),
        )
        run["returncode"] = done.exit_code
        if done.interrupted:
            run["interrupted"] = "in-flight requests outlived the run's time slot; cancelled"
        result = done.result()
        if result is None:
            run["error"] = "no result file"
            run["log_tail"] = done.log_path.read_text(errors="replace")[-3000:]
            continue
        run |= bench_summary(result)
        run["result_file"] = str(done.json_path)
        suite.save()
        log(
            f"online rate {rate}/s: P99 TTFT {run.get('p99_ttft_s')} s, P99 TPOT {run.get('p99_tpot_ms')} ms, "
            f"SLOs {'pass' if run.get('slo_all_pass') else 'FAIL'}"
        )
    return server


def bench_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers a reader wants from a bench result document."""
    metrics = result.get("metrics") or {}

    def p(name: str, key: str, scale: float = 1.0) -> float | None:
        m = metrics.get(name) or {}
        v = m.get(key)
        return round(v * scale, 4) if isinstance(v, int | float) else None

    slo = result.get("slo") or {}
    return {
        "status": result.get("status"),
        "counts": result.get("counts"),
        "p50_ttft_s": p("ttft_s", "p50"),
        "p99_ttft_s": p("ttft_s", "p99"),
        "p50_tpot_ms": p("tpot_s", "p50", 1e3),
        "p99_tpot_ms": p("tpot_s", "p99", 1e3),
        "p99_e2e_s": p("e2e_s", "p99"),
        "p99_over_mean_ttft": p("ttft_s", "p99_over_mean"),
        "throughput": result.get("throughput"),
        "slo_verdicts": slo.get("verdicts"),
        "slo_all_pass": slo.get("all_pass"),
        "errors": (result.get("errors") or {}).get("by_kind"),
    }
