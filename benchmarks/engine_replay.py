"""A bench run's arrivals replayed into an in-process engine (no HTTP), under the `slo` prefill cap
as it is and as it was before 74cf1dd, in alternating rounds.

    .venv/bin/python benchmarks/engine_replay.py --from RUN.jsonl --requests 250 --rounds 2 --out bench-results/engine-replay

RUN.jsonl is what `tailserve bench` saved for a run (a compare probe's `runs/NAME.jsonl`): each
request's send time, prompt length and output length are kept, the prompt's tokens are random ids.
Every request is admitted (no 429: this is the engine, not the server) and runs to its output
length (ignore_eos, greedy). TTFT is from a request's arrival at the engine to its first token;
TPOT is its mean gap after that. The two caps:

- `lifetime` (the code): one step may take what a stream's other gaps leave under its TPOT target,
  its expected remaining gaps priced at the recent step time;
- `banked` (before 74cf1dd): one step may take only the time the stream banked so far, so a stream
  that has just started holds every step to one target.

Rounds alternate `lifetime`, `banked`, then `banked`, `lifetime`, ..., so a drift of the machine
(CPU steal moves on a scale of minutes) falls on both. Each run records the machine's steal over it.
Writes OUT.json and OUT.md; the table also goes to stdout. Never run beside another measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from compare.analyze import read_rows
from machine import cpu_shares, cpu_times, git_commit, machine_line

from tailserve.bench.stats import summarize
from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.policy import SloPolicy
from tailserve.engine.request import Request, SamplingParams, tpot_target_s

CAPS = ("lifetime", "banked")


def banked_budget(policy: SloPolicy) -> Callable[[Sequence[Request], float], float]:
    """The step budget of the cap before 74cf1dd: the time each stream banked so far."""

    def step_budget_s(decodes: Sequence[Request], now: float) -> float:
        budgets = []
        for r in decodes:
            if not r.timings.first_token:
                continue
            tpot = tpot_target_s(r.params, policy.config.slo_tpot_s)
            banked = tpot * r.num_output_tokens - (now - r.timings.first_token)
            budgets.append(min(max(banked, tpot), policy.MAX_ITL_FACTOR * tpot))
        return min(budgets, default=policy.config.slo_tpot_s)

    return step_budget_s


def load_arrivals(path: Path, limit: int) -> list[tuple[float, int, int]]:
    """(send time s, prompt tokens, output tokens) of the run's warm-up and measured requests."""
    kept = [r for r in read_rows(path) if r.get("phase") in ("warmup", "measured") and r.get("input_tokens")]
    return [
        (float(r["scheduled_s"]), int(r["input_tokens"]), max(int(r.get("output_tokens") or 1), 1))
        for r in kept[:limit]
    ]


def engine_for(args: argparse.Namespace, cap: str) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(num_threads=args.threads),
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.step_tokens,
            max_num_seqs=args.max_num_seqs,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot_ms / 1000,
        ),
    )
    engine = LLMEngine(config)
    policy = engine.scheduler.policy
    assert isinstance(policy, SloPolicy)
    if cap == "banked":
        # the rule before 74cf1dd, on this policy object only
        policy.step_budget_s = banked_budget(policy)  # type: ignore[method-assign,assignment]
    return engine


def replay(engine: LLMEngine, arrivals: list[tuple[float, int, int]], seed: int) -> dict[str, Any]:
    """Feed the arrivals at their times; TTFT and TPOT per request, and the steal over the run."""
    rng = random.Random(seed)
    warm = [rng.randrange(1000, 20000) for _ in range(300)]
    engine.add_request("warm", warm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    before = cpu_times()
    t0 = time.monotonic()
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, prompt, output = arrivals[i]
            rid = f"r{i}"
            ids = [rng.randrange(1000, 20000) for _ in range(prompt)]
            engine.add_request(rid, ids, SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0))
            added[rid] = time.monotonic()
            i += 1
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        outs = engine.step()
        done = time.monotonic()
        for out in outs:
            if out.request_id not in added:
                continue
            if out.request_id not in first:
                first[out.request_id] = done
                last[out.request_id] = (done, 1)
            else:
                last[out.request_id] = (done, last[out.request_id][1] + 1)
    shares = cpu_shares(before, cpu_times())
    ttft = [first[r] - added[r] for r in first]
    tpot = [(t - first[r]) / (n - 1) for r, (t, n) in last.items() if n > 1]
    return {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "steal": (shares or {}).get("steal"),
        "wall_s": time.monotonic() - t0,
    }


def fmt(summary: Any, scale: float = 1.0, digits: int = 3) -> str:
    if summary is None:
        return "n/a"
    lo, hi = summary.p99_ci
    lo_s = "?" if lo is None else f"{lo * scale:.{digits}g}"
    hi_s = "?" if hi is None else f"{hi * scale:.{digits}g}"
    return f"{summary.p99 * scale:.{digits}g} [{lo_s}, {hi_s}]"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--from", dest="source", type=Path, required=True, help="a bench run's .jsonl")
    p.add_argument("--requests", type=int, default=250, help="the first N of the run's requests")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=0.55)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=Path("bench-results/engine-replay"))
    args = p.parse_args(argv)
    if not args.source.is_file():
        sys.exit(f"--from: no such file {args.source}")
    if args.requests < 1 or args.rounds < 1:
        sys.exit("--requests and --rounds must be at least 1")
    arrivals = load_arrivals(args.source, args.requests)
    if not arrivals:
        sys.exit(f"--from: {args.source} holds no warm-up or measured request")
    runs = []
    summaries = []  # (TTFT, TPOT) of each run, in the order of runs
    for round_no in range(1, args.rounds + 1):
        for cap in CAPS if round_no % 2 else tuple(reversed(CAPS)):
            result = replay(engine_for(args, cap), arrivals, seed=round_no)
            ttft, tpot = summarize(result["ttft_s"]), summarize(result["tpot_s"])
            runs.append({"round": round_no, "cap": cap, **result})
            summaries.append((ttft, tpot))
            steal = "n/a" if result["steal"] is None else f"{result['steal']:.1%}"
            print(
                f"round {round_no} {cap:8s} P99 TTFT {fmt(ttft)} s  P99 TPOT {fmt(tpot, 1000)} ms  steal {steal}"
            )
    lines = [
        f"# Engine replay of {args.source} ({len(arrivals)} requests)",
        "",
        f"- command: `{' '.join(['benchmarks/engine_replay.py', *(argv or sys.argv[1:])])}`",
        f"- machine: {machine_line()}; commit {git_commit()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- {args.threads} threads, {args.max_num_seqs} sequences, {args.step_tokens} tokens a step, "
        f"TTFT target {args.slo_ttft} s, TPOT target {args.slo_tpot_ms} ms; every request admitted",
        "",
        "| round | cap | TTFT p50 s | P99 TTFT s [95%] | TPOT p50 ms | P99 TPOT ms [95%] | steal |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run, (ttft, tpot) in zip(runs, summaries, strict=True):
        steal = "n/a" if run["steal"] is None else f"{run['steal']:.1%}"
        p50_ttft = "n/a" if ttft is None else f"{ttft.p50:.3g}"
        p50_tpot = "n/a" if tpot is None else f"{tpot.p50 * 1000:.3g}"
        lines.append(
            f"| {run['round']} | {run['cap']} | {p50_ttft} | {fmt(ttft)} | {p50_tpot} | {fmt(tpot, 1000)} | {steal} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args) | {"source": str(args.source), "out": str(args.out)}, "runs": runs})
    )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
