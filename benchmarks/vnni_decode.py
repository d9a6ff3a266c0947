"""Decode-row matmuls on a CPU with int8 dot products (AVX512-VNNI, or AVX2) but no bf16 arithmetic:
what one decode step's linears and LM head cost on each kernel this tree has for them, in one process.

The four layer matmuls of the default model (QKV 576->960, O 576->576, gate|up 576->3,072, down
1,536->576; random int4 groups, 30 x one layer's time, that layer's weights warm in the caches from
call to call, where kernel_ab.py keeps every layer's cold) at each --rows, on
torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, what decode rows ran before 2026-12-07), on
int8 dot products with the activations rounded to int8 (`ts_q4a8_prefill_matmul`, the prompt rows'
kernel) and to int16 (`ts_q4a16_matmul`, what decode rows run now); then the LM head 576->49,152
on torch's bf16 `F.linear` and on `ts_q8a8_matmul`. Each kernel timed in turn per shape, the median
of --repeats batches of calls. On a CPU with bf16 arithmetic torch's kernels run natively and the
comparison is not the one the plan makes there. Never beside another measurement.

    .venv/bin/python benchmarks/vnni_decode.py --threads 2 --rows 1 4 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from tailserve.kernels import cpu as cpu_kernels
from tailserve.weights.formats import Int4Groups, Int8Groups, pack_int4, pack_vnni_int4, pack_vnni_int8

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def per_call_ms(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    lib = cpu_kernels.int8_dots()
    if lib is None:
        raise SystemExit("the kernels here have no int8 dot products (neither AVX512-VNNI nor AVX2)")
    torch.set_num_threads(args.threads)
    lib.ts_set_threads(args.threads)
    rng = np.random.default_rng(0)
    packed = {}
    for name, (n, k) in SHAPES.items():
        groups = Int4Groups(
            rng.integers(0, 16, (n, k), dtype=np.uint8),
            rng.random((n, k // 32), dtype=np.float32) * 0.01,
            rng.random((n, k // 32), dtype=np.float32) * 0.01 - 0.005,
        )
        packed[name] = (pack_int4(groups), pack_vnni_int4(groups, lib))
    head_groups = Int8Groups(
        torch.randint(-127, 128, (49152, 576), dtype=torch.int8), torch.rand(49152, 18) * 0.01
    )
    head_bf16 = head_groups.dequantize().to(torch.bfloat16)
    head_q8 = pack_vnni_int8(head_groups, lib)
    isa = "AVX512-VNNI" if lib.ts_vnni() == 1 else "AVX2"
    print(f"{isa}, threads {args.threads}; ms per decode step (30 layers' four matmuls), then the head alone")
    print("| rows | torch int4 | int8 activations | int16 activations | head: torch bf16 | head: q8a8 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in args.rows:
        totals = [0.0, 0.0, 0.0]
        for name, (torch4, vnni) in packed.items():
            x = torch.randn(m, SHAPES[name][1]).to(torch.bfloat16)
            runs: list[Callable[[], object]] = [
                partial(torch4.matmul, x),
                partial(vnni.matmul, x),
                partial(vnni.matmul, x, wide=True),
            ]
            for i, fn in enumerate(runs):
                totals[i] += LAYERS * per_call_ms(fn, 50, args.repeats)
        h = torch.randn(m, 576).to(torch.bfloat16)
        bf16 = per_call_ms(partial(F.linear, h, head_bf16), 10, args.repeats)
        q8 = per_call_ms(partial(head_q8.matmul, h), 10, args.repeats)
        print(f"| {m} | {totals[0]:.2f} | {totals[1]:.2f} | {totals[2]:.2f} | {bf16:.2f} | {q8:.2f} |")


if __name__ == "__main__":
    main()
