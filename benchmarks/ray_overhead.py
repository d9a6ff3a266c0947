"""What Ray Serve's path costs against serving directly: the same engine flags served by `tailserve
serve` and by `build_app` (one engine replica behind the ingress and Ray's proxy), in the same run,
rounds interleaved, at 1 and 16 concurrent streams. Prints mean TTFT and per-stream decode rate for
each, and Ray / direct ratios. A small httpx client of its own (like router_policies.py).
`--model default` measures the real default model (SmolLM2) instead of the nearly free dummy:tiny.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(base)
        time.sleep(0.2)


async def one_stream(http: httpx.AsyncClient, model: str, tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tokens/s after the first) of one streamed completion."""
    body = {"model": model, "prompt": "hello " * 16, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = 0.0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                last = time.perf_counter()
                first = first or last
    return first - start, (tokens - 1) / max(last - first, 1e-9)


async def round_of(base: str, streams: int, tokens: int) -> list[tuple[float, float]]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        return list(await asyncio.gather(*(one_stream(http, model, tokens) for _ in range(streams))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--model", default="dummy:tiny", help="`default`: the real default model")
    args = parser.parse_args()
    import ray
    from ray import serve

    from tailserve.integrations.ray_serve import build_app

    flags = ["--model", args.model, "--no-warmup"]
    direct_port = free_port()
    direct = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tailserve.cli",
            "serve",
            *flags,
            "--host",
            "127.0.0.1",
            "--port",
            str(direct_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ray_port = free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
        serve.run(build_app({"model": args.model, "no_warmup": "true", "num_cpus": 0}), route_prefix="/")
        bases = {"direct": f"http://127.0.0.1:{direct_port}", "ray": f"http://127.0.0.1:{ray_port}"}
        for base in bases.values():
            wait_ready(base)
            asyncio.run(round_of(base, 2, 8))  # first requests: connections, caches
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for streams in args.streams:
                for name, base in bases.items():
                    results.setdefault((name, streams), []).extend(
                        asyncio.run(round_of(base, streams, args.tokens))
                    )
        for streams in args.streams:
            row = {}
            for name in bases:
                samples = results[(name, streams)]
                row[name] = (statistics.mean(s[0] for s in samples), statistics.mean(s[1] for s in samples))
            (d_ttft, d_rate), (r_ttft, r_rate) = row["direct"], row["ray"]
            print(
                f"{streams:>2} streams x {args.tokens} tokens, {args.rounds} rounds: TTFT direct {d_ttft * 1000:.1f} ms, "
                f"ray {r_ttft * 1000:.1f} ms (x{r_ttft / d_ttft:.2f}); per-stream decode direct {d_rate:.0f} tok/s, "
                f"ray {r_rate:.0f} tok/s (x{r_rate / d_rate:.2f})"
            )
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()  # type: ignore[no-untyped-call]
        direct.terminate()
        direct.wait(30)


if __name__ == "__main__":
    main()
