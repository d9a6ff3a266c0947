"""P99 TTFT of the Ray Serve request routers in front of tailserve's engine replicas, on a hot-prefix
workload (a few long system prompts shared by all requests, Poisson arrivals): tailserve's
PrefixLoadRouter (`prefix`), Ray's default power of two choices (`ray`) and Ray Serve LLM's
PrefixCacheAffinityRouter with its defaults (`prefix_cache_affinity`).

Each (router, seed) runs on a fresh local Ray cluster with fresh replicas (`build_app`, 2 engine
replicas at one thread each). The workload, client and result rows are router_policies.py's, so
`router_policies.py --summarize out.json --baseline prefix` gives the bootstrap over seeds.

    .venv/bin/python benchmarks/ray_routers.py --smoke          # seconds: does it all run
    .venv/bin/python benchmarks/ray_routers.py --routers prefix --seeds 0,1 --out prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import router_policies as rp
from proc import free_port, thread_env

from tailserve.bench.intervals import percentile_interval

ROUTERS = ("prefix", "ray", "prefix_cache_affinity")
WORKLOAD = "shared_system_prompt"
READY_TIMEOUT_S = 300.0


def engine_args(args: argparse.Namespace) -> dict[str, object]:
    """`tailserve serve` flags of each engine replica (one thread: two replicas on two cores)."""
    return {
        "model": args.model,
        "num_threads": 1,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_waiting": 100_000,  # measure queueing, do not shed it
        "slo_ttft": 1000,
        "slo_tpot": 1000,
    }


def start_ray(num_cpus: int) -> str:
    """A local Ray cluster and Serve's proxy on loopback; the proxy's base URL. Replicas inherit this
    process's environment, so the thread caps apply to them."""
    import ray
    from ray import serve

    os.environ.update(thread_env(1))
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_ray() -> None:
    import ray
    from ray import serve

    serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()  # type: ignore[no-untyped-call]


def running_replicas(app: str = "tailserve", deployment: str = "engine") -> int:
    """Engine replicas Ray reports RUNNING."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    states = status.deployments[deployment].replica_states
    return sum(n for state, n in states.items() if state == "RUNNING")  # a str enum


def wait_ready(base: str, replicas: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `replicas` engine replicas run and the app answers /ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ready = (
                running_replicas() >= replicas and httpx.get(f"{base}/ready", timeout=10).status_code == 200
            )
        except httpx.HTTPError:
            ready = False
        if ready:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replicas} replicas not ready at {base}")
        time.sleep(0.5)


def deploy(base: str, app_args: dict[str, object], replicas: int) -> str:
    """tailserve's app at the proxy's root; its model id once `replicas` engines are ready."""
    from ray import serve

    from tailserve.integrations.ray_serve import build_app

    serve.run(build_app(app_args), name="tailserve", route_prefix="/")
    wait_ready(base, replicas)
    return str(httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"])


def warm_up(base: str, model: str, requests: int = 8) -> None:
    """A few short prompts sharing nothing with the workload: first-request costs out of the run."""
    jobs = [rp.Job(0.0, f"warm-{i}", f"warm up {i} " * 4, 4) for i in range(requests)]
    asyncio.run(rp.run_jobs(base, model, jobs))


def result_of(router: str, seed: int, samples: list[rp.Sample], args: argparse.Namespace) -> rp.PolicyResult:
    """router_policies' row for one run; the prefix hit rate is the prompt tokens the replicas
    found cached (usage.prompt_tokens_details) over all prompt tokens."""
    good = [s for s in samples if s.ok]
    goodput_per_s, goodput_fraction = rp.goodput(samples, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    prompt = sum(s.prompt_tokens for s in good)
    return rp.PolicyResult(
        workload=WORKLOAD,
        policy=router,
        requests=len(samples),
        errors=len(samples) - len(good),
        p50_ttft_s=rp.percentile([s.ttft_s for s in good], 50),
        p99_ttft_s=rp.percentile([s.ttft_s for s in good], 99),
        p50_tpot_s=rp.percentile([s.tpot_s for s in good], 50),
        p99_tpot_s=rp.percentile([s.tpot_s for s in good], 99),
        p99_e2e_s=rp.percentile([s.e2e_s for s in good], 99),
        prefix_hit_rate=sum(s.cached_tokens for s in good) / prompt if prompt else math.nan,
        max_e2e_s=max((s.e2e_s for s in good), default=math.nan),
        per_replica_requests=sorted(Counter(s.replica for s in good).values(), reverse=True),
        seed=seed,
        p99_ttft_ci_s=percentile_interval(sorted(s.ttft_s for s in good), 99.0),
        goodput_per_s=goodput_per_s,
        goodput_fraction=goodput_fraction,
    )


def run_router(router: str, seed: int, args: argparse.Namespace) -> rp.PolicyResult:
    """One run: a fresh cluster and replicas, the seeded workload, the numbers."""
    jobs = rp.shared_prompt_jobs(seed, args.requests, args.rate, args)
    base = start_ray(num_cpus=args.replicas)
    try:
        app_args: dict[str, Any] = {**engine_args(args), "num_replicas": args.replicas, "router": router}
        model = deploy(base, app_args, args.replicas)
        warm_up(base, model)
        samples = asyncio.run(rp.run_jobs(base, model, jobs))
    finally:
        stop_ray()
    return result_of(router, seed, samples, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seeds", default="0", help="comma-separated; one run per router and seed")
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="128MiB", help="per replica: holds the system prompts")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per replica")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--tenants", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--system-chars", type=int, default=1600, help="length of each system prompt")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput: a request's TTFT target")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput: a request's TPOT target")
    parser.add_argument("--smoke", action="store_true", help="dummy:tiny, 24 requests, one seed: seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup would print every request
    if args.smoke:
        args.model, args.requests, args.rate, args.seeds = "dummy:tiny", 24, 12.0, "0"
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for router in args.routers.split(","):
            result = run_router(router, seed, args)
            print(rp.markdown([result]).splitlines()[-1], flush=True)
            results.append(result)
    rp.report(rp.markdown(results), [asdict(r) for r in results], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
