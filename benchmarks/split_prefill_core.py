"""Could prefill on a core of its own (decode on the other) keep the TTFT target? A back-of-envelope
queue, not an engine: every prompt is one job on one core, served whole, one at a time.

    .venv/bin/python benchmarks/split_prefill_core.py            # the table of docs/COMPARE.md

A prompt of p tokens costs `slowdown x (step + prompt_fixed + per_token x p)` seconds, where the
terms are the two-core step fit of benchmarks/tail_bound.py (7.0 ms, 13.4 ms, 0.81 ms a token) and
`slowdown` is what one core costs against two (2 for compute-bound prefill; 1.6 as a kind case).
Arrivals are the long-tail chat workload at x0.25 (Poisson; prompts `longtail:50,375,0.05,0.5`).
Order: first come first served, or shortest prompt first. It prints the highest rate, on a 0.25
req/s grid, whose P99 TTFT stays within the target. It flatters the design: the first token's own
decode step, the decode core and the hand-off between them are left out.
"""

from __future__ import annotations

import argparse
import heapq
from collections.abc import Sequence

import numpy as np
from tail_bound import PROMPTS, WARMUP_SHARE, StepCost

from tailserve.bench.lengths import parse_length_dist

ORDERS = ("fcfs", "shortest")


def prefill_ttfts(times: Sequence[float], costs: Sequence[float], keys: Sequence[float]) -> list[float]:
    """Each job's wait plus service on one server that always takes the waiting job with the lowest
    key (its arrival time: first come first served; its cost: shortest first). `times` sorted."""
    n, now, i = len(times), 0.0, 0
    waiting: list[tuple[float, int]] = []
    out = [0.0] * n
    while i < n or waiting:
        if not waiting:
            now = max(now, times[i])
        while i < n and times[i] <= now:
            heapq.heappush(waiting, (keys[i], i))
            i += 1
        _, j = heapq.heappop(waiting)
        now += costs[j]
        out[j] = now - times[j]
    return out


def p99_ttft(rate: float, slowdown: float, order: str, requests: int = 20000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, requests)).tolist()
    prompts = np.asarray(parse_length_dist(PROMPTS).sample(rng, requests), dtype=float)
    fit = StepCost(fixed=7.00e-3, per_row=1.61e-3, prompt_fixed=13.4e-3, per_token=0.81e-3)
    costs = (slowdown * (fit.fixed + fit.prompt_fixed + fit.per_token * prompts)).tolist()
    keys = costs if order == "shortest" else times
    ttft = prefill_ttfts(times, costs, keys)[int(WARMUP_SHARE * requests) :]
    return float(np.quantile(ttft, 0.99, method="inverted_cdf"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--slo-ttft", type=float, default=1.06, help="P99 TTFT target, s")
    args = p.parse_args(argv)
    if not args.slo_ttft > 0:
        p.error("--slo-ttft must be positive")
    print("| one core costs | order | highest rate with P99 TTFT within the target |")
    print("|---|---|---:|")
    for slowdown in (1.6, 2.0):
        for order in ORDERS:
            rates = [r for r in np.arange(0.25, 10.01, 0.25) if p99_ttft(r, slowdown, order) <= args.slo_ttft]
            print(f"| {slowdown:g}x two cores | {order} | {max(rates, default=0.0):.2f} req/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
