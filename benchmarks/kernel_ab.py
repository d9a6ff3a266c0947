"""The int4 prompt-row matmul (`ts_q4_prefill_matmul`) of this tree's C kernels against another
commit's, in one process: both sources built with the server's flags, then the four layer matmuls of
the default model's 30 layers (QKV 576->960, O 576->576, gate-up 576->3072, down 1536->576; random
codes, so every layer's weights are cold as in a step) timed at each row count, the two builds
alternating, the best of --repeats each, once both are seen to give the same bits on one layer's
matmuls. `--silu` runs gate-up as it serves, through the fused SiLU x up kernel
(`ts_q4_prefill_silu_matmul`, 1,536 outputs). `--attention` times the prompt
attention instead (`ts_paged_prompt_attention`, one layer of the default model: 9 heads, 3 kv heads,
head size 64, 16-slot blocks in shuffled order; the rows at --start onward over a cache filled up
to them, random q/k/v) and says whether both builds give the same bits. `--decode` times a decode
step's exact kernels instead (`ts_q4_matmul` on the 30 layers, then `ts_q8_matmul` on the Q8_0 LM
head, 576->49,152, apart) at a few rows, and first checks both builds give the same bits on every
one. `--decode-attention` times a decode step's attention (`ts_paged_decode_attention`, the 30
layers' own K/V pools in shuffled 16-slot blocks, --seqs sequences of --keys keys each) and first
checks that each build is within bf16 of a float64 softmax attention (their bits may differ: the
segmented kernel rounds in another order). `--int8-dots` times the int8 dot-product matmul of
decode rows on CPUs without bf16 arithmetic (`ts_q4a16_matmul`: int4 codes times int16-rounded
activations, AVX512-VNNI or AVX2) on the 30 layers, once both builds give the same bits on every
one. The matmul and decode modes need AMX; --int8-dots needs VNNI or AVX2; the attention modes run
anywhere (a build whose prompt kernel declines on this CPU is timed as served: each row a decode
query). Never beside another measurement.

    .venv/bin/python benchmarks/kernel_ab.py --base 1cc1238 --threads 2   # ~30 s
    .venv/bin/python benchmarks/kernel_ab.py --base 1cc1238 --attention --rows 256 512 1600
    .venv/bin/python benchmarks/kernel_ab.py --base 1cc1238 --threads 1 --decode --rows 1 2 4 8
    .venv/bin/python benchmarks/kernel_ab.py --base b6a703b --decode-attention --seqs 1 2 3 --keys 2000
    .venv/bin/python benchmarks/kernel_ab.py --base bd052ad --int8-dots --rows 1 2 4 8 16 32 64 256
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from machine import ROOT, git_commit, machine_line

from tailserve.kernels import cpu as cpu_kernels

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (k, n_out) of one layer's matmuls
LAYERS = 30
_P, _I = ctypes.c_void_p, ctypes.c_int64
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's attention, the server's block size


def build(source: Path, out: Path, need_amx: bool = True) -> ctypes.CDLL:
    cc = ["cc", *cpu_kernels.FLAGS, cpu_kernels.OPENMP, str(source), "-o", str(out), "-lm"]
    subprocess.run(cc, check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    if lib.ts_amx_init() != 1 and need_amx:
        raise SystemExit("needs AMX tile data (Intel Sapphire Rapids or later)")
    lib.ts_q4_prefill_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    lib.ts_q4_prefill_silu_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    lib.ts_paged_prompt_attention.argtypes = [_P, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, ctypes.c_float]
    lib.ts_q4_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    lib.ts_q8_matmul.argtypes = [_P, _I, _I, _P, _P, _I, _P]
    lib.ts_paged_decode_attention.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, *[_I] * 5, ctypes.c_float]
    lib.ts_q4a16_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _P]
    return lib


def attention_inputs(rows: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv rows, k cache, v cache, block table) for `rows` prompt rows at positions start onward."""
    g = torch.Generator().manual_seed(rows * 7919 + start)
    ctx = start + rows
    blocks = (ctx + BLOCK - 1) // BLOCK
    k_cache = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=g).to(torch.int64)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(torch.bfloat16)
    return qkv, k_cache, v_cache, table


