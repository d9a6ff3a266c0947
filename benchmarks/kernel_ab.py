"""The int4 prompt-row matmul (`ts_q4_prefill_matmul`) of this tree's C kernels against another
commit's, in one process: both sources built with the server's flags, then the four layer matmuls of
the default model's 30 layers (QKV 576->960, O 576->576, gate-up 576->3072, down 1536->576; random
codes, so every layer's weights are cold as in a step) timed at each row count, the two builds
alternating, the best of --repeats each. `--silu` runs gate-up as it serves, through the fused
SiLU x up kernel (`ts_q4_prefill_silu_matmul`, 1,536 outputs). Needs AMX. Never beside another
measurement.

    .venv/bin/python benchmarks/kernel_ab.py --base 1cc1238 --threads 2   # ~30 s
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
from machine import ROOT, git_commit, machine_line

from tailserve.kernels import cpu as cpu_kernels

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (k, n_out) of one layer's matmuls
LAYERS = 30
_P, _I = ctypes.c_void_p, ctypes.c_int64


def build(source: Path, out: Path) -> ctypes.CDLL:
    cc = ["cc", *cpu_kernels.FLAGS, cpu_kernels.OPENMP, str(source), "-o", str(out), "-lm"]
    subprocess.run(cc, check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    if lib.ts_amx_init() != 1:
        raise SystemExit("needs AMX tile data (Intel Sapphire Rapids or later)")
    lib.ts_q4_prefill_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    lib.ts_q4_prefill_silu_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    return lib


def layer_weights(seed: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(k, n, packed codes, scale, min) of every matmul of every layer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            packed = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g)
            scale = torch.rand(n * k // 32, generator=g) * 0.02
            out.append((k, n, packed, scale, -8 * scale))
    return out


def forward_s(
    lib: ctypes.CDLL,
    weights: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]],
    x: dict[int, torch.Tensor],
    y: torch.Tensor,
    silu: bool = False,
) -> float:
    rows = y.shape[0]
    start = time.perf_counter()
    for k, n, packed, scale, low in weights:
        fused = silu and n == 3072  # gate-up: SiLU x up of its two halves, n / 2 outputs
        matmul = lib.ts_q4_prefill_silu_matmul if fused else lib.ts_q4_prefill_matmul
        matmul(
            x[k].data_ptr(),
            rows,
            k,
            packed.data_ptr(),
            scale.data_ptr(),
            low.data_ptr(),
            None,
            n // 2 if fused else n,
            y.data_ptr(),
        )
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit whose kernels to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1600])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--silu", action="store_true", help="gate-up through the fused SiLU x up kernel")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "base.c"
        show = ["git", "show", f"{args.base}:src/tailserve/kernels/cpu_kernels.c"]
        base_src.write_text(subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
        libs = {
            args.base: build(base_src, Path(tmp) / "base.so"),
            "HEAD": build(cpu_kernels.SOURCE, Path(tmp) / "head.so"),
        }
        for lib in libs.values():
            lib.ts_set_threads(args.threads)
        weights = layer_weights(0)
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        print(
            f"# `benchmarks/kernel_ab.py --base {args.base} --threads {args.threads}{' --silu' if args.silu else ''}` at {stamp} on {machine_line()}, commit {git_commit()}"
        )
        print(
            f"\n| rows | {args.base} ms | HEAD (working tree) ms | HEAD / {args.base} |\n| ---: | ---: | ---: | ---: |"
        )
        for rows in args.rows:
            x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
            y = torch.empty(rows, 3072, dtype=torch.bfloat16)
            best = dict.fromkeys(libs, float("inf"))
            for r in range(args.repeats):
                for name in list(libs) if r % 2 else list(libs)[::-1]:
                    best[name] = min(best[name], forward_s(libs[name], weights, x, y, args.silu))
            base_ms, head_ms = 1000 * best[args.base], 1000 * best["HEAD"]
            print(f"| {rows} | {base_ms:.2f} | {head_ms:.2f} | {head_ms / base_ms:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
