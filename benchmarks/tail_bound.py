"""What P99/mean could this engine's scheduler reach on this machine? The real `Scheduler` and
policy, in virtual time, on the step costs measured here: no model, no HTTP, no noise.

    .venv/bin/python benchmarks/tail_bound.py --rate 3.22                  # every sweep, the defaults
    .venv/bin/python benchmarks/tail_bound.py --validate RUN.jsonl         # against a served run
    .venv/bin/python benchmarks/tail_bound.py --measure-costs bench-results/step-costs.json --rate 3.22
    .venv/bin/python benchmarks/tail_bound.py --costs bench-results/step-costs.json --rate 3.22

A step costs `fixed + per decode row x rows + (prompt-step fixed if it carries prompt tokens) + per
prompt token x tokens`, the least-squares fit of logged engine steps: the defaults below, `--costs`
to refit from a saved log, or `--measure-costs` to log one here first (an in-process engine of the
default model serves --measure-requests arrivals of the same workload at --rate in real time, every
request admitted, and every step's decode rows, prompt tokens and wall seconds are saved; never
beside another measurement). The scheduler (tailserve.engine.scheduler,
policy, StepTimer) plans every step as it does in the server; time advances by the step's cost.
Every request is admitted (no 429) and runs to its output length; KV blocks are plentiful (no
preemption). With no decode running, the first prompt in line may take up to
--prefill-step-tokens in one step, as the server does on a CPU whose prompt rows run our kernels
(the scheduler's idle budget, set from the config as engine/llm_engine.py sets it); that step is
priced by the same cost, so it saves the fixed parts of the steps it replaces (the kernels' higher
speed on many rows is not modelled: it flatters the budget-sized steps). Arrivals are the long-tail
chat workload of docs/COMPARE.md at x0.25: Poisson, prompts `longtail:50,375,0.05,0.5`, outputs
`uniform:16,32`.

Per request: TTFT, TPOT (mean gap after the first token) and slowdown (TTFT over the same prompt's
TTFT on an idle engine, simulated alone). The first tenth of the requests is warm-up. The sweeps
vary one thing at a time from the benchmark's server settings (slo, 256-token steps, 16 sequences,
TTFT target 1.06 s, TPOT target 100 ms):

- `policy`: slo, fcfs;
- `idle-step`: --prefill-step-tokens 0 (budget-sized steps only), 1024 and 2048 (the server's default);
- `tpot-plan`: the TPOT the slo cap plans to (--slo-tpot), with the prefill floor at 0.25 and 0.05;
- `budget`: tokens per step;
- `prefill-speed`: every prompt cost (per token and the prompt step's fixed cost) divided by k,
  at the same rate;
- `decode-fixed`: a decode step's fixed cost as large as vLLM's (what its ratio looks like);
- `capacity`: the highest rate whose point P99s meet the SLO (bisection, no intervals: there is no
  noise), for tailserve as measured, with faster prefill, and for a peer model (first come first
  served, the same prompt costs, vLLM's idle TPOT as its decode step's fixed cost);
- `probes`: how often one capacity probe of benchmarks/compare (368 measured requests, judged by
  the upper ends of the P99 intervals) passes at each rate, over fresh draws: how sharp a verdict
  one probe a rate gives before any noise of the machine.

A sweep answers "could a scheduler setting reach the target"; the targets (TPOT P99/mean <= 1.5,
slowdown P99/mean <= 2.0 at 80% of capacity) are printed beside. The model leaves out the HTTP
layer (`--server-step-ms` adds a fixed share per step), the machine's noise and admission, so it
flatters: a row that misses here misses on the machine, and a row that passes here still has to
pass there. Checked against served runs: docs/notes/tail-under-slo.md. Deterministic: the same arguments give
the same table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from compare.analyze import read_rows
from machine import git_commit, machine_line

from tailserve.bench.intervals import percentile_interval
from tailserve.bench.lengths import parse_length_dist
from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import Request, RequestTimings, SamplingParams
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.stats import StepTimer

PROMPTS, OUTPUTS = "longtail:50,375,0.05,0.5", "uniform:16,32"
TPOT_RATIO_TARGET, SLOWDOWN_RATIO_TARGET = 1.5, 2.0
BLOCK = 16
WARMUP_SHARE = 0.1


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step: fixed + per_row x decode rows + prompt_fixed (if any prompt token) +
    per_token x prompt tokens."""

    fixed: float = 6.32e-3
    per_row: float = 1.377e-3
    prompt_fixed: float = 10.91e-3
    per_token: float = 0.745e-3

    def __call__(self, decode_rows: int, prompt_tokens: int) -> float:
        prompt = self.prompt_fixed + self.per_token * prompt_tokens if prompt_tokens else 0.0
        return self.fixed + self.per_row * decode_rows + prompt

    def faster_prefill(self, k: float) -> StepCost:
        return dataclasses.replace(self, prompt_fixed=self.prompt_fixed / k, per_token=self.per_token / k)

    @staticmethod
    def fit(steps: Sequence[Sequence[float]]) -> StepCost:
        """Least squares over (decode rows, prompt tokens, seconds) rows, as `measure_steps` logs them."""
        a = np.asarray(steps, dtype=float)
        rows, tokens, seconds = a[:, 0], a[:, 1], a[:, 2]
        x = np.c_[np.ones_like(rows), rows, (tokens > 0).astype(float), tokens]
        coef = np.linalg.lstsq(x, seconds, rcond=None)[0]
        return StepCost(*(float(c) for c in coef))

    def describe(self) -> str:
        return (
            f"{1e3 * self.fixed:.2f} ms + {1e3 * self.per_row:.3f} ms per decode row + "
            f"{1e3 * self.prompt_fixed:.2f} ms if the step carries prompt tokens + "
            f"{1e3 * self.per_token:.3f} ms per prompt token"
        )


