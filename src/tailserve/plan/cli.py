"""`tailserve plan` and `tailserve doctor`: argument parsing and exit codes, nothing else.

Imports only the light planner modules; a PlanError becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tailserve.plan import capacity, doctor, report
from tailserve.plan.catalog import build_catalog
from tailserve.plan.errors import PlanError
from tailserve.plan.shapes import PRESETS, resolve_model

EXIT_BAD_INPUT = 2


def _add_plan(subparsers: Any) -> None:
    """The `plan` sub-command."""
    presets = ", ".join(shape.name for shape in PRESETS)
    parser = subparsers.add_parser(
        "plan",
        help="capacity arithmetic: weights, KV per token, max concurrency, decode floor vs the TPOT SLO",
        description="Capacity plan for serving a model on a GPU type. Every figure is a best case.",
    )
    parser.add_argument(
        "--model", required=True, help=f"HF config.json / model directory, or a preset: {presets}"
    )
    parser.add_argument("--gpu", required=True, help="GPU name from the catalog (e.g. H100, 'A100 80GB', T4)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per replica (tensor parallel), default 1")
    parser.add_argument("--dtype", choices=capacity.WEIGHT_DTYPES, default="bf16", help="weight dtype")
    parser.add_argument(
        "--kv-dtype", choices=capacity.KV_DTYPES, default="auto", help="KV-cache dtype (auto: 16-bit)"
    )
    parser.add_argument("--context", type=int, default=4096, help="tokens per request, prompt + output")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent requests to plan for")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90, help="share of memory used")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per engine step")
    parser.add_argument("--tpot-slo-ms", type=float, default=capacity.TPOT_SLO_S * 1e3, help="TPOT SLO")
    parser.add_argument(
        "--interconnect-gb-s",
        type=float,
        default=capacity.INTERCONNECT_GB_S,
        help="per-GPU all-reduce bandwidth for --gpus > 1 (default: PCIe 5; NVLink 4 ~450)",
    )
    parser.add_argument("--gpu-catalog", type=Path, help="JSON or TOML file adding / overriding GPUs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.set_defaults(func=run_plan)


def _add_doctor(subparsers: Any) -> None:
    """The `doctor` sub-command."""
    parser = subparsers.add_parser(
        "doctor",
        help="read-only report on GPU and host settings that hurt tail latency",
        description="Inspect clocks, MIG, MPS, ECC, PCIe, NUMA, CUDA env and CPU governor. Changes nothing.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.set_defaults(func=run_doctor)


def register(subparsers: Any) -> None:
    """Add `plan` and `doctor` to the top-level parser."""
    _add_plan(subparsers)
    _add_doctor(subparsers)


def run_plan(args: argparse.Namespace) -> int:
    """Handler of `tailserve plan`."""
    try:
        request = capacity.PlanRequest(
            model=resolve_model(args.model),
            gpu=build_catalog(args.gpu_catalog).get(args.gpu),
            num_gpus=args.gpus,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            context_tokens=args.context,
            concurrency=args.concurrency,
            gpu_memory_utilization=args.gpu_memory_utilization,
            token_budget=args.token_budget,
            tpot_slo_s=args.tpot_slo_ms / 1e3,
            interconnect_gb_s=args.interconnect_gb_s,
        )
    except PlanError as exc:
        print(f"tailserve plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    plan = capacity.make_plan(request)
    print(json.dumps(report.to_json_dict(plan), indent=2) if args.json else report.render_text(plan))
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    """Handler of `tailserve doctor`: always exits 0, the findings are the result."""
    result = doctor.run_doctor()
    print(json.dumps(doctor.to_json_dict(result), indent=2) if args.json else doctor.render_text(result))
    return 0
