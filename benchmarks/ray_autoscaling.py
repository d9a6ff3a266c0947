"""Ray Serve autoscaling of tailserve's engine replicas on a step load (a low rate, then a burst that
one replica cannot serve): Ray's built-in policy on `target_ongoing_requests` against
ray_autoscaling.QueueDepthPolicy (the engines' waiting requests), 1 -> at most 2 replicas.

For each policy, a fresh local Ray cluster starts with one engine replica; the same seeded requests
(router_policies.py's shared-system-prompt workload) arrive at `--low-rate` for `--low-s`, then at
`--burst-rate` for `--burst-s`. Reports when the autoscaler started a second replica (a replica in
STARTING) and when it ran and served, counted from the burst's start, and the TTFT P50/P99 of the
burst's requests with a bootstrap 95 % interval (requests resampled) and the order-statistic one.

    .venv/bin/python benchmarks/ray_autoscaling.py --smoke       # under a minute: does it all run
    .venv/bin/python benchmarks/ray_autoscaling.py --policies ray:4,queue:1 --out scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray_routers as rr
import router_policies as rp

from tailserve.bench.intervals import percentile_interval
from tailserve.bench.stats import nearest_rank

BOOTSTRAP_RESAMPLES = 4000


@dataclass
class ScaleResult:
    """One policy's run; times in seconds from the burst's first arrival (NaN: never)."""

    policy: str
    seed: int
    burst_requests: int
    errors: int
    second_replica_started_s: float  # the autoscaler's decision became a STARTING replica
    second_replica_running_s: float
    second_replica_first_reply_s: float  # a burst request answered by the new replica (its first chunk)
    burst_p50_ttft_s: float
    burst_p99_ttft_s: float
    burst_p99_ttft_bootstrap_s: tuple[float, float]
    burst_p99_ttft_order_stat_s: tuple[float | None, float | None]
    requests_per_replica: list[int]
    error_kinds: dict[str, int]  # a failed request's error (its first 80 characters), counted


def autoscaling_config(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Ray's AutoscalingConfig for `ray:<target_ongoing_requests>` or `queue:<target_waiting>`: both
    1 -> `--max-replicas`, the same delays, look-back and metrics interval."""
    kind, _, value = policy.partition(":")
    config: dict[str, Any] = {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": args.max_replicas,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": 600.0,  # no scale-down inside a run
        "look_back_period_s": args.look_back_s,
        "metrics_interval_s": args.metrics_interval_s,
    }
    if kind == "ray":
        config["target_ongoing_requests"] = float(value or 2)
    elif kind == "queue":
        from tailserve.integrations.ray_autoscaling import POLICY_PATH

        config["policy"] = {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {"target_waiting": float(value or 1)},
        }
    else:
        raise ValueError(f"policy {policy!r}: ray:<target_ongoing_requests> or queue:<target_waiting>")
    return config


def step_jobs(seed: int, args: argparse.Namespace) -> tuple[list[rp.Job], float]:
    """The low phase then the burst (both Poisson, the same system prompts); the burst's start."""
    low = rp.shared_prompt_jobs(seed, max(1, round(args.low_rate * args.low_s)), args.low_rate, args)
    burst = rp.shared_prompt_jobs(seed, round(args.burst_rate * args.burst_s), args.burst_rate, args)
    rng = random.Random(seed + 1)  # the burst's prompts: other users of the same tenants
    burst = [replace(j, at_s=args.low_s + j.at_s, user=f"{j.user}-burst-{rng.random():.6f}") for j in burst]
    return [j for j in low if j.at_s < args.low_s] + burst, args.low_s


class ReplicaWatch:
    """Polls Serve's status from a thread: when a second engine replica was STARTING and RUNNING."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.started_at = math.nan
        self.running_at = math.nan
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        from ray import serve

        while not self._stop.wait(self._period_s):
            status = serve.status().applications.get("tailserve")
            if status is None or "engine" not in status.deployments:
                continue
            states = status.deployments["engine"].replica_states
            now = time.perf_counter()
            if math.isnan(self.started_at) and sum(states.values()) >= 2:
                self.started_at = now
            running = sum(n for state, n in states.items() if state == "RUNNING")  # a str enum
            if math.isnan(self.running_at) and running >= 2:
                self.running_at = now


def bootstrap_percentile(values: list[float], q: float, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95 % interval of the q-th percentile (nearest rank), values resampled."""
    rng = random.Random(seed)
    stats = sorted(
        nearest_rank(sorted(rng.choices(values, k=len(values))), q) for _ in range(BOOTSTRAP_RESAMPLES)
    )
    return stats[int(0.025 * BOOTSTRAP_RESAMPLES)], stats[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]