def attention_s(lib: ctypes.CDLL, inputs: tuple[torch.Tensor, ...], start: int, out: torch.Tensor) -> float:
    """Seconds of one layer's prompt attention into out."""
    qkv, k_cache, v_cache, table = inputs
    rows = qkv.shape[0]
    begin = time.perf_counter()
    ran = lib.ts_paged_prompt_attention(
        qkv.data_ptr(),
        qkv.shape[1],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        rows,
        start,
        out.data_ptr(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        BLOCK,
        HEAD_DIM**-0.5,
    )
    if ran != 1:  # a build without a prompt kernel for this CPU: each row a decode query, as served
        lens = torch.arange(start + 1, start + rows + 1, dtype=torch.int64)
        begin = time.perf_counter()
        lib.ts_paged_decode_attention(
            qkv.data_ptr(), qkv.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), 0,
            lens.data_ptr(), out.data_ptr(), rows, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM**-0.5,
        )  # fmt: skip
    return time.perf_counter() - begin


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


def same_matmul_bits(
    libs: dict[str, ctypes.CDLL],
    weights: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]],
    x: dict[int, torch.Tensor],
    silu: bool,
) -> bool:
    """Whether both builds give the same bits on one layer's four matmuls (gate-up fused with --silu)."""
    rows = x[576].shape[0]
    outputs = []
    for lib in libs.values():
        out = []
        for layer in weights[: len(SHAPES)]:
            y = torch.zeros(rows, 3072, dtype=torch.bfloat16)
            forward_s(lib, [layer], x, y, silu)
            out.append(y)
        outputs.append(out)
    a, b = outputs
    return all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(a, b, strict=True))


def compare_matmuls(
    libs: dict[str, ctypes.CDLL], base: str, row_counts: Sequence[int], repeats: int, silu: bool
) -> None:
    """A table row per row count: the best 30 layers' matmuls of each build, once both builds are
    seen to give the same bits on a layer's matmuls."""
    weights = layer_weights(0)
    print(f"\n| rows | {base} ms | HEAD (working tree) ms | HEAD / {base} |\n| ---: | ---: | ---: | ---: |")
    for rows in row_counts:
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
        if not same_matmul_bits(libs, weights, x, silu):
            raise SystemExit(f"{rows} rows: the two builds' outputs differ")
        y = torch.empty(rows, 3072, dtype=torch.bfloat16)
        best = dict.fromkeys(libs, float("inf"))
        for r in range(repeats):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                best[name] = min(best[name], forward_s(libs[name], weights, x, y, silu))
        base_ms, head_ms = 1000 * best[base], 1000 * best["HEAD"]
        print(f"| {rows} | {base_ms:.2f} | {head_ms:.2f} | {head_ms / base_ms:.3f} |", flush=True)


def compare_attention(
    libs: dict[str, ctypes.CDLL], base: str, row_counts: Sequence[int], start: int, repeats: int
) -> None:
    """A table row per row count: one layer's prompt attention, best and median of each build, and
    whether their outputs are the same bits."""
    print(
        f"\n| rows (from {start}) | {base} ms best / median | HEAD ms best / median | HEAD / {base} best / median | same bits |"
        "\n| ---: | ---: | ---: | ---: | --- |"
    )
    for rows in row_counts:
        inputs = attention_inputs(rows, start)
        outs = {name: torch.zeros(rows, HEADS * HEAD_DIM, dtype=torch.bfloat16) for name in libs}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(repeats):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                times[name].append(1000 * attention_s(libs[name], inputs, start, outs[name]))
        same = torch.equal(outs[base].view(torch.int16), outs["HEAD"].view(torch.int16))
        b, h = times[base], times["HEAD"]
        print(
            f"| {rows} | {min(b):.3f} / {statistics.median(b):.3f} | {min(h):.3f} / {statistics.median(h):.3f} | "
            f"{min(h) / min(b):.3f} / {statistics.median(h) / statistics.median(b):.3f} | {'yes' if same else 'no'} |",
            flush=True,
        )


HEAD_SHAPE = (576, 49152)  # the LM head's (k, n_out)


