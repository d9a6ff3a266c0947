"""Router placement policies on the same seeded workloads: hash vs least_load vs prefix, and SGLang's
model gateway (`sglang:cache_aware` etc., sglang-router 0.3.2) in front of the same replicas.

For each workload and policy: three fresh `tailserve serve` replicas (small KV pool, one thread
each), a fresh `tailserve route` (or `python -m sglang_router launch` for `sglang:<policy>`), Poisson
arrivals from a small async httpx client. Reports P99 TTFT/TPOT (nearest rank, client clock) and the
replicas' prefix-cache hit rate (from their /metrics), and goodput (requests/s within --slo-ttft-ms and
--slo-tpot-ms). `--seeds 0,1,2` repeats each run on other seeded workloads; `--summarize` reads the
JSON of several runs and gives each policy's mean P99 TTFT and goodput over the seeds with a bootstrap
interval, and the paired difference between two policies on the same seeds.

    .venv/bin/python benchmarks/router_policies.py            # both workloads, all three policies
    .venv/bin/python benchmarks/router_policies.py --workload hot_key --requests 200 --out r.json
    .venv/bin/python benchmarks/router_policies.py --summarize a.json b.json --baseline prefix
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
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
from machine import machine_line
from proc import ServerProcess, thread_env

from tailserve.bench.intervals import percentile_interval
from tailserve.bench.stats import nearest_rank

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("hash", "least_load", "prefix")
WORKLOADS = ("hot_key", "shared_system_prompt", "uniform")
BOOTSTRAP_RESAMPLES = 10_000


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
    sent_s: float = math.nan  # perf_counter when it was sent
    replica: str = ""  # the x-tailserve-replica header, where the front sets it (Ray Serve's)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the replica's prefix cache (usage)


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
    seed: int = 0
    p99_ttft_ci_s: tuple[float | None, float | None] = (None, None)  # this run's, distribution-free 95 %
    goodput_per_s: float = math.nan  # requests within both SLO targets / (first send .. last end)
    goodput_fraction: float = math.nan  # of all requests sent


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


def uniform_jobs(seed: int, n: int, rate: float, args: argparse.Namespace) -> list[Job]:
    """No shared prefix: every request its own prompt, as long as a hot_key prompt."""
    rng = random.Random(seed)
    jobs = []
    for i, at_s in enumerate(poisson_times(rng, n, rate)):
        prompt = _text(rng, args.prefix_chars + rng.randint(44, 164))
        jobs.append(Job(at_s, f"user-{i}", prompt, rng.randint(args.min_tokens, args.max_tokens)))
    return jobs


def goodput(samples: list[Sample], ttft_s: float, tpot_s: float) -> tuple[float, float]:
    """(requests/s that met both targets over first send .. last end, their share of all sent)."""
    good = [s for s in samples if s.ok and s.ttft_s <= ttft_s and not s.tpot_s > tpot_s]
    ends = [s.sent_s + s.e2e_s for s in samples if s.ok]
    if not samples or not ends:
        return 0.0, 0.0
    duration = max(max(ends) - min(s.sent_s for s in samples), 1e-9)
    return len(good) / duration, len(good) / len(samples)


def bootstrap_mean(values: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap of the mean over independent runs (seeds)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(BOOTSTRAP_RESAMPLES))
    tail = (1 - level) / 2
    low = means[int(tail * BOOTSTRAP_RESAMPLES)]
    high = means[min(BOOTSTRAP_RESAMPLES - 1, int((1 - tail) * BOOTSTRAP_RESAMPLES))]
    return math.fsum(values) / n, low, high


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
    tokens = prompt_tokens = cached_tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Sample(False, error=f"HTTP {response.status_code}", sent_s=started)
            replica = response.headers.get("x-tailserve-replica", "")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if math.isnan(ttft_s) and '"choices":[{' in line.replace(" ", ""):
                    ttft_s = time.perf_counter() - started
                if '"error"' in line:
                    return Sample(False, error=line[:200], sent_s=started)
                if '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = int(usage.get("completion_tokens") or tokens)
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except httpx.HTTPError as exc:
        return Sample(False, error=repr(exc), sent_s=started)
    e2e_s = time.perf_counter() - started
    tpot_s = (e2e_s - ttft_s) / (tokens - 1) if tokens > 1 else math.nan
    return Sample(
        True,
        ttft_s,
        tpot_s,
        e2e_s,
        tokens,
        sent_s=started,
        replica=replica,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
    )


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


def run_policy(
    workload: str, policy: str, jobs: list[Job], args: argparse.Namespace, jobs_seed: int = 0
) -> PolicyResult:
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
            shed_none = ["--slo-ttft", "1000", "--slo-tpot", "1000"]  # measure queueing, do not shed it
            cmd += ["--max-waiting", "100000", *shed_none]
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
    goodput_per_s, goodput_fraction = goodput(samples, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    ttft_ci = percentile_interval(sorted(s.ttft_s for s in good), 99.0)
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
        seed=jobs_seed,
        p99_ttft_ci_s=ttft_ci,
        goodput_per_s=goodput_per_s,
        goodput_fraction=goodput_fraction,
    )


def _ci_ms(low: float | None, high: float | None) -> str:
    """An interval in ms; too few requests for a bound leave that side open (`>= 111`)."""
    if low is not None and high is not None:
        return f"{low * 1e3:.0f}-{high * 1e3:.0f}"
    if low is not None:
        return f">= {low * 1e3:.0f}"
    return "no bound" if high is None else f"<= {high * 1e3:.0f}"


def markdown(results: list[PolicyResult]) -> str:
    rows = [
        "| workload | policy | seed | requests | errors | P50 TTFT ms | P99 TTFT ms (95 % CI) | P50 TPOT ms "
        "| P99 TPOT ms | P99 E2E s | goodput req/s (share) | prefix hit rate | requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        low, high = r.p99_ttft_ci_s
        rows.append(
            f"| {r.workload} | {r.policy} | {r.seed} | {r.requests} | {r.errors} | {r.p50_ttft_s * 1e3:.0f} "
            f"| {r.p99_ttft_s * 1e3:.0f} ({_ci_ms(low, high)}) | {r.p50_tpot_s * 1e3:.1f} "
            f"| {r.p99_tpot_s * 1e3:.1f} | {r.p99_e2e_s:.2f} | {r.goodput_per_s:.2f} ({r.goodput_fraction:.0%}) "
            f"| {r.prefix_hit_rate:.1%} | {r.per_replica_requests} |"
        )
    return "\n".join(rows)


def summary(runs: list[dict[str, object]], baseline: str) -> str:
    """Per workload and policy over its seeds: mean P99 TTFT and goodput with bootstrap 95 % intervals;
    and each policy minus `baseline` on the seeds both ran (paired: the same requests)."""
    rows = [
        "| workload | policy | seeds | P99 TTFT ms: mean (95 % CI) | goodput req/s: mean (95 % CI) "
        f"| P99 TTFT minus {baseline}, ms (95 % CI) | goodput minus {baseline} (95 % CI) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_key: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for run in runs:
        fields = {
            "p99_ttft_ms": float(str(run["p99_ttft_s"])) * 1e3,
            "goodput": float(str(run["goodput_per_s"])),
        }
        by_key.setdefault((str(run["workload"]), str(run["policy"])), {})[int(str(run["seed"]))] = fields
    for (workload, policy), per_seed in sorted(by_key.items()):
        p99 = bootstrap_mean([r["p99_ttft_ms"] for r in per_seed.values()])
        good = bootstrap_mean([r["goodput"] for r in per_seed.values()])
        base = by_key.get((workload, baseline), {})
        paired = sorted(set(per_seed) & set(base))
        diff_p99 = diff_good = "-"
        if policy != baseline and paired:
            dm, dl, dh = bootstrap_mean([per_seed[s]["p99_ttft_ms"] - base[s]["p99_ttft_ms"] for s in paired])
            gm, gl, gh = bootstrap_mean([per_seed[s]["goodput"] - base[s]["goodput"] for s in paired])
            diff_p99 = f"{dm:+.0f} ({dl:+.0f} .. {dh:+.0f})"
            diff_good = f"{gm:+.2f} ({gl:+.2f} .. {gh:+.2f})"
        rows.append(
            f"| {workload} | {policy} | {len(per_seed)} | {p99[0]:.0f} ({p99[1]:.0f}-{p99[2]:.0f}) "
            f"| {good[0]:.2f} ({good[1]:.2f}-{good[2]:.2f}) | {diff_p99} | {diff_good} |"
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
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, one run each (default: --seed)")
    parser.add_argument("--slo-ttft-ms", type=float, default=100.0, help="goodput: a request's TTFT target")
    parser.add_argument("--slo-tpot-ms", type=float, default=20.0, help="goodput: a request's TPOT target")
    parser.add_argument(
        "--summarize", type=Path, nargs="+", default=None, help="JSON of earlier runs: summary only"
    )
    parser.add_argument("--baseline", default="prefix", help="--summarize: the policy others are compared to")
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
    if args.summarize:
        runs = [run for path in args.summarize for run in json.loads(path.read_text())]
        print(summary(runs, args.baseline))
        return 0

    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    results = []
    for seed in seeds:
        for workload in workloads:
            if workload == "hot_key":
                jobs = hot_key_jobs(seed, args.requests, args.rate, args)
            elif workload == "uniform":
                jobs = uniform_jobs(seed, args.requests, args.rate, args)
            else:
                jobs = shared_prompt_jobs(seed, args.shared_requests, args.shared_rate, args)
            for policy in args.policies.split(","):
                result = run_policy(workload, policy, jobs, args, seed)
                print(markdown([result]).splitlines()[-1], flush=True)
                results.append(result)
    report(markdown(results), [asdict(r) for r in results], args.out)
    return 0


def report(table: str, records: list[dict[str, object]], out: Path | None) -> None:
    """A run's footer: date, machine (its CPU named) and command, the results table, and the
    records as JSON at `out` if given (this script's and the Ray benchmarks')."""
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {machine_line()}; command: {' '.join(sys.argv)}\n")
    print(table)
    if out:
        out.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    sys.exit(main())
