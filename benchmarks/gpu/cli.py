"""GPU suite: copy bandwidth and the decode floor, engine decode steps against that floor with CUDA
graphs and eager (`ModelConfig.enforce_eager`), offline throughput against transformers' continuous
batching, and online P99s via `tailserve serve` + `bench`.

Sized to finish in 8 minutes on one H200 (a global time budget trims or skips what no longer fits).
Every section records its numbers or its error in one JSON (rewritten after each section); none
stops the others. Random weights with the model's real shapes: speed only, never quality.

    python benchmarks/gpu_suite.py --out gpu.json                        # dummy:llama-3.1-8b, bf16, CUDA
    python benchmarks/gpu_suite.py --device cpu --model dummy:tiny --quick --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from proc import ServerProcess

from gpu.hf_worker import hf_worker, section_transformers
from gpu.in_process import MODES, engine_sections, section_bandwidth
from gpu.online import section_online, server_process
from gpu.suite import QUICK, T0, Plan, Suite, environment, json_default, log

SECTIONS = ("bandwidth", "decode", "offline", "transformers", "online")


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    s = doc["sections"]
    out: dict[str, Any] = {"copy_bandwidth_gb_s": s.get("bandwidth", {}).get("copy_bandwidth_gb_s")}
    for mode in MODES:
        rec = s.get(mode, {})
        out[f"{mode}_ran"] = rec.get("status") == "ok" and bool(rec.get("engine"))
        out[f"{mode}_decode_graphs"] = (rec.get("engine") or {}).get("decode_graphs")
        for row in (rec.get("decode") or {}).get("batches", []):
            entry = out.setdefault(f"decode_b{row['batch']}", {"floor_ms": row.get("floor_ms")})
            entry[f"{mode}_step_over_floor"] = row.get("step_over_floor")
        out.setdefault("offline_output_tok_s", {})[mode] = (rec.get("offline") or {}).get(
            "output_tokens_per_s"
        )
    ours = next((v for v in out["offline_output_tok_s"].values() if v), None)  # default mode first
    theirs = s.get("transformers", {}).get("output_tokens_per_s")
    out["offline_output_tok_s"]["transformers"] = theirs
    if ours and theirs:
        out["offline_speedup_vs_transformers"] = round(ours / theirs, 2)
    out["online"] = [
        {k: r.get(k) for k in ("rate_per_s", "p99_ttft_s", "p99_tpot_ms", "slo_all_pass", "skipped", "error")}
        for r in s.get("online", {}).get("runs", [])
    ]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_suite.json", help="result JSON path")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument(
        "--weight-format",
        default="auto",
        help="tailserve's --weight-format (auto: bf16 on CUDA, fp32 on CPU)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="global time budget (default 7 min: stopping children and the server can add ~30 s)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--hf-attn", default="paged|sdpa", help="transformers attn_implementation")
    ap.add_argument("--online-rates", help="comma list of Poisson rates (req/s) for the online section")
    ap.add_argument(
        "--online-output-len",
        help="bench --output-len for the online runs; 'preset' keeps the chat preset's 256-1024 "
        "(default uniform:128,384: chat inputs, outputs cut so three rates fit the budget)",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="start the server only when the online section begins (default: at once, so its CPU-side "
        "weight draw overlaps the in-process sections)",
    )
    ap.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def chosen_plan(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else Plan()
    if args.online_rates:
        plan = dataclasses.replace(plan, online_rates=tuple(float(r) for r in args.online_rates.split(",")))
    if args.online_output_len:
        extra = () if args.online_output_len == "preset" else ("--output-len", args.online_output_len)
        plan = dataclasses.replace(plan, online_lengths=extra)
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_worker is not None:
        return hf_worker(args.hf_worker, Path(args.out))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    plan = chosen_plan(args)
    wanted = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = wanted - set(SECTIONS)
    if unknown:
        print(f"unknown sections: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite-", dir=out.parent))
    suite = Suite(out, args.budget_s)
    suite.doc = {
        "suite": "tailserve-gpu-suite",
        "schema_version": 2,  # 2: decode/offline per mode (cuda_graphs, eager), engine steps timed
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k != "hf_worker"},
        "plan": plan.__dict__,
        "env": environment(device),
        "artifacts_dir": str(tmp),
        "sections": {},
    }
    suite.save()
    log(f"results -> {out}; env {suite.doc['env']}")

    server: ServerProcess | None = None
    if "online" in wanted and not args.no_overlap:
        try:
            server = server_process(args, plan, tmp / "server.log")
        except Exception as exc:  # noqa: BLE001 - the online section retries and records
            log(f"early server start failed: {exc}")
    try:
        bw: float | None = None
        if "bandwidth" in wanted:
            holder: dict[str, float] = {}
            suite.run(
                "bandwidth", lambda rec: holder.__setitem__("bw", section_bandwidth(rec, device, plan)), 10
            )
            bw = holder.get("bw")
        reserve = plan.reserve_online_s if "online" in wanted else 0.0
        if wanted & {"decode", "offline"}:
            engine_sections(suite, args, plan, device, bw, wanted, reserve)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "transformers" in wanted:
            suite.run(
                "transformers", lambda rec: section_transformers(rec, args, plan, suite, tmp), reserve + 45
            )
        if "online" in wanted:

            def online(rec: dict[str, Any]) -> None:
                nonlocal server
                server = section_online(rec, server, args, plan, suite, tmp)

            suite.run("online", online, 30)
    finally:
        if server is not None:
            log("stopping the server")
            server.stop()
            suite.doc.setdefault("sections", {}).setdefault("online", {})["server_log_tail"] = (
                server.log_tail(40)
            )
        suite.doc["summary"] = summarize(suite.doc)
        suite.save()
    log(f"done in {time.perf_counter() - T0:.0f} s -> {out}")
    print(json.dumps(suite.doc["summary"], indent=2, default=json_default))
    return 0
