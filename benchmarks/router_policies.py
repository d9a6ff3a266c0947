"""Router placement policies on the same seeded workloads: hash vs least_load vs prefix, and SGLang's
model gateway (`sglang:cache_aware` etc., sglang-router 0.3.2) in front of the same replicas.

For each workload and policy: three fresh `tailserve serve` replicas (small KV pool, one thread
each), a fresh `tailserve route` (or `python -m sglang_router launch` for `sglang:<policy>`), Poisson
arrivals from a small async httpx client. Reports P99 TTFT/TPOT (nearest rank, client clock) and the
replicas' prefix-cache hit rate (from their /metrics).

    .venv/bin/python benchmarks/router_policies.py            # both workloads, all three policies
    .venv/bin/python benchmarks/router_policies.py --workload hot_key --requests 200 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import socket
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from proc import ServerProcess, thread_env

from tailserve.bench.stats import nearest_rank

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("hash", "least_load", "prefix")
WORKLOADS = ("hot_key", "shared_system_prompt")


@dataclass(frozen=True)
class Job:
    """One request of a workload: when to send it and what."""

    at_s: float
    user: str
    prompt: str
    max_tokens: int


@dataclass
class Sample:
    """What the client measured for one request."""

    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    """One (workload, policy) run."""

    workload: str
    policy: str
    requests: int
    errors: int
    p50_ttft_s: float
    p99_ttft_s: float
    p50_tpot_s: float
    p99_tpot_s: float
    p99_e2e_s: float
    prefix_hit_rate: float  # replicas' prefix-cache hits / queries (tokens), over the run
    max_e2e_s: float = math.nan
    preemptions: int = 0
    per_replica_requests: list[int] = field(default_factory=list)
    decisions: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of the finite values (NaN when there are none)."""
    data = sorted(v for v in values if not math.isnan(v))
    return nearest_rank(data, q) if data else math.nan


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:chars]


def poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` per second."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def hot_key_jobs(seed: int, n: int, rate: float, args: argparse.Namespace) -> list[Job]:
    """A few keys send most requests: user 0 `--hot-share` of them, user 1 `--warm-share`, 18 others the rest.

    Each user has its own conversation prefix, so the same key also means the same prompt prefix.
    """
    rng = random.Random(seed)
    users = [f"user-{i}" for i in range(20)]
    weights = [args.hot_share, args.warm_share] + [(1 - args.hot_share - args.warm_share) / 18] * 18
    history = {u: _text(rng, args.prefix_chars) for u in users}
    jobs = []
    for at_s in poisson_times(rng, n, rate):
        user = rng.choices(users, weights)[0]
        prompt = history[user] + "\nQ: " + _text(rng, rng.randint(40, 160))
        jobs.append(Job(at_s, user, prompt, rng.randint(args.min_tokens, args.max_tokens)))
    return jobs


def shared_prompt_jobs(seed: int, n: int, rate: float, args: argparse.Namespace) -> list[Job]:
    """Several tenants, each with a long system prompt shared by all of its (many) users."""
    rng = random.Random(seed)
    systems = [_text(rng, args.system_chars) for _ in range(args.tenants)]
    jobs = []
    for i, at_s in enumerate(poisson_times(rng, n, rate)):
        tenant = rng.randrange(args.tenants)
        prompt = systems[tenant] + "\nUser: " + _text(rng, rng.randint(40, 160))
        jobs.append(Job(at_s, f"tenant-{tenant}-user-{i}", prompt, rng.randint(8, 24)))
    return jobs


async def send(client: httpx.AsyncClient, url: str, model: str, job: Job) -> Sample:
    """Stream one completion; TTFT at the first chunk with a choice, TPOT from the usage count."""
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "user": job.user,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft_s = math.nan
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Sample(False, error=f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if math.isnan(ttft_s) and '"choices":[{' in line.replace(" ", ""):
                    ttft_s = time.perf_counter() - started
                if '"error"' in line:
                    return Sample(False, error=line[:200])
                if '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = int(usage.get("completion_tokens") or tokens)
    except httpx.HTTPError as exc:
        return Sample(False, error=repr(exc))
    e2e_s = time.perf_counter() - started
    tpot_s = (e2e_s - ttft_s) / (tokens - 1) if tokens > 1 else math.nan
    return Sample(True, ttft_s, tpot_s, e2e_s, tokens)


async def run_jobs(url: str, model: str, jobs: list[Job]) -> list[Sample]:
    """Send every job at its arrival time, concurrently (an open loop: arrivals never wait)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()

        async def at(job: Job) -> Sample:
            await asyncio.sleep(max(0.0, job.at_s - (time.perf_counter() - start)))
            return await send(client, url, model, job)

        return list(await asyncio.gather(*(at(job) for job in jobs)))


def free_ports(n: int, base: int) -> list[int]:
    """The first n consecutive free ports from `base`: fixed URLs keep `hash` placements the same per run."""
    port = base
    while True:
        run = list(range(port, port + n))
        try:
            for p in run:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            port += n
            continue
        return run


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of a /metrics page, plus labelled ones under their full sample name."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def run_policy(workload: str, policy: str, jobs: list[Job], args: argparse.Namespace) -> PolicyResult:
    """Fresh replicas and router, one run, then the numbers."""
    env = thread_env(1)
    *replica_ports, router_port = free_ports(4, args.base_port)
    tailserve = [sys.executable, "-m", "tailserve.cli"]
    logs = Path(tempfile.mkdtemp(prefix=f"router-{workload}-{policy}-"))
    replica_urls = [f"http://127.0.0.1:{p}" for p in replica_ports]
    router_url = f"http://127.0.0.1:{router_port}"
    with contextlib.ExitStack() as stack:  # every process is stopped however the block is left
        replicas = []
        for i, port in enumerate(replica_ports):
            cmd = [*tailserve, "serve", "--model", args.model, "--port", str(port), "--log-level", "warning"]
            cmd += ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs)]
            cmd += ["--max-waiting", "100000", "--slo-ttft", "1000"]  # measure queueing, do not shed it
            log_path = logs / f"replica-{i}.log"
            replicas.append(stack.enter_context(ServerProcess(cmd, port, log_path, env=env, cwd=ROOT)))
        for replica in replicas:
            replica.wait_ready(timeout_s=300)
        if policy.startswith("sglang:"):  # SGLang's gateway; its metrics exporter needs a port of its own
            cmd = [sys.executable, "-m", "sglang_router", "launch", "--worker-urls", *replica_urls]
            cmd += ["--policy", policy.partition(":")[2], "--host", "127.0.0.1", "--port", str(router_port)]
            cmd += [
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_ports(1, router_port + 1)[0]),
            ]
            cmd += ["--log-level", "warn"]
            gateway = ServerProcess(
                cmd, router_port, logs / "router.log", env=env, cwd=ROOT, ready_path="/readiness"
            )
            router = stack.enter_context(gateway)
        else:
            cmd = [
                *tailserve,
                "route",
                "--policy",
                policy,
                "--port",
                str(router_port),
                "--log-level",
                "warning",
            ]
            for url in replica_urls:
                cmd += ["--replica", url]
            router = stack.enter_context(
                ServerProcess(cmd, router_port, logs / "router.log", env=env, cwd=ROOT)
            )
        router.wait_ready(timeout_s=300)
        model = httpx.get(router_url + "/v1/models").json()["data"][0]["id"]
        before = [scrape(u) for u in replica_urls]
        samples = asyncio.run(run_jobs(router_url, model, jobs))
        after = [scrape(u) for u in replica_urls]
        router_metrics = {} if policy.startswith("sglang:") else scrape(router_url)

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    hits = sum(delta("tailserve_prefix_cache_hits_total", i) for i in range(3))
    queries = sum(delta("tailserve_prefix_cache_queries_total", i) for i in range(3))
    finished = [
        int(sum(v for k, v in after[i].items() if k.startswith("tailserve_requests_finished_total")))
        - int(sum(v for k, v in before[i].items() if k.startswith("tailserve_requests_finished_total")))
        for i in range(3)
    ]
    decisions = {k: v for k, v in router_metrics.items() if k.startswith("tailserve_router_decisions_total")}
    good = [s for s in samples if s.ok]
    return PolicyResult(
        workload=workload,
        policy=policy,
        requests=len(samples),
        errors=len(samples) - len(good),
        p50_ttft_s=percentile([s.ttft_s for s in good], 50),
        p99_ttft_s=percentile([s.ttft_s for s in good], 99),
        p50_tpot_s=percentile([s.tpot_s for s in good], 50),
        p99_tpot_s=percentile([s.tpot_s for s in good], 99),
        p99_e2e_s=percentile([s.e2e_s for s in good], 99),
        prefix_hit_rate=hits / queries if queries else math.nan,
        max_e2e_s=max((s.e2e_s for s in good), default=math.nan),
        preemptions=int(sum(delta("tailserve_preemptions_total", i) for i in range(3))),
        per_replica_requests=finished,
        decisions=decisions,
    )


def markdown(results: list[PolicyResult]) -> str:
    rows = [
        "| workload | policy | requests | errors | P50 TTFT ms | P99 TTFT ms | P50 TPOT ms | P99 TPOT ms "
        "| P99 E2E s | max E2E s | preemptions | prefix hit rate | requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r.workload} | {r.policy} | {r.requests} | {r.errors} | {r.p50_ttft_s * 1e3:.0f} "
            f"| {r.p99_ttft_s * 1e3:.0f} | {r.p50_tpot_s * 1e3:.1f} | {r.p99_tpot_s * 1e3:.1f} "
            f"| {r.p99_e2e_s:.2f} | {r.max_e2e_s:.2f} | {r.preemptions} | {r.prefix_hit_rate:.1%} "
            f"| {r.per_replica_requests} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--kv-cache-memory", default="1MiB", help="per replica: small, so load matters")
    parser.add_argument("--max-num-seqs", type=int, default=1, help="per replica: few slots, so queues form")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--base-port", type=int, default=18200, help="replicas on 3 consecutive ports from here"
    )
    parser.add_argument("--hot-share", type=float, default=0.6, help="user 0's share of requests (hot_key)")
    parser.add_argument("--warm-share", type=float, default=0.15, help="user 1's share (hot_key)")
    parser.add_argument("--requests", type=int, default=240, help="per run (hot_key)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s (hot_key)")
    parser.add_argument("--prefix-chars", type=int, default=300, help="per-user history (hot_key)")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--shared-requests", type=int, default=240)
    parser.add_argument("--shared-rate", type=float, default=8.0)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--system-chars", type=int, default=600)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    results = []
    for workload in workloads:
        if workload == "hot_key":
            jobs = hot_key_jobs(args.seed, args.requests, args.rate, args)
        else:
            jobs = shared_prompt_jobs(args.seed, args.shared_requests, args.shared_rate, args)
        for policy in args.policies.split(","):
            result = run_policy(workload, policy, jobs, args)
            print(markdown([result]).splitlines()[-1], flush=True)
            results.append(result)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"
    print(f"\n{datetime.now(UTC):%Y-%m-%d} on {machine}; command: {' '.join(sys.argv)}\n")
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
