"""The int matmuls and prompt attention on a CPU without AMX (e.g. AMD Zen 4): tailserve's fused
kernels against what ran there before, in-process on the default model, interleaved round by round.

- Steps: decode steps of 1, 4 and 16 streams and the prefill of a 50- and a 375-token prompt, on an
  engine whose int4 layers and Q8_0 head run on the kernels' tile matmul (AVX512-BF16 here) and on
  one built as before (torch's int4 kernel, a bf16 head). Both int4 (forced: no quality gate), both
  with prompt attention on the decode kernel (the prefill rows show the matmuls' and head's share).
- Prompt attention of one layer: the paged decode kernel, one query per prompt row (what the fused
  forward runs now), against torch's flash SDPA (what it ran before), for 50-375 rows.

Each figure is the median over rounds of each round's median; the ratio is before / now. Never run
beside another measurement. `python benchmarks/tile_isa.py` (`--rounds 1 --steps 3` smoke-runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch
from kernel_threads import decode_steps_ms, prefill_step_ms
from machine import git_commit, machine_line

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.model import cpu_kernels
from tailserve.model.attention import PrefillSpan, TorchPagedAttention
from tailserve.model.cpu_kernels import ptr

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's attention


def engine(threads: int) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(
            model="default", weight_format="int4", force_weight_format=True, num_threads=threads
        ),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    )
    return LLMEngine(config)


def attention_ms(rows: int, reps: int) -> tuple[float, float]:
    """One layer's attention for a fresh `rows`-token prompt: (decode kernel, torch flash SDPA), ms."""
    lib = cpu_kernels.load()
    assert lib is not None
    g = torch.Generator().manual_seed(rows)
    blocks = -(-rows // BLOCK)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    k_cache = torch.zeros(blocks * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].reshape(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].reshape(rows, KV_HEADS, HEAD_DIM)
    k_cache[:rows], v_cache[:rows] = k, v  # table = blocks in order
    table, lens = torch.arange(blocks), torch.arange(1, rows + 1)
    out = torch.empty(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    span = PrefillSpan(0, rows, 0, None)

    def kernel() -> None:
        lib.ts_paged_decode_attention(
            ptr(qkv), width, ptr(k_cache), ptr(v_cache), ptr(table), 0, ptr(lens), ptr(out), rows,
            HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM**-0.5,
        )  # fmt: skip

    def flash() -> None:
        TorchPagedAttention.prefill_span(q, k, v, k_cache, v_cache, span, BLOCK, HEAD_DIM**-0.5)

    return _median_ms(kernel, reps), _median_ms(flash, reps)


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per figure and round")
    args = ap.parse_args()
    if min(args.threads, args.rounds, args.steps) < 1:
        sys.exit("--threads, --rounds and --steps must be at least 1")
    torch.set_num_threads(args.threads)
    isa = cpu_kernels.tile_isa()
    if isa == 0:
        sys.exit(
            "the fused kernels' tile matmuls cannot run here (no AMX, no AVX512-BF16): nothing to compare"
        )
    now = engine(args.threads)
    with mock.patch.object(cpu_kernels, "tile_matmuls", return_value=None):
        before = engine(args.threads)  # int4 on torch's kernel, the head on bf16: as without the kernels
    print(f"# benchmarks/tile_isa.py --threads {args.threads} --rounds {args.rounds} --steps {args.steps} "
          f"at {time.strftime('%Y-%m-%dT%H:%M:%S%z')} on {machine_line()}, commit {git_commit()}")  # fmt: skip
    print(f"# tile matmuls on {cpu_kernels.TILE_ISA_SUFFIX[isa].lstrip('+')}; now: {now.runner.model.plan}; "
          f"before: {before.runner.model.plan}")  # fmt: skip
    figures: dict[str, dict[str, list[float]]] = {}
    cases: list[tuple[str, Callable[[LLMEngine], list[float]]]] = [
        *((f"decode step, {r} stream{'s' if r > 1 else ''}", lambda e, r=r: decode_steps_ms(e, r, args.steps, 3))
          for r in (1, 4, 16)),
        *((f"prefill, {n}-token prompt", lambda e, n=n: prefill_step_ms(e, n, max(3, args.steps // 6)))
          for n in (50, 375)),
    ]  # fmt: skip
    for round_no in range(args.rounds):
        order = (
            [("now", now), ("before", before)] if round_no % 2 == 0 else [("before", before), ("now", now)]
        )
        for name, case in cases:
            for label, eng in order:
                figures.setdefault(name, {}).setdefault(label, []).append(statistics.median(case(eng)))
        for rows in (50, 128, 256, 375):
            kernel, flash = attention_ms(rows, max(5, args.steps // 3))
            cell = figures.setdefault(f"prompt attention, one layer, {rows} rows", {})
            cell.setdefault("now", []).append(kernel)
            cell.setdefault("before", []).append(flash)
    print("| what | now ms | before ms | before / now |")
    print("|---|---:|---:|---:|")
    for name, cell in figures.items():
        a, b = statistics.median(cell["now"]), statistics.median(cell["before"])
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