def run_policy(policy: str, seed: int, args: argparse.Namespace) -> ScaleResult:
    """A fresh cluster with one engine replica (`fixed:N`: N, never scaled), the step load, the numbers."""
    jobs, burst_at_s = step_jobs(seed, args)
    base = rr.start_ray(num_cpus=args.max_replicas)
    try:
        kind, _, value = policy.partition(":")
        if kind == "fixed":  # the baseline: `value` replicas from the start, no autoscaling
            app_args: dict[str, Any] = {**rr.engine_args(args), "num_replicas": int(value)}
            model = rr.deploy(base, app_args, replicas=int(value))
        else:
            app_args = {**rr.engine_args(args), "autoscaling_config": autoscaling_config(policy, args)}
            model = rr.deploy(base, app_args, replicas=1)
        for _ in range(4):  # one at a time, then a look-back of quiet: the warm-up must not scale
            rr.warm_up(base, model, requests=1)
        time.sleep(args.look_back_s + 2 * args.metrics_interval_s)
        with ReplicaWatch() as watch:
            start = time.perf_counter()
            samples = asyncio.run(rp.run_jobs(base, model, jobs))
    finally:
        rr.stop_ray()
    burst_start = start + burst_at_s
    burst = [s for s in samples if s.sent_s >= burst_start]
    ok = [s for s in burst if s.ok]
    # Replicas in the order they first served: the first is the one the run started with.
    replicas = sorted(
        {s.replica for s in samples if s.ok}, key=lambda r: min(s.sent_s for s in samples if s.replica == r)
    )
    new_replies = [s.sent_s + s.ttft_s - burst_start for s in ok if s.replica in replicas[1:]]
    ttfts = sorted(s.ttft_s for s in ok)
    never = math.nan if kind == "fixed" else 0.0  # a fixed deployment has no scaling times
    return ScaleResult(
        policy=policy,
        seed=seed,
        burst_requests=len(burst),
        errors=len(burst) - len(ok),
        second_replica_started_s=watch.started_at - burst_start + never,
        second_replica_running_s=watch.running_at - burst_start + never,
        second_replica_first_reply_s=min(new_replies, default=math.nan) + never,
        burst_p50_ttft_s=nearest_rank(ttfts, 50),
        burst_p99_ttft_s=nearest_rank(ttfts, 99),
        burst_p99_ttft_bootstrap_s=bootstrap_percentile(ttfts, 99, seed),
        burst_p99_ttft_order_stat_s=percentile_interval(ttfts, 99.0),
        requests_per_replica=[sum(1 for s in samples if s.ok and s.replica == r) for r in replicas],
        error_kinds=dict(Counter(s.error[:80] for s in samples if not s.ok)),
    )


def markdown(results: list[ScaleResult]) -> str:
    rows = [
        "| policy | seed | burst requests | errors | 2nd replica starting s | running s | first reply s "
        "| burst P50 TTFT ms | burst P99 TTFT ms (bootstrap 95 %; order-stat 95 %) | requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        b_lo, b_hi = r.burst_p99_ttft_bootstrap_s
        o_lo, o_hi = r.burst_p99_ttft_order_stat_s
        rows.append(
            f"| {r.policy} | {r.seed} | {r.burst_requests} | {r.errors} | {r.second_replica_started_s:.1f} "
            f"| {r.second_replica_running_s:.1f} | {r.second_replica_first_reply_s:.1f} "
            f"| {r.burst_p50_ttft_s * 1e3:.0f} | {r.burst_p99_ttft_s * 1e3:.0f} ({b_lo * 1e3:.0f}-{b_hi * 1e3:.0f}; "
            f"{rp._ci_ms(o_lo, o_hi)}) | {r.requests_per_replica} {r.error_kinds or ''} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policies",
        default="ray:2,ray:4,queue:1",
        help="ray:<target_ongoing>, queue:<target_waiting>, fixed:<replicas> (no autoscaling)",
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=1600)
    parser.add_argument("--low-rate", type=float, default=0.5)
    parser.add_argument("--low-s", type=float, default=20.0)
    parser.add_argument("--burst-rate", type=float, default=2.0)
    parser.add_argument("--burst-s", type=float, default=120.0)
    parser.add_argument(
        "--upscale-delay-s", type=float, default=2.0, help="both policies (Ray's default: 30)"
    )
    parser.add_argument("--look-back-s", type=float, default=3.0, help="both policies (Ray's default: 30)")
    parser.add_argument("--metrics-interval-s", type=float, default=0.5, help="both (Ray's default: 10)")
    parser.add_argument("--smoke", action="store_true", help="dummy:tiny, a short step, one seed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.smoke:
        args.model, args.low_s, args.burst_s, args.burst_rate, args.policies = (
            "dummy:tiny",
            4.0,
            10.0,
            20.0,
            "ray:2,queue:1",
        )
        args.max_num_seqs = 1
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for policy in args.policies.split(","):
            result = run_policy(policy, seed, args)
            print(markdown([result]).splitlines()[-1], flush=True)
            results.append(result)
    rp.report(markdown(results), [asdict(r) for r in results], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
