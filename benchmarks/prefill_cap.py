"""The prefill floor of the `slo` policy (commit a82a433, "prefill keeps at least a quarter of the
step budget") measured on and off: the same long-tail chat workload against `tailserve serve
--prefill-floor 0.25` and `--prefill-floor 0` (the cap may then fall to one block), P99 TTFT and
TPOT with their 95% intervals and the number of requests each rests on.

    .venv/bin/python benchmarks/prefill_cap.py --quick                      # smoke run, tiny sizes
    .venv/bin/python benchmarks/prefill_cap.py --rate 0.8 --requests 440 --out bench-results/prefill-cap

Each configuration gets its own server (started, warmed up, then measured, then stopped); with
--repeats N the configurations alternate N times, so a drift of the machine hits both. Load comes
from `tailserve bench run` (Poisson arrivals, completions endpoint, exact lengths with the model's
tokenizer, greedy, ignore_eos); the first tenth of each run is warm-up and not counted. Writes
OUT.json and OUT.md; the table also goes to stdout. Pick --rate near 80% of the server's capacity
(`tailserve bench capacity`): the floor only matters when prefill and decodes compete.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from loadgen import run_bench
from machine import git_commit, machine_line
from peers import envs, launch
from peers.launch import Limits
from proc import ServerProcess, free_port

FLOORS = (0.25, 0.0)  # the a82a433 floor, and none (one block)


def bench_args(url: str, args: argparse.Namespace, label: str, warmup: bool) -> list[str]:
    requests = 4 if warmup else args.requests
    rate = args.rate * 2 if warmup else args.rate
    return [
        "--base-url", url, "--endpoint", "completions", "--tokenizer", str(envs.ensure_hf_dir()),
        "--arrival", "poisson", "--rate", f"{rate:g}", "-n", str(requests),
        "--warmup-requests", "0" if warmup else str(max(requests // 10, 1)),
        "--input-len", args.input_len, "--output-len", args.output_len,
        "--timeout", "900", "--seed", str(args.seed), "--no-html", "--calibrate" if not warmup else "--no-calibrate",
        "--slo-ttft", "off", "--slo-tpot-ms", "off", "--slo-e2e", "off",
        "--label", label, "--extra-body", json.dumps(launch.GREEDY),
    ]  # fmt: skip


def figures(result: dict[str, Any] | None) -> dict[str, Any]:
    """P99, its interval and the sample count of TTFT and TPOT (and slowdown when calibrated)."""
    if result is None:
        return {"error": "no result file"}
    out: dict[str, Any] = {"ok": result["counts"]["ok"], "failed": result["counts"]["failed"]}
    out["errors"] = result.get("errors", {}).get("by_kind", {})
    for name in ("ttft_s", "tpot_s", "slowdown", "queue_delay_s"):
        summary = (result.get("metrics") or {}).get(name)
        if summary:
            out[name] = {k: summary.get(k) for k in ("count", "mean", "p99", "p99_ci", "p99_over_mean")}
    return out


def measure(floor: float, run: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    port = free_port()
    limits = Limits(threads=args.threads, max_seqs=args.max_seqs, step_tokens=args.step_tokens)
    extra = ("--prefill-floor", f"{floor:g}")
    spec = launch.tailserve("slo", port, limits, slo=(args.slo_ttft, args.slo_tpot), extra_args=extra)
    name = f"floor-{floor:g}-run{run}"
    print(f"[prefill-cap] {name}: starting", file=sys.stderr, flush=True)
    with ServerProcess(
        spec.command, port, out_dir / name / "server.log", spec.ready_path, spec.env, envs.ROOT
    ) as s:
        s.wait_ready(args.start_timeout)
        run_bench(bench_args(s.url, args, f"{name} warm-up", warmup=True), out_dir / name / "warmup")
        done = run_bench(bench_args(s.url, args, name, warmup=False), out_dir / name / "measured")
    return {"floor": floor, "run": run, "command": " ".join(spec.command), **figures(done.result())}


def _p99(row: dict[str, Any], name: str, scale: float) -> str:
    s = row.get(name)
    if not s or s.get("p99") is None:
        return "-"
    ends = [("-" if end is None else f"{end * scale:.0f}") for end in (s.get("p99_ci") or [None, None])[:2]]
    # An open upper end: too few requests for the interval to close (about 300 are needed at 95%).
    return f"{s['p99'] * scale:.0f} [{ends[0]}, {ends[1]}] (n={s['count']})"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Prefill floor on/off: {doc['date']}, {doc['machine']}, commit {doc['commit']}",
        "",
        f"Command: `{doc['command']}`",
        "",
        "| --prefill-floor | run | measured ok | failed (429s) | TTFT P99 ms [95% CI] | TPOT P99 ms [95% CI] | slowdown P99 |",
        "| ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]  # fmt: skip
    for row in doc["runs"]:
        slow = row.get("slowdown") or {}
        slowdown = f"{slow['p99']:.2f}" if slow.get("p99") is not None else "-"
        lines.append(
            f"| {row['floor']:g} | {row['run']} | {row.get('ok', '-')} "
            f"| {row.get('failed', '-')} ({row.get('errors', {}).get('rate_limited', 0)}) "
            f"| {_p99(row, 'ttft_s', 1000)} | {_p99(row, 'tpot_s', 1000)} | {slowdown} |"
        )
    lines += ["", "Intervals that overlap do not tell the two settings apart."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a few short requests per setting")
    p.add_argument("--rate", type=float, default=0.8, help="requests per second (Poisson)")
    p.add_argument("--requests", type=int, default=440, help="requests per run (a tenth is warm-up)")
    p.add_argument("--input-len", default="longtail:256,2048,0.05", help="tailserve bench --input-len")
    p.add_argument("--output-len", default="uniform:16,128", help="tailserve bench --output-len")
    p.add_argument("--repeats", type=int, default=1, help="alternate the settings this many times")
    p.add_argument("--threads", type=int, default=max((os.cpu_count() or 2) - 1, 1))
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="server --slo-ttft, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.15, help="server --slo-tpot, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="output prefix (default bench-results/prefill-cap-<time>)")
    args = p.parse_args()
    if args.quick:
        args.rate, args.requests, args.input_len, args.output_len = 2.0, 8, "longtail:32,256,0.2", "fixed:8"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or envs.ROOT / "bench-results" / f"prefill-cap-{stamp}")
    out_dir = out.parent / (out.name + "-runs")
    runs = [measure(floor, r, args, out_dir) for r in range(args.repeats) for floor in FLOORS]
    doc = {
        "date": stamp,
        "machine": machine_line(),
        "commit": git_commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    Path(str(out) + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