def head_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 codes and scales of the LM head, in ts_q8_matmul's layout."""
    g = torch.Generator().manual_seed(seed)
    k, n = HEAD_SHAPE
    codes = torch.randint(-128, 128, (n * k,), dtype=torch.int8, generator=g)
    return codes, torch.rand(n * k // 32, generator=g) * 0.02


def decode_s(
    lib: ctypes.CDLL,
    weights: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]],
    x: dict[int, torch.Tensor],
    y: torch.Tensor,
    outputs: list[torch.Tensor] | None = None,
    kernel: str = "ts_q4_matmul",
) -> float:
    """Seconds of `kernel` (ts_q4_matmul, or ts_q4a16_matmul over dots_weights) over `weights`
    (each output appended to `outputs` when given)."""
    rows = x[576].shape[0]
    matmul = getattr(lib, kernel)
    start = time.perf_counter()
    for k, n, packed, scale, low in weights:
        matmul(
            x[k].data_ptr(),
            rows,
            k,
            packed.data_ptr(),
            scale.data_ptr(),
            low.data_ptr(),
            None,
            n,
            y.data_ptr(),
        )
        if outputs is not None:
            outputs.append(y.view(-1)[: rows * n].clone())  # y is [rows, n] at the front
    return time.perf_counter() - start


def head_s(
    lib: ctypes.CDLL, head: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, logits: torch.Tensor
) -> float:
    """Seconds of the LM head's ts_q8_matmul."""
    k, n = HEAD_SHAPE
    start = time.perf_counter()
    lib.ts_q8_matmul(
        x.data_ptr(), x.shape[0], k, head[0].data_ptr(), head[1].data_ptr(), n, logits.data_ptr()
    )
    return time.perf_counter() - start