Arrival = tuple[float, int, int]  # (arrival s, prompt tokens, output tokens)


def poisson_arrivals(rate: float, n: int, seed: int) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, n))
    prompts = parse_length_dist(PROMPTS).sample(rng, n)
    outputs = parse_length_dist(OUTPUTS).sample(rng, n)
    return [(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]


def served_arrivals(path: Path) -> list[Arrival]:
    """(send time s, prompt tokens, output tokens) of a bench run's warm-up and measured requests, from
    the .jsonl `tailserve bench` saved (a compare probe's `runs/NAME.jsonl`), in time order."""
    kept = [r for r in read_rows(path) if r.get("phase") in ("warmup", "measured") and r.get("input_tokens")]
    return sorted(
        (float(r["scheduled_s"]), int(r["input_tokens"]), max(int(r.get("output_tokens") or 1), 1))
        for r in kept
    )


Step = tuple[int, int, float]  # (decode rows, prompt tokens, seconds) of one engine step


def measure_steps(
    arrivals: Sequence[Arrival], config: SchedulerConfig, threads: int, model: str = "default"
) -> list[Step]:
    """Serve `arrivals` (sorted) in real time on an in-process engine under `config` (prefix caching
    off, every request admitted, greedy to its output length) and log every step after a warm-up
    request: its decode rows, prompt tokens and wall seconds (the whole `step()`, as the step loop
    pays it: planning, model, sampling and outputs)."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model, num_threads=threads),
            cache=CacheConfig(enable_prefix_caching=False),
            scheduler=config,
        )
    )
    vocab = engine.arch.vocab_size

    def prompt(n: int, salt: int) -> list[int]:  # distinct ids per request, inside the vocabulary
        return [(salt * 7919 + j * 31) % (vocab - 3) + 3 for j in range(n)]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    engine.add_request("warm-up", prompt(min(300, engine.max_model_len // 2), -1), greedy(8))
    while engine.has_unfinished():
        engine.step()
    steps: list[Step] = []
    t0, i = time.monotonic(), 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= time.monotonic() - t0:
            _, prompt_tokens, output_tokens = arrivals[i]
            engine.add_request(f"r{i}", prompt(prompt_tokens, i), greedy(output_tokens))
            i += 1
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if (plan := engine.last_plan) is not None and plan.scheduled:
            steps.append((plan.num_decodes, plan.num_prefill_tokens, seconds))
    return steps


@dataclass
class Served:
    """One request's result in the simulation."""

    arrival: float
    prompt: int
    output: int
    ttft: float
    tpot: float


def simulate(arrivals: Sequence[Arrival], config: SchedulerConfig, cost: StepCost) -> list[Served]:
    """Serve `arrivals` (sorted by time) with the real scheduler, each step taking `cost`."""
    now = 0.0  # the virtual clock: every plan is made at it
    blocks = sum(-(-(p + o) // BLOCK) for _, p, o in arrivals) + 1
    timer = StepTimer(budget_tokens=config.max_num_batched_tokens)
    sched = Scheduler(config, KVCacheManager(blocks, BLOCK, enable_prefix_caching=False), timer)
    sched.idle_budget = config.idle_step_tokens  # the longer step with no decode (module docstring)
    first: dict[str, float] = {}
    done: dict[str, Served] = {}
    reqs: dict[str, Arrival] = {}
    nxt = 0
    while len(done) < len(arrivals):
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            t, p, o = arrivals[nxt]
            rid = f"r{nxt}"
            ids = [(nxt * 31 + j) % 5000 + 1 for j in range(p)]
            params = SamplingParams(max_tokens=o, ignore_eos=True)
            sched.add(Request(rid, ids, params, RequestTimings(arrival=t), seq_no=nxt))
            reqs[rid] = arrivals[nxt]
            nxt += 1
        plan = sched.step_plan(now)
        if not plan.scheduled:
            if nxt >= len(arrivals):
                raise RuntimeError("the scheduler planned nothing with requests left")
            now = max(now, arrivals[nxt][0])
            continue
        seconds = cost(plan.num_decodes, plan.num_prefill_tokens)
        now += seconds
        timer.record(plan, seconds)
        sched.postprocess(plan)
        for req, _ in plan.scheduled:
            if req.num_computed_tokens < len(req.token_ids):
                continue  # a prompt chunk that does not end the prompt: no token yet
            req.token_ids.append(1)  # what OutputProcessor.append_token records, the policy reads
            if req.timings.first_token is None:
                req.timings.first_token = now
            req.timings.token_times.append(now)
            rid = req.request_id
            first.setdefault(rid, now)
            t, p, o = reqs[rid]
            if req.num_output_tokens >= o:
                sched.finish(req, "length")
                gaps = max(o - 1, 1)
                done[rid] = Served(t, p, o, first[rid] - t, (now - first[rid]) / gaps)
    return [done[f"r{i}"] for i in range(len(arrivals))]


def idle_ttft(config: SchedulerConfig, cost: StepCost) -> Callable[[int], float]:
    """TTFT of a prompt alone on an idle engine (what the bench's calibration measures), memoized."""
    memo: dict[int, float] = {}

    def ttft(prompt: int) -> float:
        if prompt not in memo:
            memo[prompt] = simulate([(0.0, prompt, 2)], config, cost)[0].ttft
        return memo[prompt]

    return ttft


def summary(served: Sequence[Served], config: SchedulerConfig, cost: StepCost) -> dict[str, float]:
    kept = served[int(WARMUP_SHARE * len(served)) :]
    idle = idle_ttft(config, cost)
    ttft = np.array([s.ttft for s in kept])
    tpot = np.array([s.tpot for s in kept if s.output > 1])
    slow = np.array([s.ttft / idle(s.prompt) for s in kept])

    def p99(x: np.ndarray) -> float:
        return float(np.quantile(x, 0.99, method="inverted_cdf"))

    return {
        "n": len(kept),
        "ttft_p99_s": p99(ttft),
        "ttft_ratio": p99(ttft) / float(ttft.mean()),
        "tpot_mean_ms": 1e3 * float(tpot.mean()),
        "tpot_p99_ms": 1e3 * p99(tpot),
        "tpot_ratio": p99(tpot) / float(tpot.mean()),
        "slowdown_p99": p99(slow),
        "slowdown_ratio": p99(slow) / float(slow.mean()),
    }


def base_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        policy="slo",
        max_num_batched_tokens=args.step_tokens,
        max_num_seqs=args.max_num_seqs,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot_ms / 1e3,
        prefill_step_tokens=args.prefill_step_tokens,
    )


Variant = tuple[str, SchedulerConfig, StepCost]


def sweeps(name: str, config: SchedulerConfig, cost: StepCost, peer_fixed_s: float) -> list[Variant]:
    """The rows of one sweep (see the module docstring)."""
    rep = dataclasses.replace
    if name == "policy":
        return [(p, rep(config, policy=p), cost) for p in ("slo", "fcfs")]
    if name == "idle-step":
        return [
            (f"--prefill-step-tokens {n}", rep(config, prefill_step_tokens=n), cost) for n in (0, 1024, 2048)
        ]
    if name == "tpot-plan":
        return [
            (
                f"--slo-tpot {ms} ms, floor {floor:g}",
                rep(config, slo_tpot_s=ms / 1e3, prefill_floor=floor),
                cost,
            )
            for floor in (0.25, 0.05)
            for ms in (100, 50, 30, 20)
        ]
    if name == "budget":
        return [
            (f"{b} tokens a step", rep(config, max_num_batched_tokens=b), cost) for b in (64, 128, 256, 512)
        ]
    if name == "prefill-speed":
        return [(f"prefill {k:g}x faster", config, cost.faster_prefill(k)) for k in (1, 2, 4, 10)]
    if name == "decode-fixed":
        return [
            (f"decode step fixed cost {1e3 * cost.fixed:.2f} ms (as measured)", config, cost),
            (
                f"decode step fixed cost {1e3 * peer_fixed_s:g} ms (vLLM's idle TPOT)",
                config,
                rep(cost, fixed=peer_fixed_s),
            ),
        ]
    raise ValueError(f"unknown sweep {name!r}")


SWEEPS = ("policy", "idle-step", "tpot-plan", "budget", "prefill-speed", "decode-fixed", "capacity", "probes")
COLUMNS = (
    ("P99 TTFT s", "ttft_p99_s", "{:.3f}"),
    ("TPOT mean ms", "tpot_mean_ms", "{:.1f}"),
    ("P99 TPOT ms", "tpot_p99_ms", "{:.1f}"),
    ("TPOT P99/mean", "tpot_ratio", "{:.2f}"),
    ("P99 slowdown", "slowdown_p99", "{:.2f}"),
    ("slowdown P99/mean", "slowdown_ratio", "{:.2f}"),
)


def averaged(variant: Variant, draws: Sequence[list[Arrival]]) -> dict[str, float]:
    """The mean of each figure over the prompt draws (one simulation each)."""
    _, config, cost = variant
    runs = [summary(simulate(a, config, cost), config, cost) for a in draws]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def capacity_variants(config: SchedulerConfig, cost: StepCost, peer_fixed_s: float) -> list[Variant]:
    """tailserve as measured, with faster prefill, and a peer modelled as vLLM's CPU engine looks from
    outside: the same prompt costs, first come first served, a decode step whose fixed cost is its
    idle TPOT (`--peer-step-ms`)."""
    rep = dataclasses.replace
    rows: list[Variant] = [
        ("tailserve (slo)", config, cost),
        ("tailserve (fcfs)", rep(config, policy="fcfs"), cost),
    ]
    rows += [
        (f"tailserve (slo), prefill {k:g}x faster", config, cost.faster_prefill(k)) for k in (1.25, 1.5, 2, 3)
    ]
    rows.append((PEER_LABEL, rep(config, policy="fcfs"), rep(cost, fixed=peer_fixed_s)))
    return rows


PEER_LABEL = "peer model (fcfs, vLLM's idle TPOT as the step's fixed cost)"


def meets(variant: Variant, rate: float, draws: int, requests: int) -> tuple[bool, dict[str, float]]:
    """Whether the point P99s over `draws` runs at `rate` meet the SLO the config states."""
    _, config, cost = variant
    served = [s for seed in range(draws) for s in simulate(poisson_arrivals(rate, requests, seed), config, cost)[
        int(WARMUP_SHARE * requests) :
    ]]  # fmt: skip
    ttft = float(np.quantile([s.ttft for s in served], 0.99, method="inverted_cdf"))
    tpot = float(np.quantile([s.tpot for s in served if s.output > 1], 0.99, method="inverted_cdf"))
    return ttft <= config.slo_ttft_s and tpot <= config.slo_tpot_s, {
        "ttft_p99_s": ttft,
        "tpot_p99_ms": 1e3 * tpot,
    }


def capacity(variant: Variant, draws: int, requests: int, lo: float = 0.5, hi: float = 30.0) -> float:
    """The highest rate (to 2%) whose point P99 TTFT and TPOT meet the SLO: bisection between a rate
    that passes and one that fails (the point P99, not the interval's upper end: no noise here)."""
    if not meets(variant, lo, draws, requests)[0]:
        return 0.0
    while hi / lo > 1.02:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(variant, mid, draws, requests)[0] else (lo, mid)
    return lo


def table(rows: Sequence[tuple[str, dict[str, float]]]) -> list[str]:
    head = "| setting | " + " | ".join(c for c, _, _ in COLUMNS) + " |"
    lines = [head, "|---|" + "---:|" * len(COLUMNS)]
    for label, fig in rows:
        cells = [f.format(fig[k]) if k in fig else "-" for _, k, f in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def measured(path: Path) -> dict[str, float] | None:
    """A served run's own figures from its saved JSON beside the .jsonl (mean and P99)."""
    doc_path = path.with_suffix(".json")
    if not doc_path.exists():
        return None
    metrics = json.loads(doc_path.read_text()).get("metrics", {})
    ttft, tpot, slow = metrics.get("ttft_s"), metrics.get("tpot_s"), metrics.get("slowdown")
    if not ttft or not tpot:
        return None
    real = {
        "n": ttft["count"],
        "ttft_p99_s": ttft["p99"],
        "ttft_ratio": ttft["p99"] / ttft["mean"],
        "tpot_mean_ms": 1e3 * tpot["mean"],
        "tpot_p99_ms": 1e3 * tpot["p99"],
        "tpot_ratio": tpot["p99"] / tpot["mean"],
    }
    if slow:
        real |= {"slowdown_p99": slow["p99"], "slowdown_ratio": slow["p99"] / slow["mean"]}
    return real


PROBE_REQUESTS = 368  # benchmarks/compare's measured requests a capacity probe (a bounded P99 interval)


def probe_passes(variant: Variant, rate: float, seed: int, requests: int = PROBE_REQUESTS) -> bool:
    """One capacity probe as benchmarks/compare judges it: `requests` measured requests after a
    tenth more of warm-up; it passes when the upper ends of the P99 TTFT and TPOT intervals meet the
    SLO (the conservative rule)."""
    _, config, cost = variant
    warm = requests // 10
    served = simulate(poisson_arrivals(rate, requests + warm, seed), config, cost)[warm:]
    ttft_hi = percentile_interval(sorted(s.ttft for s in served), 99)[1]
    tpot_hi = percentile_interval(sorted(s.tpot for s in served if s.output > 1), 99)[1]
    if ttft_hi is None or tpot_hi is None:
        return False
    return bool(ttft_hi <= config.slo_ttft_s and tpot_hi <= config.slo_tpot_s)


def probes_table(config: SchedulerConfig, cost: StepCost, args: argparse.Namespace) -> list[str]:
    """At each rate, the share of probes (one per seed) that pass the conservative rule: with no
    noise at all, how sharp a capacity verdict one probe a rate can give."""
    rates = [round(x, 2) for x in np.arange(args.probe_from, args.probe_to + 1e-9, args.probe_step)]
    lines = [
        f"Share of {args.probe_draws} probes a rate ({args.probe_requests} measured requests each, a new draw "
        f"each) whose P99 TTFT and TPOT intervals' upper ends meet {config.slo_ttft_s:g} s and "
        f"{1e3 * config.slo_tpot_s:g} ms.",
        "",
        "| req/s | " + " | ".join(f"{r:g}" for r in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    variants = capacity_variants(config, cost, args.peer_step_ms / 1e3)
    for label, c, k in [variants[0], variants[-1]]:  # tailserve (slo) as measured, and the peer model
        shares = [
            np.mean(
                [
                    probe_passes((label, c, k), r, 1000 + seed, args.probe_requests)
                    for seed in range(args.probe_draws)
                ]
            )
            for r in rates
        ]
        lines.append(f"| {label} | " + " | ".join(f"{x:.0%}" for x in shares) + " |")
    return lines


def capacity_table(config: SchedulerConfig, cost: StepCost, args: argparse.Namespace) -> list[str]:
    variants = capacity_variants(config, cost, args.peer_step_ms / 1e3)
    found = [(label, capacity((label, c, k), args.draws, args.requests)) for label, c, k in variants]
    peer = dict(found)[PEER_LABEL]
    lines = [
        f"Highest rate whose point P99 TTFT <= {config.slo_ttft_s:g} s and P99 TPOT <= "
        f"{1e3 * config.slo_tpot_s:g} ms ({args.draws} draws of {args.requests} requests a rate).",
        "",
        "| server | capacity req/s | / peer model |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {label} | {c:.2f} | {c / peer:.2f}x |" if peer else f"| {label} | {c:.2f} | - |"
        for label, c in found
    ]
    return lines


def measure_costs(path: Path, config: SchedulerConfig, args: argparse.Namespace) -> Path:
    """Log the engine's steps on this machine (`measure_steps`) into the JSON file `path`, for --costs."""
    arrivals = poisson_arrivals(args.rate, args.measure_requests, args.seed)
    steps = measure_steps(arrivals, config, args.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": machine_line(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rate": args.rate,
        "requests": args.measure_requests,
        "seed": args.seed,
        "threads": args.threads,
        "steps": steps,
    }
    path.write_text(json.dumps(doc))
    print(f"{len(steps)} steps logged in {path}: {StepCost.fit(steps).describe()}", flush=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=3.22, help="arrivals per second (80%% of capacity)")
    p.add_argument("--requests", type=int, default=6000, help="requests per simulation")
    p.add_argument("--draws", type=int, default=3, help="prompt/arrival draws (seeds 0..N-1), averaged")
    p.add_argument("--sweep", default=",".join(SWEEPS), help=f"comma list of {', '.join(SWEEPS)}")
    p.add_argument("--costs", type=Path, help="refit the step cost from a saved step log (JSON with 'steps')")
    p.add_argument(
        "--measure-costs",
        type=Path,
        metavar="PATH",
        help="first log the engine's steps into this JSON file (an in-process engine serves "
        "--measure-requests arrivals at --rate in real time) and use their fit",
    )
    p.add_argument("--measure-requests", type=int, default=500, help="arrivals served by --measure-costs")
    p.add_argument("--threads", type=int, default=2, help="engine threads of --measure-costs")
    p.add_argument("--seed", type=int, default=0, help="draw of --measure-costs' arrivals")
    p.add_argument("--validate", type=Path, help="a bench run's .jsonl: simulate its arrivals, print both")
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--slo-ttft", type=float, default=1.06)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument(
        "--prefill-step-tokens",
        type=int,
        default=SchedulerConfig.prefill_step_tokens,
        help="prompt tokens the first prompt in line may take in a step with no decode (the server's flag)",
    )
    p.add_argument(
        "--server-step-ms",
        type=float,
        default=0.0,
        help="added to every step's fixed cost: what the HTTP server adds to an in-process step "
        "(a served run's mean TPOT less the simulated one)",
    )
    p.add_argument(
        "--peer-step-ms",
        type=float,
        default=30.8,
        help="the peer model's decode step fixed cost (vLLM's idle TPOT here)",
    )
    p.add_argument("--probe-from", type=float, default=3.0, help="probes sweep: lowest rate")
    p.add_argument("--probe-to", type=float, default=7.0, help="probes sweep: highest rate")
    p.add_argument("--probe-step", type=float, default=0.5, help="probes sweep: rate step")
    p.add_argument("--probe-draws", type=int, default=20, help="probes sweep: probes a rate")
    p.add_argument(
        "--probe-requests", type=int, default=PROBE_REQUESTS, help="probes sweep: measured requests a probe"
    )
    p.add_argument("--out", type=Path, help="also write OUT.md and OUT.json")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.requests < 100 or args.draws < 1 or args.server_step_ms < 0:
        p.error("--rate must be > 0, --requests >= 100, --draws >= 1 and --server-step-ms >= 0")
    if args.prefill_step_tokens < 0:
        p.error("--prefill-step-tokens must be >= 0")
    if args.probe_requests < 100 or args.probe_draws < 1 or args.probe_step <= 0 or args.probe_from <= 0:
        p.error("--probe-requests >= 100, --probe-draws >= 1, --probe-step and --probe-from > 0")
    for path in (args.costs, args.validate):
        if path is not None and not path.is_file():
            p.error(f"no such file: {path}")
    if args.measure_costs and (args.costs or args.measure_requests < 10 or args.threads < 1):
        p.error("--measure-costs: not with --costs, and --measure-requests >= 10, --threads >= 1")
    config = base_config(args)
    if args.measure_costs:
        args.costs = measure_costs(args.measure_costs, config, args)
    try:
        cost = StepCost.fit(json.loads(args.costs.read_text())["steps"]) if args.costs else StepCost()
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        p.error(f"--costs {args.costs}: not a step log with a 'steps' list ({exc})")
    cost = dataclasses.replace(cost, fixed=cost.fixed + args.server_step_ms / 1e3)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# What the scheduler could reach: P99/mean in virtual time on the measured step costs",
        "",
        f"- command: `benchmarks/tail_bound.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- machine the costs come from: {machine_line()}; commit {git_commit()}; {stamp}",
        f"- step cost: {cost.describe()}",
        f"- server settings: slo, {args.step_tokens}-token steps ({config.idle_step_tokens} with no "
        f"decode), {args.max_num_seqs} sequences, TTFT target {args.slo_ttft:g} s, TPOT target {args.slo_tpot_ms:g} ms",
        f"- targets at 80% of capacity: TPOT P99/mean <= {TPOT_RATIO_TARGET}, slowdown P99/mean <= "
        f"{SLOWDOWN_RATIO_TARGET}",
    ]
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cost": vars(cost)}
    if args.validate:
        arrivals = served_arrivals(args.validate)
        sim = summary(simulate(arrivals, config, cost), config, cost)
        real = measured(args.validate)
        lines += ["", f"## A served run's arrivals ({len(arrivals)} requests of `{args.validate}`)", ""]
        lines += table([("simulated", sim)] + ([("measured (the run's JSON)", real)] if real else []))
        result["validate"] = {"simulated": sim, "measured": real}
    else:
        draws = [poisson_arrivals(args.rate, args.requests, seed) for seed in range(args.draws)]
        lines[3:3] = [f"- {args.draws} draws of {args.requests} requests at {args.rate:g} req/s, averaged"]
        result["sweeps"] = {}
        for name in [s.strip() for s in args.sweep.split(",") if s.strip()]:
            if name in ("capacity", "probes"):
                made = (capacity_table if name == "capacity" else probes_table)(config, cost, args)
                lines += ["", f"## {name}", "", *made]
                result["sweeps"][name] = made
                print("\n".join(made), flush=True)
                continue
            rows = [
                (label, averaged((label, c, k), draws))
                for label, c, k in sweeps(name, config, cost, args.peer_step_ms / 1e3)
            ]
            lines += ["", f"## {name}", "", *table(rows)]
            result["sweeps"][name] = dict(rows)
            print("\n".join(lines[-len(rows) - 4 :]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.validate:
        print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # OUT.md and OUT.json beside each other, whatever dots OUT's name holds (tail-bound-3.22)
        args.out.with_name(args.out.name + ".md").write_text(text)
        args.out.with_name(args.out.name + ".json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
