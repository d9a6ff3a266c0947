"""tailserve (`fcfs`, `slo`) against vLLM's CPU engine, llama.cpp's server and `transformers serve
--continuous-batching`, with enough requests per point for a P99 to carry an interval.

Phase 1 starts each server alone per workload and calibrates it (idle TTFT against prompt length);
the SLO is set from those calibrations and frozen in the results folder. Phase 2 searches each
server's capacity under it (probes judged by the upper ends of the P99 intervals) and runs its rate
points (80% of capacity, 1.5x and 2x for overload, the shared reference rate, half of capacity, as
its time budget allows). `--soak` runs the 30-minute soak. Every point is saved as it completes:
rerunning the same command with the same --out resumes. Follow it with `tail -f DIR/progress.log`.

    .venv/bin/python benchmarks/compare_engines.py --out bench-results/compare-full     # hours
    .venv/bin/python benchmarks/compare_engines.py --out bench-results/compare-full --soak ts-slo,best
    .venv/bin/python benchmarks/compare_engines.py --quick                              # minutes
    .venv/bin/python benchmarks/compare_engines.py --render bench-results/compare-full
    .venv/bin/python benchmarks/compare_engines.py --across bench-results/compare-seed0 bench-results/compare-seed1
    .venv/bin/python benchmarks/compare_engines.py fast-path --quick    # one stream and 16: compare/fast_path.py

Drives servers over HTTP and subprocesses only: from tailserve it imports only the bench's statistics
(tailserve.bench: intervals and nearest-rank percentiles), never the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import CpuLog, git_commit, machine_line
from peers import envs
from peers.launch import Limits

from compare import across, fast_path, report, stats
from compare import plan as planning
from compare.analyze import Slo
from compare.run import (
    OTHER_SERVERS,
    REFERENCE,
    SERVERS,
    Context,
    calibrate,
    interleave,
    measure,
    replay,
    soak,
    source_points,
)
from compare.store import Store

QUICK_SERVERS = ("ts-slo", "llamacpp")


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so every server is stopped on the way out."""
    raise KeyboardInterrupt


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="`compare_engines.py fast-path [FLAGS]` instead measures one stream and sixteen, a 1,600-token "
        "prefill and cold start against the same peers (compare_engines.py fast-path --help)",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"tiny sizes, {' + '.join(QUICK_SERVERS)} (development)"
    )
    p.add_argument(
        "--servers", help=f"comma list of {', '.join(SERVERS + OTHER_SERVERS)} (default: the first five)"
    )
    p.add_argument(
        "--workloads", default=",".join(planning.WORKLOADS), help="comma list of longtail, multiturn"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="results folder; an existing one is resumed (default bench-results/compare-<time>)",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        help="multiply every prompt and output length by this (default 1: the issue's shapes); "
        "frozen in the results folder by its first run",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slo-factor",
        type=float,
        default=1.5,
        help="TTFT target = this x the fastest idle TTFT of the longest prompt",
    )
    p.add_argument("--slo-ttft", type=float, help="TTFT target in s (instead of the calibrated one)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT target in ms")
    p.add_argument(
        "--point-requests",
        type=int,
        help="measured requests per rate point (default 368: a bounded P99 interval)",
    )
    p.add_argument("--probe-requests", type=int, help="measured requests per capacity probe (default 368)")
    p.add_argument(
        "--rate-start",
        type=rate_starts,
        help="first capacity probe, req/s: RATE for every server, SERVER=RATE,... per server, or both "
        "(default: twice one stream's service rate; a start near capacity saves the slow low-rate "
        "probes that large probes make costly)",
    )
    p.add_argument("--growth", type=float, help="the search's ramp factor (default 2; must be > 1)")
    p.add_argument(
        "--tolerance", type=float, help="stop when the pass / fail bracket is this close (default 0.15)"
    )
    p.add_argument(
        "--budget-h",
        type=float,
        help="hours per server and workload; rate points that do not fit are left out (default 3)",
    )
    p.add_argument(
        "--rate-max", type=float, default=20.0, help="highest rate the capacity search probes, req/s"
    )
    p.add_argument(
        "--soak",
        help="comma list of servers to soak ('best' = the peer with the highest long-tail capacity); runs only the soak",
    )
    p.add_argument("--soak-min", type=float, default=30.0, help="soak minutes")
    p.add_argument(
        "--soak-window",
        type=float,
        help="soak window seconds, at least 300 (default: max(300, 368 requests / rate)); longer "
        "windows hold more requests, so each window's P99 interval is narrower",
    )
    p.add_argument(
        "--soak-rate", type=float, help="soak rate req/s (default 80%% of the server's long-tail capacity)"
    )
    p.add_argument(
        "--search-only",
        action="store_true",
        help="capacity searches only: every rate point is left out (listed as such)",
    )
    p.add_argument(
        "--replay",
        metavar="KEY[:NAME,...]",
        help="instead of searching, run --servers at the rates of KEY's saved probes (all, or the saved "
        "runs named: probe-02, at-0.8x, ...) with the same prompts; KEY itself only when it is the one server named (a rerun in a "
        "fresh process)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        metavar="N",
        help="with --replay: interleaved repeats instead; every server named (KEY too) up at once, each "
        "probe run N times on each in alternating order (A B, B A, ...)",
    )
    p.add_argument("--render", type=Path, metavar="DIR", help="only write the report of DIR")
    p.add_argument(
        "--across",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="only print the long-tail capacity across these folders (one prompt draw each: --seed N), "
        "under the conservative and the point P99, with the ratio to the best peer per draw",
    )
    p.add_argument("--doc", type=Path, help="also write the markdown here (e.g. docs/COMPARE.md)")
    args = p.parse_args(argv)
    if args.growth is not None and not args.growth > 1:
        p.error(f"--growth must be > 1 (got {args.growth:g})")
    if args.tolerance is not None and not args.tolerance > 0:
        p.error(f"--tolerance must be > 0 (got {args.tolerance:g})")
    if args.rate_start and (unknown := sorted(set(args.rate_start) - {"*", *SERVERS, *OTHER_SERVERS})):
        p.error(
            f"--rate-start: unknown server {', '.join(unknown)} (one of {', '.join(SERVERS + OTHER_SERVERS)})"
        )
    if args.soak_window is not None and not 300 <= args.soak_window <= args.soak_min * 60:
        p.error(f"--soak-window must be at least 300 s and at most the soak ({args.soak_min * 60:g} s)")
    return args


