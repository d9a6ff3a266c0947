"""`tailserve bench [run|capacity|compare]`: argument parsing only.

Imports nothing heavy at module level; the handler imports `tailserve.bench.app` when a bench
command actually runs. Options are documented in docs/BENCH.md.
"""

from __future__ import annotations

import argparse
from typing import Any

_PRESETS = ("chat", "chat-scaled", "code", "summarize", "cpu-chat")  # = bench.workload.PRESETS (tested)
_ARRIVALS = ("poisson", "gamma", "constant", "ramp", "closed")


def register(subparsers: Any) -> None:
    """Add the `bench` command to the top-level parser."""
    parser = subparsers.add_parser(
        "bench",
        help="SLA load generator for any OpenAI-compatible server (run | capacity | compare)",
        description="Measure TTFT, TPOT, ITL and E2E tails of an OpenAI-compatible server against SLOs. "
        "Actions: run (default), capacity (highest rate meeting the SLOs), compare A.json B.json ...",
    )
    parser.add_argument("action", nargs="?", choices=("run", "capacity", "compare"), help="default: run")
    parser.add_argument("files", nargs="*", help="result JSON files (compare only)")
    _target_args(parser.add_argument_group("target"))
    _workload_args(parser.add_argument_group("workload"))
    _arrival_args(parser.add_argument_group("arrivals"))
    _run_args(parser.add_argument_group("run control and output"))
    _slo_args(parser.add_argument_group("SLOs (P99 targets; 'off' disables one)"))
    _capacity_args(parser.add_argument_group("capacity"))
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    """Run the chosen bench action (heavy imports happen here)."""
    from tailserve.bench.app import handle

    return handle(args)


def _target_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    g.add_argument("--no-usage", action="store_true", help="do not send stream_options.include_usage")
    g.add_argument("--extra-body", help="JSON object merged into every request body")


def _workload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--preset", choices=_PRESETS, default="cpu-chat", help="scenario (default cpu-chat)")
    g.add_argument(
        "--input-len",
        help="fixed:N | uniform:LO,HI | normal:MEAN,STD | lognormal:MEDIAN,SIGMA | "
        "longtail:MEDIAN,LONG,FRACTION[,SIGMA]",
    )
    g.add_argument("--output-len", help="as --input-len; enforced with max_tokens (+ ignore_eos)")
    g.add_argument(
        "--tokenizer", help="HF tokenizer dir or tokenizer.json for exact lengths; 'byte' for byte-level"
    )
    g.add_argument(
        "--shared-prefix-tokens", type=int, default=0, help="system prompt length shared by requests"
    )
    g.add_argument(
        "--shared-prefix-fraction", type=float, default=0.0, help="fraction carrying the shared prefix"
    )
    g.add_argument("--turns", type=int, default=1, help="turns per conversation (multi-turn, history resent)")
    g.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    g.add_argument("--trace", help="JSONL trace to replay (timestamp, prompt or input length, output length)")
    g.add_argument("--trace-speed", type=float, default=1.0, help="replay speed factor (2 = twice as fast)")
    g.add_argument("--seed", type=int, default=0)


def _arrival_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--arrival", choices=_ARRIVALS, help="arrival process (default: the preset's)")
    g.add_argument("--rate", type=float, help="requests per second (open loop)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    g.add_argument("--ramp-to", type=float, help="ramp: final rate (req/s)")
    g.add_argument(
        "--ramp-duration", type=float, help="ramp: seconds to reach --ramp-to (default: whole run)"
    )
    g.add_argument("--concurrency", type=int, help="closed loop: concurrent users")
    g.add_argument(
        "--max-concurrency", type=int, help="open loop: cap on requests in flight (waits are client queueing)"
    )


def _run_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("-n", "--requests", type=int, help="number of requests")
    g.add_argument("--duration", type=float, help="seconds of sending")
    g.add_argument(
        "--warmup", type=float, help="seconds at the start whose requests are excluded (not with -n)"
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        help="first N requests excluded (default with -n: a tenth of them; else 0)",
    )
    g.add_argument(
        "--cooldown", type=float, default=0.0, help="seconds at the end whose requests are excluded"
    )
    g.add_argument(
        "--window",
        "--window-s",
        dest="window",
        type=float,
        default=30.0,
        help="seconds per window for P99-over-time (a soak: 300)",
    )
    g.add_argument(
        "--ci-level", type=float, default=0.95, help="confidence level of every percentile's interval"
    )
    g.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first measure idle TTFT vs prompt length, for slowdown and queue delay "
        "(default: on for longtail input lengths)",
    )
    g.add_argument(
        "--calibration-repeats", type=int, default=3, help="calibration requests per prompt length"
    )
    g.add_argument(
        "--out", help="output path prefix for .json/.jsonl/.html (default bench-results/<action>-<time>)"
    )
    g.add_argument("--no-html", action="store_true", help="skip the HTML report")
    g.add_argument("--label", help="name of this run in reports and compare")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line (default: when stderr is a terminal)",
    )
    g.add_argument("--fail-on-slo", action="store_true", help="exit 3 when an SLO fails")


def _slo_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--slo-ttft", help="P99 TTFT target in seconds (default 2)")
    g.add_argument("--slo-tpot-ms", help="P99 TPOT target in milliseconds (default 30)")
    g.add_argument("--slo-e2e", help="P99 E2E target in seconds (default 5)")
    g.add_argument("--slo-error-rate", help="largest failed fraction (default 0.01)")


def _capacity_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--rate-start", type=float, default=1.0, help="capacity: first rate probed (req/s)")
    g.add_argument("--rate-max", type=float, default=256.0, help="capacity: highest rate probed")
    g.add_argument("--growth", type=float, default=2.0, help="capacity: rate multiplier during the ramp")
    g.add_argument("--tolerance", type=float, default=0.05, help="capacity: bisect down to this relative gap")
    g.add_argument("--probe-duration", type=float, default=60.0, help="capacity: seconds per probe run")
    g.add_argument(
        "--conservative",
        action="store_true",
        help="capacity: a probe passes only when the upper ends of its P99 intervals meet the SLOs",
    )
