"""`tailserve eval`: run the quality gate for one weight format (or all) and print the figures.

Exit status 0 when every evaluated format passes, 1 when one fails, 2 on a usage or model error.
Imports nothing heavy at module level (the CLI tree is built on every `tailserve` call).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FORMATS = ("fp32", "bf16", "int4", "int8")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "eval", help="quality gate: a weight format's logits against fp32 on held-out text"
    )
    p.add_argument("--model", default="default", help="HF directory, .gguf file or default")
    p.add_argument("--weight-format", default="all", choices=(*FORMATS, "all"), help="default: all")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--tokens", type=int, default=4096, help="teacher-forced positions scored (default 4096)")
    p.add_argument("--greedy-prompts", type=int, default=16, help="greedy-agreement prompts (default 16)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--min-top1", type=float, default=0.95, help="gate: least top-1 agreement (default 0.95)")
    p.add_argument(
        "--max-ppl-ratio", type=float, default=1.01, help="gate: most ppl(format)/ppl(fp32) (default 1.01)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: cores - 1, min 1)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where results live (default: $TAILSERVE_CACHE_DIR/quality, else ~/.cache/tailserve/quality)",
    )
    p.add_argument("--no-cache", action="store_true", help="measure again even when a cached result exists")
    p.add_argument("--json", action="store_true", help="print the results as JSON lines")
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os

    import torch

    from tailserve.errors import TailserveError
    from tailserve.quality.evaluate import EvalPlan
    from tailserve.quality.gate import GateResult, GateThresholds, QualityGate, buildable_formats

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.model.startswith("dummy:"):
        print("error: dummy weights are random; there is no quality to measure", file=sys.stderr)
        return 2
    if args.tokens < 2 or args.greedy_prompts < 1 or args.greedy_tokens < 1:
        print("error: --tokens must be >= 2, --greedy-prompts and --greedy-tokens >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.min_top1 <= 1 or args.max_ppl_ratio <= 0:
        print("error: --min-top1 must be in [0, 1] and --max-ppl-ratio > 0", file=sys.stderr)
        return 2
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(args.num_threads or max(1, cores - 1))
    formats = FORMATS if args.weight_format == "all" else (args.weight_format,)
    available = buildable_formats(device)
    results: list[GateResult] = []
    try:
        plan = EvalPlan(
            tokens=args.tokens,
            window_tokens=min(128, args.tokens),
            greedy_prompts=args.greedy_prompts,
            greedy_tokens=args.greedy_tokens,
        )
        gate = QualityGate(
            args.model,
            device,
            GateThresholds(args.min_top1, args.max_ppl_ratio),
            plan,
            cache_dir=args.cache_dir,
        )
        for fmt in formats:
            if fmt not in available:
                if args.weight_format != "all":
                    raise TailserveError(f"weight format {fmt} is not available ({', '.join(available)} are)")
                print(f"{fmt}: not available on {device.type}, skipped", file=sys.stderr)
                continue
            results.append(gate.result(fmt, args.kv_cache_dtype, use_cache=not args.no_cache))
    except TailserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for r in results:
            print(json.dumps(dataclasses.asdict(r)))
    else:
        print(_table(results))
    return 0 if all(r.passed for r in results) else 1


def _table(results: list[Any]) -> str:
    """A fixed-width table: both gate figures overall and per phase, greedy agreement, verdict."""
    head = ["format", "kv", "tokens", "top1", "ppl", "ppl fp32", "ratio", "top1 pre/dec", "ratio pre/dec"]
    head += ["greedy same", "greedy prefix", "gate", "from"]
    rows = [head]
    for r in results:
        rows.append(
            [
                r.weight_format,
                r.kv_cache_dtype,
                str(r.tokens),
                f"{r.top1:.2%}",
                f"{r.ppl:.3f}",
                f"{r.ppl_ref:.3f}",
                f"{r.ppl_ratio:.4f}",
                f"{r.prefill_top1:.1%}/{r.decode_top1:.1%}",
                f"{r.prefill_ppl_ratio:.4f}/{r.decode_ppl_ratio:.4f}",
                f"{r.greedy_identical:.0%}",
                f"{r.greedy_prefix_tokens:.1f}/{r.greedy_tokens}",
                "pass" if r.passed else "FAIL",
                f"{r.origin} {r.seconds:.0f}s",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    if results:
        r0 = results[0]
        lines.append(
            f"gate: top-1 >= {r0.min_top1:.1%} and ppl ratio <= {r0.max_ppl_ratio:.4f} on prefill rows and on "
            f"decode rows each; model {r0.model} ({r0.model_fingerprint[:12]}), {r0.device}"
        )
    return "\n".join(lines)
