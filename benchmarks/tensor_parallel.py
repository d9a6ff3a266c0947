"""Tensor parallelism's communication share (issue 16): per-step all-reduce vs compute at TP=1, 2, 3,
and whether an all-reduce overlaps with independent compute on this machine.

`share` runs the same greedy batch through `LLM(..., tensor_parallel_size=N)` for each size and
reports rank 0's per-step time in collectives against the rest of the forward (the numbers the
`tailserve_tp_*_seconds` histograms carry), plus the time rank 0 spends handing plans to workers.
`overlap` times, on N spawned ranks, an all-reduce of a step's [rows, hidden] activations alone, a
matmul alone, and the all-reduce started asynchronously with the matmul run before waiting on it.

    .venv/bin/python benchmarks/tensor_parallel.py share --sizes 1 2 3 --model default --weight-format int4
    .venv/bin/python benchmarks/tensor_parallel.py overlap --size 2 --rows 1 16 128 --hidden 576

The same script runs on a multi-GPU machine with `--device cuda` (NCCL; collectives are timed with
a device sync around each, which the serving path does not do). Timing needs an idle machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _timed(send: Any, seconds: list[float]) -> Any:
    """`send`, recording how long each call took (rank 0 handing a plan to the workers)."""

    def timed_send(message: tuple[Any, ...]) -> None:
        start = time.perf_counter()
        send(message)
        seconds.append(time.perf_counter() - start)

    return timed_send


def _share(args: argparse.Namespace) -> None:
    import torch

    from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tailserve.engine import SamplingParams
    from tailserve.engine.llm import LLM

    for size in args.sizes:
        llm = LLM(
            config=EngineConfig(
                model=ModelConfig(
                    model=args.model,
                    weight_format=args.weight_format,
                    device=args.device,
                    max_model_len=1024,
                    num_threads=args.threads_per_rank,
                    tensor_parallel_size=size,
                ),
                cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.budget),
            )
        )
        engine, runner = llm.engine, llm.engine.runner
        plan_s: list[float] = []
        if runner.tp is not None:
            runner.tp.sync_timing = args.device == "cuda"
            runner.tp.send_plan = _timed(runner.tp.send_plan, plan_s)  # type: ignore[method-assign]
        gen = torch.Generator().manual_seed(0)
        vocab = engine.arch.vocab_size
        prompts = [
            torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.batch)
        ]
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        plan_s.clear()
        decode: list[tuple[float, float, float]] = []  # (step_s, comm_s, compute_s) of decode-only steps
        prefill: list[tuple[float, float, float]] = []
        for i, p in enumerate(prompts):
            engine.add_request(f"b{size}-{i}", p, params)
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - start
            plan = engine.last_plan
            row = (step_s, runner.last_comm_s, runner.last_compute_s)
            if plan is not None and plan.num_decodes == len(plan.scheduled):
                decode.append(row)
            else:
                prefill.append(row)
        llm.close()
        for kind, rows in (("decode", decode), ("prefill", prefill)):
            if not rows:
                continue
            comm, compute = sum(r[1] for r in rows), sum(r[2] for r in rows)
            print(
                json.dumps(
                    {
                        "tp": size,
                        "kind": kind,
                        "steps": len(rows),
                        "median_step_ms": round(statistics.median(r[0] for r in rows) * 1e3, 3),
                        "median_allreduce_ms": round(statistics.median(r[1] for r in rows) * 1e3, 3),
                        "allreduce_share": round(comm / (comm + compute), 4) if comm + compute else 0.0,
                        "median_plan_send_ms": round(statistics.median(plan_s) * 1e3, 4) if plan_s else 0.0,
                    }
                ),
                flush=True,
            )


def _overlap_rows(size: int, rows: int, weight: Any, device: Any, sync: Any, repeats: int) -> dict[str, Any]:
    """All-reduce alone, matmul alone, and both with the all-reduce in flight during the matmul."""
    import torch
    import torch.distributed as dist

    x = torch.randn(rows, weight.shape[1], device=device)
    act = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16, device=device)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        torch.nn.functional.linear(act, weight)
        assert work is not None
        work.wait()

    ar = timed(lambda: dist.all_reduce(x))
    mm = timed(lambda: torch.nn.functional.linear(act, weight))
    together = timed(both)
    return {
        "tp": size,
        "rows": rows,
        "allreduce_ms": round(ar * 1e3, 4),
        "matmul_ms": round(mm * 1e3, 4),
        "overlapped_ms": round(together * 1e3, 4),
        "saved_share_of_allreduce": round((ar + mm - together) / ar, 3) if ar else 0.0,
    }


def _overlap_rank(rank: int, size: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads_per_rank)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    weight = torch.randn(args.hidden * 4 // size, args.hidden, dtype=torch.bfloat16, device=device)
    results = [_overlap_rows(size, rows, weight, device, sync, args.repeats) for rows in args.rows]
    if rank == 0:
        out.send(results)
    dist.destroy_process_group()


def _overlap(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_overlap_rank, args=(r, args.size, port, args, send)) for r in range(args.size)
    ]
    for p in procs:
        p.start()
    for row in recv.recv():
        print(json.dumps(row), flush=True)
    for p in procs:
        p.join(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    share = sub.add_parser("share", help="per-step all-reduce vs compute through the engine at each TP size")
    share.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    share.add_argument("--model", default="default")
    share.add_argument("--weight-format", default="int4")
    share.add_argument("--device", default="cpu")
    share.add_argument("--batch", type=int, default=8, help="concurrent requests")
    share.add_argument("--budget", type=int, default=256, help="tokens per step")
    share.add_argument("--prompt-tokens", type=int, default=128)
    share.add_argument("--output-tokens", type=int, default=32)
    share.add_argument("--threads-per-rank", type=int, default=max(1, (os.cpu_count() or 2) // 3))
    share.set_defaults(func=_share)
    overlap = sub.add_parser("overlap", help="does an async all-reduce hide behind independent compute?")
    overlap.add_argument("--size", type=int, default=2)
    overlap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    overlap.add_argument("--hidden", type=int, default=576)
    overlap.add_argument("--repeats", type=int, default=50)
    overlap.add_argument("--device", default="cpu")
    overlap.add_argument("--threads-per-rank", type=int, default=1)
    overlap.set_defaults(func=_overlap)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