def decode_ab(libs: dict[str, ctypes.CDLL], rows_list: Sequence[int], repeats: int) -> None:
    """Per row count: both builds' best layer and head times, after checking their bits agree."""
    weights, head = layer_weights(0), head_weights(1)
    base, _ = libs
    print(
        f"\n| rows | layers {base} ms | layers HEAD ms | HEAD / {base} | head {base} ms | head HEAD ms | HEAD / {base} |"
        "\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for rows in rows_list:
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
        y = torch.empty(rows, 3072, dtype=torch.bfloat16)
        logits = {name: torch.empty(rows, HEAD_SHAPE[1]) for name in libs}
        outputs: dict[str, list[torch.Tensor]] = {name: [] for name in libs}
        for name, lib in libs.items():
            decode_s(lib, weights, x, y, outputs[name])
            head_s(lib, head, x[576], logits[name])
        a, b = outputs.values()
        if any(not torch.equal(p, q) for p, q in zip(a, b, strict=True)) or not torch.equal(*logits.values()):
            raise SystemExit(f"{rows} rows: the two builds' outputs differ")
        layers = dict.fromkeys(libs, float("inf"))
        heads = dict.fromkeys(libs, float("inf"))
        for r in range(repeats):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                layers[name] = min(layers[name], decode_s(libs[name], weights, x, y))
                heads[name] = min(heads[name], head_s(libs[name], head, x[576], logits[name]))
        lb, lh = 1000 * layers[base], 1000 * layers["HEAD"]
        hb, hh = 1000 * heads[base], 1000 * heads["HEAD"]
        print(
            f"| {rows} | {lb:.2f} | {lh:.2f} | {lh / lb:.3f} | {hb:.3f} | {hh:.3f} | {hh / hb:.3f} |",
            flush=True,
        )


def dots_weights(seed: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(k, n, codes, scale, min) of every matmul of every layer in ts_q4a16_matmul's layout: one
    code (0 .. 15) a byte, [n / 16, k / 4, 16, 4]; scale and min float32 [n / 16, k / 32, 16]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            codes = torch.randint(0, 16, (n * k,), dtype=torch.uint8, generator=g)
            scale = torch.rand(n * k // 32, generator=g) * 0.02
            out.append((k, n, codes, scale, -8 * scale))
    return out


DOTS = "ts_q4a16_matmul"


def int8_dots_ab(libs: dict[str, ctypes.CDLL], rows_list: Sequence[int], repeats: int) -> None:
    """Per row count: both builds' best 30 layers of ts_q4a16_matmul, after checking their bits agree."""
    weights = dots_weights(0)
    base, _ = libs
    if any(lib.ts_vnni() not in (1, 2) for lib in libs.values()):
        raise SystemExit("the builds have no int8 dot products here (neither AVX512-VNNI nor AVX2)")
    print(f"\n| rows | {base} ms | HEAD ms | HEAD / {base} |\n| ---: | ---: | ---: | ---: |")
    for rows in rows_list:
        x = {
            k: (torch.randn(rows, k) * torch.rand(rows, k).pow(4) * 8).to(torch.bfloat16) for k in (576, 1536)
        }
        y = torch.empty(rows, 3072, dtype=torch.bfloat16)
        outputs: dict[str, list[torch.Tensor]] = {name: [] for name in libs}
        for name, lib in libs.items():
            decode_s(lib, weights, x, y, outputs[name], DOTS)
        a, b = outputs.values()
        if any(not torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(a, b, strict=True)):
            raise SystemExit(f"{rows} rows: the two builds' outputs differ")
        best = dict.fromkeys(libs, float("inf"))
        for r in range(repeats):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                best[name] = min(best[name], decode_s(libs[name], weights, x, y, kernel=DOTS))
        b_ms, h_ms = 1000 * best[base], 1000 * best["HEAD"]
        print(f"| {rows} | {b_ms:.2f} | {h_ms:.2f} | {h_ms / b_ms:.3f} |", flush=True)


@dataclass(frozen=True)
class DecodeContexts:
    """A decode step's attention inputs: per layer its own K and V pool (so every layer's keys are
    cold, as in a step), the sequences' block tables over them (shuffled), lengths and queries."""

    pools: list[tuple[torch.Tensor, torch.Tensor]]
    tables: torch.Tensor  # int64 [seqs, blocks per sequence]
    lens: torch.Tensor  # int64 [seqs]
    q: torch.Tensor  # bf16 [seqs, HEADS, HEAD_DIM]


def decode_contexts(seqs: int, keys: int) -> DecodeContexts:
    """`seqs` sequences of `keys` keys each, random q/k/v (q and so the scores x2: a peaked softmax)."""
    g = torch.Generator().manual_seed(seqs * 7919 + keys)
    width = -(-keys // BLOCK)
    slots = seqs * width * BLOCK
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    tables = torch.randperm(seqs * width, generator=g).view(seqs, width).contiguous()
    q = (torch.randn(seqs, HEADS, HEAD_DIM, generator=g) * 2).to(torch.bfloat16)
    pools = [(k.clone(), v.clone()) for _ in range(LAYERS)]
    return DecodeContexts(pools, tables, torch.full((seqs,), keys, dtype=torch.int64), q)


def decode_attention_s(
    lib: ctypes.CDLL, ctx: DecodeContexts, out: torch.Tensor, layers: int = LAYERS
) -> float:
    """Seconds of the first `layers` layers' decode attention (each layer's output into out)."""
    seqs, width = ctx.tables.shape
    start = time.perf_counter()
    for k, v in ctx.pools[:layers]:
        lib.ts_paged_decode_attention(
            ctx.q.data_ptr(), HEADS * HEAD_DIM, k.data_ptr(), v.data_ptr(), ctx.tables.data_ptr(), width,
            ctx.lens.data_ptr(), out.data_ptr(), seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM**-0.5,
        )  # fmt: skip
    return time.perf_counter() - start


def decode_attention_error(ctx: DecodeContexts, out: torch.Tensor) -> float:
    """The worst element's error over the bf16 bound (|ref| 2^-8 + max |ref| 2^-12, as the kernel
    tests allow) against a float64 softmax attention of layer 0: at most 1 passes."""
    k, v = ctx.pools[0]
    per_head = torch.arange(HEADS) // (HEADS // KV_HEADS)
    worst = 0.0
    for s in range(ctx.tables.shape[0]):
        n = int(ctx.lens[s])
        rows = (ctx.tables[s, :, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
        keys, values = k[rows][:, per_head].double(), v[rows][:, per_head].double()
        scores = torch.einsum("hd,nhd->hn", ctx.q[s].double(), keys) * HEAD_DIM**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
        bound = want.abs() * 2**-8 + want.abs().max() * 2**-12
        worst = max(worst, float(((out[s].double() - want).abs() / bound).max()))
    return worst


def decode_attention_ab(
    libs: dict[str, ctypes.CDLL],
    base: str,
    seq_counts: Sequence[int],
    key_counts: Sequence[int],
    repeats: int,
) -> None:
    """A table row per key and sequence count: the 30 layers' decode attention, best and median of
    each build, once each is seen within bf16 of float64 on layer 0."""
    print(
        f"\n| sequences x keys | {base} ms best / median | HEAD ms best / median | HEAD / {base} best / median "
        f"| error / bf16 bound {base} / HEAD | same bits |\n| ---: | ---: | ---: | ---: | ---: | --- |"
    )
    for keys, seqs in itertools.product(key_counts, seq_counts):
        ctx = decode_contexts(seqs, keys)
        outs = {name: torch.zeros(seqs, HEADS, HEAD_DIM, dtype=torch.bfloat16) for name in libs}
        errors: dict[str, float] = {}
        for name, lib in libs.items():
            decode_attention_s(lib, ctx, outs[name], layers=1)
            errors[name] = decode_attention_error(ctx, outs[name])
            if errors[name] > 1:
                raise SystemExit(f"{name}: {seqs} x {keys} keys off a float64 attention by more than bf16")
        same = torch.equal(outs[base].view(torch.int16), outs["HEAD"].view(torch.int16))
        times: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(repeats):
            for name in list(libs) if r % 2 else list(libs)[::-1]:
                times[name].append(1000 * decode_attention_s(libs[name], ctx, outs[name]))
        b, h = times[base], times["HEAD"]
        print(
            f"| {seqs} x {keys} | {min(b):.2f} / {statistics.median(b):.2f} | {min(h):.2f} / {statistics.median(h):.2f} | "
            f"{min(h) / min(b):.3f} / {statistics.median(h) / statistics.median(b):.3f} | "
            f"{errors[base]:.2f} / {errors['HEAD']:.2f} | {'yes' if same else 'no'} |",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit whose kernels to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1600])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--silu", action="store_true", help="gate-up through the fused SiLU x up kernel")
    parser.add_argument(
        "--attention", action="store_true", help="the prompt attention, one layer, not the matmuls"
    )
    parser.add_argument("--start", type=int, default=0, help="--attention: the first row's position")
    parser.add_argument(
        "--decode", action="store_true", help="the decode kernels (ts_q4_matmul, ts_q8_matmul)"
    )
    parser.add_argument(
        "--decode-attention", action="store_true", help="a decode step's attention, 30 layers"
    )
    parser.add_argument(
        "--int8-dots", action="store_true", help="decode rows' int8 dot-product matmul (ts_q4a16_matmul)"
    )
    parser.add_argument(
        "--seqs", type=int, nargs="+", default=[1, 2, 3], help="--decode-attention: sequences"
    )
    parser.add_argument(
        "--keys", type=int, nargs="+", default=[2000], help="--decode-attention: keys a sequence"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "base.c"
        show = ["git", "show", f"{args.base}:src/tailserve/kernels/cpu_kernels.c"]
        base_src.write_text(subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
        need_amx = not (args.attention or args.decode_attention or args.int8_dots)
        libs = {
            args.base: build(base_src, Path(tmp) / "base.so", need_amx),
            "HEAD": build(cpu_kernels.SOURCE, Path(tmp) / "head.so", need_amx),
        }
        for lib in libs.values():
            lib.ts_set_threads(args.threads)
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        flags = (" --silu" if args.silu else "") + (
            f" --attention --start {args.start}" if args.attention else ""
        )
        flags += " --decode" if args.decode else ""
        flags += f" --int8-dots --rows {' '.join(map(str, args.rows))}" if args.int8_dots else ""
        if args.decode_attention:
            flags += f" --decode-attention --seqs {' '.join(map(str, args.seqs))} --keys {' '.join(map(str, args.keys))}"
        print(
            f"# `benchmarks/kernel_ab.py --base {args.base} --threads {args.threads}{flags}` at {stamp} on {machine_line()}, commit {git_commit()}"
        )
        if args.decode:
            decode_ab(libs, args.rows, args.repeats)
            return 0
        if args.int8_dots:
            int8_dots_ab(libs, args.rows, args.repeats)
            return 0
        if args.decode_attention:
            decode_attention_ab(libs, args.base, args.seqs, args.keys, args.repeats)
            return 0
        if args.attention:
            compare_attention(libs, args.base, args.rows, args.start, args.repeats)
        else:
            compare_matmuls(libs, args.base, args.rows, args.repeats, args.silu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