def sizes_of(args: argparse.Namespace) -> planning.Sizes:
    sizes = planning.QUICK if args.quick else planning.full_sizes()
    changes: dict[str, Any] = {}
    if args.point_requests:
        changes["point_requests"] = args.point_requests
    if args.probe_requests:
        changes["probe_requests"] = args.probe_requests
    if args.budget_h:
        changes["budget_s"] = args.budget_h * 3600
    for name in ("rate_start", "growth", "tolerance"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return dataclasses.replace(sizes, **changes)


def rate_starts(text: str) -> dict[str, float]:
    try:
        return planning.parse_rate_start(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def frozen_slo(
    store: Store, workload: planning.Workload, keys: Sequence[str], args: argparse.Namespace
) -> Slo | None:
    """The workload's SLO: saved in the folder once set, so a resumed or extended run keeps it."""
    if (saved := store.load(f"slo-{workload.name}")) is not None:
        return Slo(**saved)
    tpot_s = args.slo_tpot_ms / 1000
    if args.slo_ttft:
        slo = Slo(args.slo_ttft, tpot_s, basis=f"TTFT target given (--slo-ttft {args.slo_ttft:g})")
    else:
        idle = {
            k: d["idle_ttft_longest_s"] for k in keys if (d := store.load(k, workload.name, "calibration"))
        }
        if not idle:
            return None
        fastest = min(idle, key=lambda k: idle[k])
        slo = Slo(
            round(args.slo_factor * idle[fastest], 2),
            tpot_s,
            basis=(
                f"TTFT target = {args.slo_factor:g} x the fastest idle TTFT of this workload's longest prompt "
                f"({workload.longest_tokens} tokens: {idle[fastest]:.2f} s, {fastest}; idle, per server: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in idle.items())
                + f"); TPOT target {args.slo_tpot_ms:g} ms"
            ),
        )
    store.save(dataclasses.asdict(slo), f"slo-{workload.name}")
    store.log(
        f"{workload.name}: SLO P99 TTFT <= {slo.ttft_s:g} s, P99 TPOT <= {slo.tpot_s * 1000:g} ms ({slo.basis})"
    )
    return slo


def record_invocation(
    store: Store, argv: Sequence[str] | None, args: argparse.Namespace, sizes: planning.Sizes
) -> None:
    doc = store.load("run")
    if doc is None:  # a new folder: its capacity probes share one prompt sequence (run.Context)
        doc = {"invocations": [], "probe_prompts": "common"}
    doc["invocations"].append(
        {
            "command": shlex.join(
                ["benchmarks/compare_engines.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine_line(),
            "git_commit": git_commit(),
            "load": [round(x, 2) for x in os.getloadavg()],
        }
    )
    doc.setdefault("sizes", dataclasses.asdict(sizes))
    doc.setdefault("threads", args.threads)
    doc.setdefault("seed", args.seed)
    doc.setdefault("length_scale", args.length_scale or 1.0)
    doc.setdefault("probe_prompts", "own")  # a folder from before: its probes drew their own
    doc["quick"] = args.quick
    store.save(doc, "run")


def capacity_saved(store: Store, key: str, workload: str) -> float | None:
    done = store.load(key, workload, "points")
    return float(done["capacity"]) if done and done.get("complete") else None


def soak_targets(store: Store, names: Sequence[str]) -> list[str]:
    """The servers to soak; 'best' is the peer (not tailserve) with the highest long-tail capacity."""
    keys = []
    for name in names:
        if name != "best":
            keys.append(name)
            continue
        caps = {
            k: c
            for k in SERVERS + OTHER_SERVERS
            if not k.startswith("ts-") and (c := capacity_saved(store, k, "longtail"))
        }
        if not caps:
            sys.exit("--soak best: no peer has a saved long-tail capacity yet (run the comparison first)")
        keys.append(max(caps, key=lambda k: caps[k]))
    return keys


def length_scale(store: Store, args: argparse.Namespace) -> float:
    """The folder's length scale: set by its first run; a resumed run may not change it (its saved
    points and SLO belong to those lengths)."""
    saved = (store.load("run") or {}).get("length_scale")
    if saved is not None and args.length_scale is not None and args.length_scale != saved:
        sys.exit(
            f"{store.root} holds lengths x{saved:g}; --length-scale {args.length_scale:g} would mix them"
        )
    scale = float(saved if saved is not None else args.length_scale or 1.0)
    try:
        planning.scaled_workloads(scale)
    except ValueError as exc:
        sys.exit(str(exc))
    return scale


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fast-path"]:  # its own question and flags (compare/fast_path.py)
        return fast_path.main(argv[1:])
    args = parse_args(argv)
    if args.render:
        report.write(Store(args.render), args.doc)
        return 0
    if args.across:
        missing = [str(d) for d in args.across if not (d / "run.json").exists()]
        if missing:
            sys.exit(f"--across: not a comparison folder (no run.json): {', '.join(missing)}")
        print("\n".join(across.across_table([Store(d) for d in args.across])))
        return 0
    signal.signal(signal.SIGTERM, interrupt)
    keys = [k for k in (args.servers or ",".join(QUICK_SERVERS if args.quick else SERVERS)).split(",") if k]
    unknown = set(keys) - set(SERVERS + OTHER_SERVERS)
    if args.replay and (source := args.replay.partition(":")[0]) not in SERVERS + OTHER_SERVERS:
        sys.exit(f"--replay: unknown server {source!r} (one of {', '.join(SERVERS + OTHER_SERVERS)})")
    if args.rounds and (not args.replay or args.rounds < 1 or args.rounds > 20):
        sys.exit("--rounds N needs --replay and 1 <= N <= 20")
    keys.sort(key=lambda k: (k != REFERENCE, (SERVERS + OTHER_SERVERS).index(k)))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    store = Store(args.out or envs.ROOT / "bench-results" / f"compare-{stamp}")
    scale = length_scale(store, args)
    known = planning.scaled_workloads(scale)
    workloads = [known[w] for w in args.workloads.split(",") if w in known]
    if unknown or not workloads:
        sys.exit(f"unknown servers {sorted(unknown)} or no known workload in {args.workloads!r}")
    sizes = sizes_of(args)
    record_invocation(store, argv, args, sizes)
    envs.ensure_hf_dir()  # the bench's tokenizer too, so always
    soaked = soak_targets(store, args.soak.split(",")) if args.soak else []
    needed = soaked or keys  # a soak starts only the servers it soaks
    if any(k.startswith(("hf", "llamacpp")) for k in needed):
        envs.ensure_peers_venv()
    if "vllm" in needed:
        envs.ensure_vllm_venv()
    common = (store.load("run") or {}).get("probe_prompts") == "common"
    ctx = Context(store, sizes, args.seed, Limits(threads=args.threads), envs.gguf_path(), common)
    store.log(
        f"results in {store.root}; servers {', '.join(soaked or keys)}; lengths x{scale:g}; sizes {sizes}"
    )
    try:
        with CpuLog(store.root / report.CPU_LOG):  # what the machine did, second by second
            if soaked:
                run_soaks(ctx, soaked, known["longtail"], args)
            else:
                compare_all(ctx, keys, workloads, args)
    except KeyboardInterrupt:
        store.log("interrupted: servers stopped; rerun the same command to resume")
    report.write(store, args.doc)
    return 0


def compare_all(
    ctx: Context, keys: Sequence[str], workloads: Sequence[planning.Workload], args: argparse.Namespace
) -> None:
    store = ctx.store
    if args.replay:  # a named run that is not saved is refused before any server starts
        source, _, names = args.replay.partition(":")
        for workload in workloads:
            wanted = [n for n in names.split(",") if n]
            found = {p["name"] for p in source_points(store, source, workload.name, wanted)}
            if missing := [n for n in wanted if n not in found]:
                sys.exit(f"--replay: {source} has no saved run {', '.join(missing)} in {workload.name}")
    for workload in workloads:
        for key in keys:
            calibrate(ctx, key, workload)
    for workload in workloads:
        slo = frozen_slo(store, workload, keys, args)
        if slo is None:
            store.log(f"{workload.name}: no server calibrated; nothing to measure")
            continue
        if args.replay and args.rounds:
            source, _, names = args.replay.partition(":")
            interleave(
                ctx, list(keys), workload, slo, source, [n for n in names.split(",") if n], args.rounds
            )
            continue
        if args.replay:
            source, _, names = args.replay.partition(":")
            for key in keys:  # the source itself only when it is the one server named: a rerun
                if key != source or keys == [source]:
                    replay(ctx, key, workload, slo, source, [n for n in names.split(",") if n])
            continue
        # Every server also runs at 80% of tailserve (slo)'s capacity (the same offered load for all).
        saved = capacity_saved(store, REFERENCE, workload.name)
        reference = round(0.8 * saved, 4) if saved else None
        for key in keys:
            capacity = measure(ctx, key, workload, slo, reference, args.rate_max, args.search_only)
            if key == REFERENCE and capacity:
                reference = round(0.8 * capacity, 4)


def run_soaks(
    ctx: Context, keys: Sequence[str], workload: planning.Workload, args: argparse.Namespace
) -> None:
    slo = frozen_slo(ctx.store, workload, keys, args) if args.slo_ttft else None
    if slo is None and (slo_doc := ctx.store.load(f"slo-{workload.name}")) is not None:
        slo = Slo(**slo_doc)
    if slo is None:
        sys.exit(
            "--soak: no long-tail SLO in this folder yet (run the comparison into it first, or give --slo-ttft)"
        )
    duration_s = 60.0 if args.quick and args.soak_min == 30.0 else args.soak_min * 60
    for key in keys:
        capacity = capacity_saved(ctx.store, key, workload.name)
        rate = args.soak_rate or (0.8 * capacity if capacity else None)
        if not rate:
            ctx.store.log(f"{key}: no long-tail capacity saved and no --soak-rate: soak skipped")
            continue
        # Windows of at least 5 minutes and enough requests for a bounded P99 interval (368 >= the
        # issue's 300; quick: a third of the run).
        window_s = args.soak_window or (
            duration_s / 3 if args.quick else max(300.0, stats.min_count_bounded(planning.P99) / rate)
        )
        try:
            soak(ctx, key, workload, slo, round(rate, 4), duration_s, window_s)
        except RuntimeError as exc:  # the server did not start: say so, go on with the next
            ctx.store.log(f"{key}: soak failed: {exc}")
