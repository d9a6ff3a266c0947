"""The fused CPU kernels (model/cpu_kernels.c) against torch references, and the fused forward pass
against the op-by-op torch path on the real model."""

from __future__ import annotations

import ctypes
import platform
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tailserve.errors import ConfigError
from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.kernels import cpu as cpu_kernels
from tailserve.kernels.cpu import ptr
from tailserve.model.attention import gather_blocks
from tailserve.model.plans import build_model
from tailserve.model.sampler import SamplingSpec
from tailserve.model.transformer import _rotate
from tailserve.weights.formats import (
    Int4Groups,
    int4_from_blocks,
    int4_from_float,
    int8_groups_from_blocks,
    pack_amx_int4,
    pack_amx_int8,
    pack_vnni_int4,
    pack_vnni_int8,
)
from tailserve.weights.loader import LoadedModel
from tests.weights.test_formats import _assert_within_bf16, _blocks

HAS_COMPILER = platform.system() == "Linux" and (shutil.which("cc") or shutil.which("gcc")) is not None
CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
HAS_AMX = "amx_bf16" in CPU_FLAGS
HAS_AVX512_BF16 = "avx512_bf16" in CPU_FLAGS


# Every kernel test runs once per instruction set this CPU can execute (TAILSERVE_CPU_ISA), so an
# AMX machine also tests the AVX512-BF16, AVX-512 and portable builds a Zen 4, a Xeon without AMX
# or AVX512-BF16, or an AVX2 machine runs.
WHO_RUNS = {
    "amx": "an Intel CPU with AMX (Sapphire Rapids or later)",
    "avx512bf16": "a CPU with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake or later)",
    "avx512": "a CPU with AVX-512 (Intel Skylake-SP or later, AMD Zen 4)",
}


def _forget_kernels() -> None:
    cpu_kernels.load.cache_clear()
    cpu_kernels.tile_isa.cache_clear()


@pytest.fixture(scope="module", params=["amx", "avx512bf16", "avx512", "portable"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernels built for one instruction set, for every test of the module that uses them."""
    name: str = request.param
    missing = [f for f in cpu_kernels.ISA_CPU_FLAGS.get(name, ()) if f not in CPU_FLAGS.split()]
    if missing:
        pytest.skip(
            f"{cpu_kernels.ISA_ENV}={name} runs on {WHO_RUNS[name]}; this CPU lacks {', '.join(missing)}"
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_kernels.ISA_ENV, name)
        _forget_kernels()
        yield name
    _forget_kernels()


@pytest.fixture(scope="module")
def lib(isa: str) -> ctypes.CDLL:
    built = cpu_kernels.load()
    if built is None:
        pytest.skip("no C compiler here: the torch path runs (tested everywhere else)")
    return built


@pytest.fixture(scope="module")
def tiles(lib: ctypes.CDLL, isa: str) -> ctypes.CDLL:
    """The int4 / Q8_0 tile matmuls, on AMX or (without it) AVX512-BF16."""
    built = cpu_kernels.tile_matmuls()
    if built is None:
        pytest.skip(
            f"the {isa} build has no tile matmul (int4 runs on torch's kernel, the head on bf16); "
            "the amx and avx512bf16 builds test it"
        )
    return built


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels for the CPU's best instruction set, whichever `isa` the module is on now."""
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    _forget_kernels()
    yield
    _forget_kernels()


@pytest.mark.usefixtures("native")
def test_the_kernels_build_wherever_a_compiler_is() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    assert cpu_kernels.load() is not None
    if HAS_AMX:
        assert cpu_kernels.amx() is not None
        assert cpu_kernels.identity().endswith("+amx")
    elif HAS_AVX512_BF16:  # AMD Zen 4 and the like: the int matmuls run, prompt int4 does not
        assert cpu_kernels.amx() is None and cpu_kernels.tile_matmuls() is not None
        assert cpu_kernels.identity().endswith("+avx512bf16")
    assert cpu_kernels.identity().startswith("cpu_kernels-")


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """load() / tile_isa() forget what they built, and build under tmp_path; restored afterwards."""
    monkeypatch.setenv("TAILSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)  # the CPU's best, whichever `isa` is on
    _forget_kernels()
    yield
    _forget_kernels()


@pytest.mark.usefixtures("fresh_kernels")
def test_the_isa_selector_builds_each_path_apart_and_refuses_what_the_cpu_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if not HAS_COMPILER:
        pytest.skip("no C compiler")
    flags = set(CPU_FLAGS.split())
    built: dict[str, str] = {}
    for isa, tile in cpu_kernels.ISA_TILE.items():
        monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)
        _forget_kernels()
        if not all(f in flags for f in cpu_kernels.ISA_CPU_FLAGS.get(isa, ())):
            with pytest.raises(ConfigError, match=f"{isa} needs CPU flags .*it can run: native"):
                cpu_kernels.load()
            continue
        lib = cpu_kernels.load()
        assert lib is not None
        assert cpu_kernels.tile_isa() == tile  # the build runs the path it was asked for, no other
        built[isa] = lib._name
    assert len(set(built.values())) == len(built)  # each its own file: the cache key holds the ISA
    assert len(list((tmp_path / "kernels").glob("*.so"))) == len(built)
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx3")
    _forget_kernels()
    with pytest.raises(
        ConfigError, match="must be one of native, amx, avx512bf16, avx512, portable, got 'avx3'"
    ):
        cpu_kernels.load()


@pytest.mark.usefixtures("fresh_kernels")
def test_a_failing_compiler_or_the_switch_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/bin/false")
    assert cpu_kernels.load() is None
    assert "torch path runs" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-built file left to load later
    cpu_kernels.load.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert cpu_kernels.load() is None
    assert cpu_kernels.identity() == "off"


def _bf(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def test_norm_residual_and_silu_kernels_match_torch(lib: ctypes.CDLL) -> None:
    rows, dim, inter, eps = 5, 96, 80, 1e-5
    h = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1)) * 3
    w = torch.randn(dim, generator=torch.Generator().manual_seed(2))
    out = torch.empty(rows, dim, dtype=torch.bfloat16)
    lib.ts_rms_norm(ptr(h), ptr(w), ptr(out), rows, dim, eps)
    _assert_within_bf16(out, F.rms_norm(h, (dim,), w, eps))

    delta = _bf(rows, dim + 16, seed=3)  # a strided view: row stride dim + 16
    h2 = h.clone()
    lib.ts_add_rms_norm(ptr(h2), ptr(delta), dim + 16, ptr(w), ptr(out), rows, dim, eps)
    want = h + delta[:, :dim].float()
    torch.testing.assert_close(h2, want, rtol=0, atol=1e-6)  # the residual stream stays float32
    _assert_within_bf16(out, F.rms_norm(want, (dim,), w, eps))
    h3, before = h.clone(), out.clone()
    lib.ts_add_rms_norm(ptr(h3), ptr(delta), dim + 16, None, ptr(out), rows, dim, eps)  # no norm: add only
    torch.testing.assert_close(h3, want, rtol=0, atol=1e-6)
    assert torch.equal(out, before)

    gu = _bf(rows, 2 * inter, seed=4, scale=3.0)
    act = torch.empty(rows, inter, dtype=torch.bfloat16)
    lib.ts_silu_mul(ptr(gu), ptr(act), rows, inter)
    g, u = gu.float().chunk(2, dim=-1)
    _assert_within_bf16(act, F.silu(g) * u)


def test_silu_rows_of_any_width_and_extreme_values_round_as_the_scalar_formula(lib: ctypes.CDLL) -> None:
    """SiLU x up runs 16 lanes at a time where AVX-512 is: widths with a scalar tail, many rows (the
    pool splits them), large, tiny and NaN gates: each output is the float32 formula rounded to
    bf16, to the last bit but for a rare tie (e^x by polynomial, not expf)."""
    rows, inter = 700, 83
    gu = _bf(rows, 2 * inter, seed=11, scale=8.0)
    gu[0, :6] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-30, float("nan")])
    act = torch.empty(rows, inter, dtype=torch.bfloat16)
    lib.ts_silu_mul(ptr(gu), ptr(act), rows, inter)
    g, u = gu.float().chunk(2, dim=-1)
    want = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)
    same = (act == want) | (act.isnan() & want.isnan())  # (-0 == 0)
    one_ulp = same | ((act.view(torch.int16).int() - want.view(torch.int16).int()).abs() <= 1)
    assert bool(one_ulp.all()), (act[~one_ulp][:8], want[~one_ulp][:8])
    assert same.float().mean() > 0.999


def test_silu_of_a_very_negative_gate_is_zero_not_nan(isa: str, lib: ctypes.CDLL) -> None:
    """silu(g) for g far below zero is ~0 (e^-g overflows float32 below about -88): the output is 0
    with any up value, never NaN, on every build. (Under -ffast-math GCC makes x / (1 + e^-x) a
    reciprocal estimate and a Newton step: an infinite e^-x gave inf x 0 = NaN outside AMX builds
    until e^-x was clamped there.)"""
    gates = torch.tensor([-89.0, -100.0, -200.0, -1000.0] * 4)
    gu = torch.cat([gates, torch.linspace(-8, 8, 16)]).view(1, 32).to(torch.bfloat16)
    act = torch.full((1, 16), 7.0, dtype=torch.bfloat16)
    lib.ts_silu_mul(ptr(gu), ptr(act), 1, 16)
    assert not bool(act.isnan().any()), act
    assert bool((act.float().abs() < 1e-30).all()), act


def test_rope_over_many_rows_equals_rope_row_by_row(lib: ctypes.CDLL) -> None:
    """The pool splits a prompt's rows: each row is rotated and written as it is alone."""
    rows, heads, kv_heads, dim = 600, 9, 3, 64
    qkv = _bf(rows, (heads + 2 * kv_heads) * dim, seed=12)
    positions = torch.arange(rows) * 3 % 1024
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(13))
    freqs = torch.outer(torch.arange(1024).double(), 1e4 ** -(torch.arange(0, dim, 2).double() / dim))
    cos_half, sin_half = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
    caches = [torch.zeros(rows, kv_heads, dim, dtype=torch.bfloat16) for _ in range(4)]
    together, alone = qkv.clone(), qkv.clone()
    lib.ts_rope_write_kv(
        ptr(together), ptr(positions), ptr(cos_half), ptr(sin_half), ptr(slots), ptr(caches[0]),
        ptr(caches[1]), rows, heads, kv_heads, dim,
    )  # fmt: skip
    for r in range(rows):
        lib.ts_rope_write_kv(
            ptr(alone[r]), ptr(positions[r:]), ptr(cos_half), ptr(sin_half), ptr(slots[r:]), ptr(caches[2]),
            ptr(caches[3]), 1, heads, kv_heads, dim,
        )  # fmt: skip
    assert torch.equal(together, alone)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rope_rotates_q_and_k_in_place_and_writes_k_v_to_their_slots(lib: ctypes.CDLL) -> None:
    rows, heads, kv_heads, dim, positions_max = 4, 6, 2, 32, 64
    qkv = _bf(rows, (heads + 2 * kv_heads) * dim, seed=5)
    positions = torch.tensor([0, 7, 31, 63])
    slots = torch.tensor([5, 0, 17, 9])
    freqs = torch.outer(
        torch.arange(positions_max).double(), 1e4 ** -(torch.arange(0, dim, 2).double() / dim)
    )
    cos_half, sin_half = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
    k_cache = torch.zeros(20, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    original = qkv.clone()
    lib.ts_rope_write_kv(
        ptr(qkv), ptr(positions), ptr(cos_half), ptr(sin_half), ptr(slots), ptr(k_cache), ptr(v_cache),
        rows, heads, kv_heads, dim,
    )  # fmt: skip
    cos = torch.cat([cos_half, cos_half], -1)[positions].unsqueeze(1)
    sin = torch.cat([-sin_half, sin_half], -1)[positions].unsqueeze(1)
    qk = original[:, : (heads + kv_heads) * dim].float().view(rows, heads + kv_heads, dim)
    want = _rotate(qk, cos, sin)
    _assert_within_bf16(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), want)
    assert torch.equal(
        qkv[:, (heads + kv_heads) * dim :], original[:, (heads + kv_heads) * dim :]
    )  # v untouched
    assert torch.equal(
        k_cache[slots], qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    )
    assert torch.equal(v_cache[slots], original[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (14, 2, 64), (4, 2, 48), (32, 8, 64), (7, 1, 64)],
)
def test_paged_decode_attention_equals_sdpa_over_the_gathered_context(
    lib: ctypes.CDLL, heads: int, kv_heads: int, dim: int
) -> None:
    """Unequal lengths (inside a block, on a boundary, one token), blocks in shuffled order, GQA
    groups 1-7. With AMX, up to 16 heads take the tile path; 32 heads the AVX-512 one, and head
    size 48 the portable loops."""
    cpu_kernels.amx()  # the tile path is on wherever it can run
    bs, lens = 16, [1, 15, 16, 17, 100, 257]
    width = max(-(-n // bs) for n in lens) + 1  # a padded table, as the runner builds it
    num_blocks = len(lens) * width + 3
    g = torch.Generator().manual_seed(heads * dim)
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    seq_lens = torch.tensor(lens)
    scale = dim**-0.5
    lib.ts_paged_decode_attention(
        ptr(q), heads * dim, ptr(k_cache), ptr(v_cache), ptr(tables), width, ptr(seq_lens), ptr(out),
        len(lens), heads, kv_heads, dim, bs, scale,
    )  # fmt: skip
    for s, n in enumerate(lens):
        keys = gather_blocks(k_cache, tables[s], bs)[:n].float().transpose(0, 1)
        values = gather_blocks(v_cache, tables[s], bs)[:n].float().transpose(0, 1)
        want = F.scaled_dot_product_attention(
            q[s].float().unsqueeze(1), keys, values, scale=scale, enable_gqa=True
        ).squeeze(1)
        _assert_within_bf16(out[s], want)


def _prompt_attention(
    lib: ctypes.CDLL, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    start_pos: int, heads: int, kv_heads: int, dim: int, bs: int = 16,
) -> torch.Tensor | None:  # fmt: skip
    """ts_paged_prompt_attention over qkv's rows (q first in each row) at start_pos..; None if it declined."""
    rows = qkv.shape[0]
    out = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    ran = lib.ts_paged_prompt_attention(
        ptr(qkv), qkv.stride(0), ptr(k_cache), ptr(v_cache), ptr(table), rows, start_pos, ptr(out),
        heads, kv_heads, dim, bs, dim**-0.5,
    )  # fmt: skip
    if not ran:
        assert not out.any(), "the kernel declined and still wrote"
        return None
    return out


def _int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x (float32, last dim a multiple of 32) as the int8 prompt scores round it, in float64: per group
    of 32 values, code = round(x x 127 / the group's largest |x|), value = code x largest / 127."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    top = groups.abs().amax(-1, keepdim=True).double()
    # each quotient correctly rounded to float32, as the kernel's (torch's scalar / tensor is
    # a reciprocal times the scalar, one float32 step off near a tie)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top)).float()
    codes = torch.round(groups * inv).clamp(-127, 127)
    return (codes.double() * (top / 127.0).float().double()).reshape(x.shape)


def _int8_prompt_scores(lib: ctypes.CDLL, dim: int) -> bool:
    """True where the prompt kernel computes q.k on int8 dot products: ts_prompt_scores() == 3, for
    head sizes in whole groups of 32 (others keep float32 scores)."""
    return int(lib.ts_prompt_scores()) == 3 and dim % 32 == 0


def _avx2_fma() -> bool:
    """Whether the portable build has the AVX2 prompt kernel (every x86-64 kind of the project's)."""
    return {"avx2", "fma"} <= set(CPU_FLAGS.split())


def test_the_prompt_scores_run_on_what_the_build_has(lib: ctypes.CDLL, isa: str) -> None:
    """AMX tiles on the amx build; on the portable one float32 FMAs where the CPU has AVX2 and FMA,
    else none; between them int8 dot products where the CPU has AVX512-VNNI (every AVX-512 CPU of
    the project's kinds), else float32 FMAs."""
    portable = 2 if _avx2_fma() else 0
    want = {"amx": 1, "portable": portable}.get(isa, 3 if "avx512_vnni" in CPU_FLAGS.split() else 2)
    assert lib.ts_prompt_scores() == want


def test_int8_dot_products_run_on_what_the_build_has(lib: ctypes.CDLL, isa: str) -> None:
    """ts_vnni: 1 (VPDPBUSD) on an AVX-512 build where the CPU has AVX512-VNNI, else 2 (AVX2's
    VPMADDUBSW, the portable build included) where it has AVX2 and FMA, else 0 (the int8 matmuls
    decline)."""
    vnni = isa != "portable" and "avx512_vnni" in CPU_FLAGS.split()
    assert lib.ts_vnni() == (1 if vnni else 2 if _avx2_fma() else 0)


def _assert_causal_softmax(
    got: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    start_pos: int, bs: int = 16, int8_scores: bool = False,
) -> None:  # fmt: skip
    """got against a float32 softmax attention of q [rows, heads, dim] at start_pos.. over the
    sequence's paged context, causal (the row at position p sees keys 0..p). The kernel rounds the
    weights P to bf16 (2^-8 relative each) before P V, so besides the output's rounding (2^-8 of
    |out|) an element may be off by 2^-8 of the weighted mean of |v| (the same attention over |V|);
    float32 sums add next to nothing (the worst element here reaches 0.85 of the bound). With
    int8_scores the reference's scores are those of q (times the softmax scale in base 2) and k
    rounded to int8 per group of 32 (_int8_groups), the kernel's rule; the same bound then holds."""
    ctx = start_pos + q.shape[0]
    keys = gather_blocks(k_cache, table, bs)[:ctx].float().transpose(0, 1)
    values = gather_blocks(v_cache, table, bs)[:ctx].float().transpose(0, 1)
    sees = torch.arange(ctx)[None, :] <= torch.arange(start_pos, ctx)[:, None]
    scale = q.shape[-1] ** -0.5
    queries = q.float().transpose(0, 1)
    if int8_scores:  # the scores of q and k as each is rounded (_int8_groups), in float64
        base2 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(
            1.44269504088896341, dtype=torch.float32
        )
        queries = _int8_groups(queries * base2) / base2.double()
        keys = _int8_groups(keys)

    def attend(v: torch.Tensor) -> torch.Tensor:
        if not int8_scores:
            out = F.scaled_dot_product_attention(
                queries, keys, v, attn_mask=sees, scale=scale, enable_gqa=True
            )
            return out.transpose(0, 1)
        group = queries.shape[0] // keys.shape[0]
        k64 = keys.repeat_interleave(group, 0)
        scores = (queries @ k64.transpose(1, 2)) * scale
        weights = torch.softmax(scores.masked_fill(~sees, float("-inf")), dim=-1)
        return (weights @ v.double().repeat_interleave(group, 0)).float().transpose(0, 1)

    want, weighted_abs = attend(values), attend(values.abs())
    err = (got.float() - want).abs()
    bound = (want.abs() + weighted_abs) * 2**-8
    assert bool((err <= bound).all()), (
        f"max error {err.max().item():.3g}, worst error / bound {(err / bound).max():.3g}"
    )


def _assert_prompt_attention(
    lib: ctypes.CDLL, chunk: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    start: int, heads: int, kv_heads: int, dim: int, bs: int = 16,
) -> None:  # fmt: skip
    """The kernel runs the chunk (q|k|v rows at start..) and meets _assert_causal_softmax, under the
    scores' rule this build computes them by."""
    got = _prompt_attention(lib, chunk, k_cache, v_cache, table, start, heads, kv_heads, dim, bs)
    assert got is not None
    q = chunk[:, : heads * dim].reshape(chunk.shape[0], heads, dim)
    _assert_causal_softmax(
        got, q, k_cache, v_cache, table, start, bs, int8_scores=_int8_prompt_scores(lib, dim)
    )


def _prompt_case(
    heads: int, kv_heads: int, dim: int, spans: list[tuple[int, int]], seed: int, bs: int = 16
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A cache shared by several sequences, each with its own shuffled block table, and per sequence
    the q|k|v rows of its chunk (start_pos, rows) (only q is read: K/V are already in the cache).
    Every slot no sequence has reached holds NaN, as a reused pool may hold anything there."""
    widths = [-(-(start + rows) // bs) for start, rows in spans]
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(widths) + 3
    k_cache = (torch.randn(num_blocks * bs, kv_heads, dim, generator=g) * 2).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=g)
    tables = list(torch.split(order[: sum(widths)], widths))
    unreached = torch.ones(num_blocks * bs, dtype=torch.bool)
    for (start, rows), table in zip(spans, tables, strict=True):
        slots = (table[:, None] * bs + torch.arange(bs)).flatten()[: start + rows]
        unreached[slots] = False
    k_cache[unreached] = float("nan")
    v_cache[unreached] = float("nan")
    qkv = [
        _bf(rows, (heads + 2 * kv_heads) * dim, seed=seed + i, scale=2.0) for i, (_, rows) in enumerate(spans)
    ]
    return k_cache, v_cache, [t.contiguous() for t in tables], qkv


def _prompt_kernel(lib: ctypes.CDLL, isa: str) -> None:
    """Skip unless this build runs a prompt attention kernel (AMX tiles, or float32 FMAs on AVX-512
    without AMX or on AVX2); a portable build without AVX2 and FMA must decline (the decode kernel
    then runs each row, tested above)."""
    if isa == "portable" and not _avx2_fma():
        k_cache, v_cache, tables, qkv = _prompt_case(9, 3, 64, [(0, 20)], seed=1)
        assert _prompt_attention(lib, qkv[0], k_cache, v_cache, tables[0], 0, 9, 3, 64) is None
        pytest.skip(
            "the prompt attention kernels need AVX2 and FMA; this portable build declines them (checked)"
        )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 64), (14, 2, 64), (4, 4, 32), (7, 1, 64)]
)
def test_paged_prompt_attention_equals_causal_softmax_over_the_cache(
    lib: ctypes.CDLL, isa: str, heads: int, kv_heads: int, dim: int
) -> None:
    """Chunks from scratch and over a cached prefix, odd lengths, starting inside a block, one row,
    several sequences' shuffled block tables in one cache: within bf16 of a float32 causal softmax."""
    _prompt_kernel(lib, isa)
    spans = [(0, 1), (0, 37), (21, 50), (5, 100), (300, 17), (0, 16), (16, 33)]
    k_cache, v_cache, tables, qkv = _prompt_case(heads, kv_heads, dim, spans, seed=heads * dim)
    for (start, _), table, chunk in zip(spans, tables, qkv, strict=True):
        _assert_prompt_attention(lib, chunk, k_cache, v_cache, table, start, heads, kv_heads, dim)


def test_paged_prompt_attention_takes_larger_blocks(lib: ctypes.CDLL, isa: str) -> None:
    """Blocks of 32 and 64 positions (16 keys of a tile always share one block)."""
    _prompt_kernel(lib, isa)
    spans = [(0, 45), (40, 70)]
    for bs in (32, 64):
        k_cache, v_cache, tables, qkv = _prompt_case(9, 3, 64, spans, seed=bs, bs=bs)
        for (start, _), table, chunk in zip(spans, tables, qkv, strict=True):
            _assert_prompt_attention(lib, chunk, k_cache, v_cache, table, start, 9, 3, 64, bs)


def test_paged_prompt_attention_declines_what_it_cannot_run(lib: ctypes.CDLL, isa: str) -> None:
    """What a kernel cannot take leaves nothing written and returns 0 (the decode kernel runs it):
    on AMX head size 128 or 48, or blocks of 8; on the FMA kernel head sizes off multiples of 16 or
    past 256."""
    _prompt_kernel(lib, isa)
    shapes = ((128, 16), (48, 16), (64, 8)) if isa == "amx" else ((40, 16), (72, 8), (272, 16))
    for dim, bs in shapes:
        k_cache, v_cache, tables, qkv = _prompt_case(4, 2, dim, [(0, 20)], seed=dim)
        assert _prompt_attention(lib, qkv[0], k_cache, v_cache, tables[0], 0, 4, 2, dim, bs) is None


def test_the_fma_prompt_kernel_takes_head_size_128_and_small_blocks(lib: ctypes.CDLL, isa: str) -> None:
    """Without AMX the float32 kernel also takes head size 128 and blocks of 8 (it reads keys one by
    one through the table), and head sizes off whole groups of 32 (48, 80: float32 scores there,
    where the others' run on int8): within bf16 of a float32 causal softmax."""
    _prompt_kernel(lib, isa)
    if isa == "amx":
        pytest.skip("the AMX kernel declines these shapes (tested above)")
    for dim, bs in ((128, 16), (64, 8), (128, 8), (48, 16), (80, 8)):
        spans = [(0, 40), (13, 70)]
        k_cache, v_cache, tables, qkv = _prompt_case(8, 2, dim, spans, seed=dim + bs, bs=bs)
        for (start, _), table, chunk in zip(spans, tables, qkv, strict=True):
            _assert_prompt_attention(lib, chunk, k_cache, v_cache, table, start, 8, 2, dim, bs)


def test_a_prompt_gives_the_same_bits_however_it_is_chunked(lib: ctypes.CDLL, isa: str) -> None:
    """Key blocks at absolute positions, every step per row: one chunk of 700 rows, 256 + 256 + 188,
    and 1 + 99 + 333 + 267 (chunks off block boundaries) give identical rows."""
    _prompt_kernel(lib, isa)
    heads, kv_heads, dim = 9, 3, 64
    k_cache, v_cache, tables, qkv = _prompt_case(heads, kv_heads, dim, [(0, 700)], seed=5)
    whole = _prompt_attention(lib, qkv[0], k_cache, v_cache, tables[0], 0, heads, kv_heads, dim)
    assert whole is not None
    for splits in ([256, 256, 188], [1, 99, 333, 267]):
        start = 0
        for rows in splits:
            chunk = qkv[0][start : start + rows]
            got = _prompt_attention(lib, chunk, k_cache, v_cache, tables[0], start, heads, kv_heads, dim)
            assert got is not None and torch.equal(got, whole[start : start + rows]), (splits, start)
            start += rows


def _int8_dot_reference(
    x: torch.Tensor, groups: Int4Groups, bias: torch.Tensor | None, limit: float = 127.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, |terms|) in float64 of the int4a8 rule: x rounded to int8 per row and group of 32 (the
    group's largest |x| to 127, in float32 as the kernel does, ties to even), times the groups'
    exact weights; |terms| sums the magnitudes of each group's two parts, the codes' and the min's,
    which the kernel adds in float32 (they cancel where one activation is far above its group).
    `limit` 16383: the int16 rounding of ts_q4a16_matmul."""
    scale = torch.from_numpy(groups.scale).double()
    low = torch.from_numpy(groups.zero).double() - 8.0 * scale
    return _affine_int8_dot_reference(x, torch.from_numpy(groups.codes), scale, low, bias, limit)


def _affine_int8_dot_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
    bias: torch.Tensor | None,
    limit: float = 127.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_int8_dot_reference` for any groups w = scale * code + low (codes [N, K], scale and low [N, K/32])."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    top = xg.abs().amax(-1, keepdim=True)
    # a true division: `127.0 / top` is 127 x (1 / top) in torch, rounded twice
    inv = torch.where(top > 0, torch.full_like(top, limit) / top, torch.zeros_like(top))
    xq = (xg * inv).round().double()
    d = (top / limit).double()
    codes = codes.double().view(-1, k // 32, 32)
    scale, low = scale.double(), low.double()
    dots = torch.einsum("mgk,ngk->mng", xq, codes)
    d = d.squeeze(-1)[:, None, :]
    codes_term, min_term = d * scale[None] * dots, d * low[None] * xq.sum(-1)[:, None, :]
    y = (codes_term + min_term).sum(-1) + (0.0 if bias is None else bias.double())
    return y, (codes_term.abs() + min_term.abs()).sum(-1)


@pytest.mark.parametrize("wide", [False, True], ids=["int8", "int16"])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (960, 576), (576, 1536)])
def test_int8_dot_product_prompt_rows_are_the_groups_times_rounded_activations(
    lib: ctypes.CDLL, isa: str, n: int, k: int, wide: bool
) -> None:
    """ts_q4a8_prefill_matmul (AVX512-VNNI, or AVX2): the exact product of the int4 groups and the
    activations rounded to int8 per group of 32, up to float32 sums and the output's bf16 rounding;
    activations with an outlier channel; a row's bits the same alone, in any batch and at 1 or 2
    threads. A build with neither declines, writing nothing. `wide`: ts_q4a16_matmul (decode rows),
    the activations rounded to int16 within +-16383, on the same dot products."""
    g = torch.Generator().manual_seed(n + k)
    groups = int4_from_float(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(67, k, generator=g) * 2
    x[:, 5] *= 80  # one channel far above the rest, as real prompt activations have
    x = x.to(torch.bfloat16)
    if lib.ts_vnni() == 0:
        out = torch.zeros(4, 48, dtype=torch.bfloat16)
        codes = torch.zeros(3 * 24 * 64, dtype=torch.uint8)
        kernel = lib.ts_q4a16_matmul if wide else lib.ts_q4a8_prefill_matmul
        ran = kernel(
            ptr(x), 4, 96, ptr(codes), ptr(torch.zeros(3 * 3 * 16)), ptr(torch.zeros(3 * 3 * 16)), None, 48, ptr(out)
        )  # fmt: skip
        assert ran == 0 and not out.any()
        pytest.skip(f"the {isa} build has neither AVX512-VNNI nor AVX2: it declines (checked)")
    packed = pack_vnni_int4(groups, lib, bias.float())
    got = packed.matmul(x, wide)
    want, scale = _int8_dot_reference(x, groups, bias.float(), 16383.0 if wide else 127.0)
    err = (got.double() - want).abs()
    bound = want.abs() * 2**-8 + scale * 2**-20
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max():.3g}"
    if wide:  # int16 activations: nearer the unrounded product than int8's
        exact = x.double() @ groups.dequantize(torch.float64).T + bias.double()
        narrow = packed.matmul(x)
        assert (got.double() - exact).abs().mean() < 0.5 * (narrow.double() - exact).abs().mean()
    alone = torch.cat([packed.matmul(x[i : i + 1].contiguous(), wide) for i in range(x.shape[0])])
    assert torch.equal(alone, got)
    assert torch.equal(packed.matmul(x[7:50].contiguous(), wide), got[7:50])
    before = lib.ts_threads()
    try:
        lib.ts_set_threads(1)
        one = packed.matmul(x, wide)
        lib.ts_set_threads(2)
        assert torch.equal(one, got) and torch.equal(packed.matmul(x, wide), got)
    finally:
        lib.ts_set_threads(before)


def test_q8_head_on_int8_dot_products_is_the_blocks_times_rounded_activations(
    lib: ctypes.CDLL, isa: str
) -> None:
    """ts_q8a8_matmul (the LM head where the CPU has VNNI or AVX2 but no bf16 arithmetic): the file's Q8_0
    groups times the activations rounded to int8 per group of 32, float32 logits (no bf16 rounding),
    over a vocabulary off the 16-wide tile; a row's bits the same alone, in any batch and at 1 or 2
    threads. A build with neither declines, writing nothing."""
    t = _blocks("Q8_0", 1000, 224, seed=9)
    groups = int8_groups_from_blocks(t)
    assert groups is not None
    x = _bf(21, 224, seed=10)
    if lib.ts_vnni() == 0:
        out = torch.zeros(2, 16)
        ran = lib.ts_q8a8_matmul(
            ptr(x), 2, 32, ptr(torch.zeros(512, dtype=torch.uint8)), ptr(torch.zeros(16)), ptr(torch.zeros(16)),
            16, ptr(out),
        )  # fmt: skip
        assert ran == 0 and not out.any()
        pytest.skip(f"the {isa} build has neither AVX512-VNNI nor AVX2: it declines (checked)")
    packed = pack_vnni_int8(groups, lib)
    got = packed.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (21, 1000)
    scale = groups.scale.double()
    want, terms = _affine_int8_dot_reference(x, groups.codes, scale, torch.zeros_like(scale), None)
    err = (got.double() - want).abs()
    bound = want.abs() * 2**-20 + terms * 2**-16  # float32 sums; the stored codes' +128 cancels in them
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max():.3g}"
    exact = x.float() @ groups.dequantize().T  # and near the unrounded product: 1/254 per activation
    assert (got - exact).abs().max() < 0.01 * exact.abs().max()
    alone = torch.cat([packed.matmul(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
    assert torch.equal(alone, got)
    before = lib.ts_threads()
    try:
        lib.ts_set_threads(1)
        one = packed.matmul(x)
        lib.ts_set_threads(2)
        assert torch.equal(one, got) and torch.equal(packed.matmul(x), got)
    finally:
        lib.ts_set_threads(before)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("n", "k"), [(24, 96), (80, 160), (960, 576)])
def test_int4_tile_matmul_is_exact_to_the_blocks(tiles: ctypes.CDLL, kind: str, n: int, k: int) -> None:
    """The file's own scale and min, widened to float32, times bf16 x with float32 sums: the only
    rounding is the output to bf16 (torch's int4 kernel rounds scale and zero to bf16 too)."""
    t = _blocks(kind, n, k, seed=n + k)
    groups = int4_from_blocks(t)
    assert groups is not None
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    packed = pack_amx_int4(groups, tiles, bias)
    ref_w = groups.dequantize()
    for rows in (1, 5, 16, 17, 40):
        x = _bf(rows, k, seed=rows)
        got = packed.matmul(x.contiguous())
        assert got.shape == (rows, n)
        _assert_within_bf16(got, x.float() @ ref_w.T + bias.to(torch.bfloat16).float())
        for i in {0, rows - 1}:  # a row alone equals that row in the batch, bit for bit
            assert torch.equal(packed.matmul(x[i : i + 1].contiguous()), got[i : i + 1])


def test_q8_tile_head_is_exact_to_the_q8_0_blocks(tiles: ctypes.CDLL) -> None:
    t = _blocks("Q8_0", 1000, 224, seed=9)  # a vocab off the 16-wide tile
    groups = int8_groups_from_blocks(t)
    assert groups is not None
    packed = pack_amx_int8(groups, tiles)
    ref_w = groups.dequantize()
    x = _bf(21, 224, seed=10)
    got = packed.matmul(x.contiguous())
    want = x.float() @ ref_w.T
    assert got.dtype == torch.float32 and got.shape == (21, 1000)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # float32 sums, no bf16 output rounding
    for i in (0, 16, 20):  # rows alone equal rows in a batch, bit for bit
        assert torch.equal(packed.matmul(x[i : i + 1].contiguous()), got[i : i + 1])


def _q8_tile_matmul(
    tiles: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """ts_q8_matmul of x [rows, k] on packed int8 [n / 16, k / 32, 16, 16, 2], scale [n / 16, k / 32, 16]."""
    rows, k, n = x.shape[0], x.shape[1], packed.shape[0] * 16
    y = torch.empty(rows, n)
    tiles.ts_q8_matmul(ptr(x), rows, k, ptr(packed), ptr(scale), n, ptr(y))
    return y


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_tile_matmul_sums_each_group_alone_then_scales_in_group_order(
    tiles: ctypes.CDLL, groups: int
) -> None:
    """The decode matmuls' bits are pinned by their schedule: each group's tile product on its own,
    from zero (a one-group call with scale 1 gives it), then acc = fma(scale, product, acc) group
    after group. Checked on the Q8_0 head kernel (its output is the float32 acc; the int4 kernel runs
    the same schedule), at 1-17 rows, an odd tile count and 1 and 2 threads."""
    n, k = 48, 32 * groups
    gen = torch.Generator().manual_seed(groups)
    packed = torch.randint(-128, 128, (n // 16, groups, 16, 16, 2), dtype=torch.int8, generator=gen)
    scale = torch.rand(n // 16, groups, 16, generator=gen) + 0.5
    ones = torch.ones(n // 16, 1, 16)
    threads = int(tiles.ts_threads())
    try:
        for rows in range(1, 18):
            x = _bf(rows, k, seed=rows)
            want = torch.zeros(rows, n, dtype=torch.float64)
            for g in range(groups):
                product = _q8_tile_matmul(
                    tiles, x[:, 32 * g : 32 * g + 32].contiguous(), packed[:, g : g + 1].contiguous(), ones
                )
                # fma in float64: the product of two float32 is exact there, so one rounding to float32
                want = (scale[:, g].reshape(n).double() * product.double() + want).float().double()
            for t in (1, 2):
                tiles.ts_set_threads(t)
                assert torch.equal(_q8_tile_matmul(tiles, x, packed, scale), want.float()), (rows, t)
    finally:
        tiles.ts_set_threads(threads)


def _runner(smol: LoadedModel, fused: bool) -> ModelRunner:
    model = build_model(smol, "int4", torch.device("cpu"), 512)
    runner = ModelRunner(model, 64, 16, torch.device("cpu"), kv_dtype=torch.bfloat16, cpu_kernels=fused)
    assert (model.fused is not None) == fused
    return runner


def test_fused_forward_matches_the_torch_path_on_the_real_model(lib: ctypes.CDLL, smol: LoadedModel) -> None:
    """Prefill, a chunk over a cached prefix, decodes and a mixed step: the same logits within bf16
    noise, the same greedy token on (nearly) every row."""
    fused, plain = _runner(smol, True), _runner(smol, False)
    prompt = smol.tokenizer.encode("The river Tiber runs through the city of Rome, and its bridges")
    greedy = SamplingSpec(temperature=0.0)
    steps = [
        [SeqChunk(prompt[:10], 0, [0, 1], True, greedy)],  # prefill from scratch
        [SeqChunk(prompt[10:], 10, [0, 1], True, greedy)],  # a chunk over its cached prefix
        [SeqChunk(prompt[:5], 0, [2], True, greedy), SeqChunk(prompt[:8], 0, [5, 6], False, greedy)],
        [  # mixed: two decodes of unequal context, then a prompt chunk over its cached prefix
            SeqChunk([prompt[3]], len(prompt), [0, 1], True, greedy, decode=True),
            SeqChunk([prompt[4]], 5, [2], True, greedy, decode=True),
            SeqChunk(prompt[8:], 8, [5, 6], True, greedy),
        ],
    ]
    agree = total = 0
    for chunks in steps:
        a, b = fused.logits_for(chunks), plain.logits_for(chunks)
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 0.1 * b.abs().max().item()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert agree >= 0.9 * total, f"{agree}/{total} rows agree on the top token"


def test_a_prompt_chunked_or_batched_gives_the_same_logits_on_amx(
    lib: ctypes.CDLL, isa: str, smol: LoadedModel
) -> None:
    """The real model on AMX: a 40-token prompt in one chunk, in chunks of 19 + 21 (off a block
    boundary, both on the prompt attention kernel), and beside another prompt in one step: the same
    logits bit for bit (every kernel of the int4 plan's prompt rows is row-wise there)."""
    if isa != "amx":
        pytest.skip(f"the {isa} build's prompt matmuls are oneDNN's, whose sums may follow the row count")
    runner = _runner(smol, True)
    text = "The river Tiber runs through the city of Rome, and its bridges carry people, carts and stories "
    prompt = smol.tokenizer.encode(text * 3)[:40]
    other = smol.tokenizer.encode(
        "Alice was beginning to get very tired of sitting by her sister on the bank"
    )
    greedy = SamplingSpec(temperature=0.0)
    whole = runner.logits_for([SeqChunk(prompt, 0, [0, 1, 2], False, greedy)])
    first = runner.logits_for([SeqChunk(prompt[:19], 0, [3, 4, 5], False, greedy)])
    rest = runner.logits_for([SeqChunk(prompt[19:], 19, [3, 4, 5], False, greedy)])
    assert torch.equal(torch.cat([first, rest]), whole)
    beside = runner.logits_for(
        [SeqChunk(other, 0, [6, 7], False, greedy), SeqChunk(prompt, 0, [8, 9, 10], False, greedy)]
    )
    assert torch.equal(beside[len(other) :], whole)


def test_a_prompt_only_step_gives_the_bits_of_the_layer_by_layer_path(
    lib: ctypes.CDLL, isa: str, smol: LoadedModel
) -> None:
    """Steps of prompt rows only run every layer from one loop of raw kernel calls; they give the
    logits of the module-by-module path bit for bit: a prompt from scratch, a chunk over its cached
    prefix, and two prompts in one step (one under PROMPT_KERNEL_MIN_ROWS rows: the decode kernel).
    On AMX (the int4 prompt kernel, SiLU fused) and where prompt rows run int8 dot products (`int4a8`:
    VNNI without bf16 arithmetic, gate|up then SiLU x up)."""
    lean, modules = _runner(smol, True), _runner(smol, True)
    assert lean.model.fused is not None and modules.model.fused is not None
    if lean.model.fused._prompt_plans() is None:
        assert isa != "amx", "AMX builds take every prompt-only step in the loop"
        pytest.skip(
            f"the {isa} build's prompt linears here are dense (bf16 or float32): the module path runs"
        )
    modules.model.fused._plans = [None]  # a layer the loop cannot take: every step by the modules
    text = "The river Tiber runs through the city of Rome, and its bridges carry people, carts and stories "
    prompt = smol.tokenizer.encode(text * 3)[:40]
    greedy = SamplingSpec(temperature=0.0)
    steps = [
        [SeqChunk(prompt[:23], 0, [0, 1], False, greedy)],
        [SeqChunk(prompt[23:], 23, [0, 1, 2], False, greedy)],
        [SeqChunk(prompt[:5], 0, [3], False, greedy), SeqChunk(prompt, 0, [4, 5, 6], False, greedy)],
    ]
    for chunks in steps:
        assert torch.equal(lean.logits_for(chunks), modules.logits_for(chunks))
    assert lean.model.fused is not None and lean.model.fused._prompt_plans() is not None


def test_int8_dot_product_prompts_give_the_same_logits_however_chunked(
    lib: ctypes.CDLL, isa: str, smol: LoadedModel
) -> None:
    """Where prompt rows run int8 dot products (`int4a8`, row-invariant) beside the float32 FMA
    prompt attention (chunk-invariant, taking chunks of any size), a prompt over a cached prefix
    gives the whole prompt's layers bit for bit (every layer's K and V in the cache; the head, torch's
    bf16 GEMM, may round a lone row apart): the README's question from scratch, and again as 32
    cached positions plus 1 and 4 (chunks the decode kernel took before, flipping its first token)."""
    lean = _runner(smol, True)
    fused = lean.model.fused
    assert fused is not None
    plans = fused._prompt_plans()
    if plans is None or not plans[0].int4a8:
        pytest.skip(f"the {isa} build's prompt rows here are not int4a8 (AMX int4, bf16 or float32)")
    prompt = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    greedy = SamplingSpec(temperature=0.0)
    whole = lean.logits_for([SeqChunk(prompt, 0, [0, 1, 2], True, greedy)])
    again = _runner(smol, True)
    again.logits_for([SeqChunk(prompt[:32], 0, [0, 1], False, greedy)])
    for start, end in ((32, 33), (33, len(prompt))):  # 1 row, then the other 4
        got = again.logits_for([SeqChunk(prompt[start:end], start, [0, 1, 2], True, greedy)])
        assert torch.equal(got.argmax(-1), whole[start:end].argmax(-1))
    slots = slice(0, len(prompt))  # blocks 0, 1, 2 of 16 positions: the same slots in both pools
    for (k_whole, v_whole), (k_again, v_again) in zip(lean.kv_caches, again.kv_caches, strict=True):
        assert torch.equal(k_whole.flatten(0, 1)[slots], k_again.flatten(0, 1)[slots])
        assert torch.equal(v_whole.flatten(0, 1)[slots], v_again.flatten(0, 1)[slots])
    assert smol.tokenizer.decode([int(whole[-1].argmax())]).strip() == "The"


def test_a_decode_only_step_gives_the_bits_of_the_layer_by_layer_path(
    lib: ctypes.CDLL, isa: str, smol: LoadedModel
) -> None:
    """Steps of decode rows only run every layer from one C call (ts_decode_layers); their logits are
    the module-by-module path's bit for bit: one stream, then three of unequal contexts (one past a
    block boundary), on every build with the int4 tile matmul or int8 dot products for decode rows
    (`int4a16`: VNNI or AVX2 where the CPU has no bf16 arithmetic)."""
    lean, modules = _runner(smol, True), _runner(smol, True)
    assert modules.model.fused is not None and lean.model.fused is not None
    if lean.model.fused._decode_plans(1) is None:
        assert cpu_kernels.tile_matmuls() is None, "the int4 tile matmul takes every decode-only step"
        pytest.skip(f"the {isa} build's decode rows run on torch's int4 kernel here")
    modules.model.fused._decode_steps = [None]  # a layer the loop cannot take: every step by the modules
    text = "The river Tiber runs through the city of Rome, and its bridges carry people, carts and stories "
    tokens = smol.tokenizer.encode(text * 3)
    greedy = SamplingSpec(temperature=0.0)
    prompts = [(tokens[:20], [0, 1]), (tokens[5:22], [2, 3]), (tokens[:9], [4])]
    for runner in (lean, modules):
        runner.logits_for([SeqChunk(p, 0, blocks, False, greedy) for p, blocks in prompts])
    steps = [
        [SeqChunk([tokens[20]], 20, [0, 1], True, greedy, decode=True)],
        [
            SeqChunk([tokens[21]], 21, [0, 1], True, greedy, decode=True),
            SeqChunk([tokens[22]], 17, [2, 3], True, greedy, decode=True),
            SeqChunk([tokens[9]], 9, [4], True, greedy, decode=True),
        ],
    ]
    for chunks in steps:
        assert torch.equal(lean.logits_for(chunks), modules.logits_for(chunks))
    assert lean.model.fused._decode_plans(3) is not None


@pytest.fixture
def threads() -> Iterator[Callable[[int], int]]:
    """Sets torch's and the kernels' thread count together (as `--num-threads` does); restored after."""
    before = torch.get_num_threads()

    def use(n: int) -> int:
        torch.set_num_threads(n)
        return cpu_kernels.sync_threads()

    yield use
    use(before)


def test_the_kernels_share_torchs_openmp_threads(lib: ctypes.CDLL, threads: Callable[[int], int]) -> None:
    """Built with OpenMP, the kernels follow `--num-threads` and bind to the libgomp torch loaded: one
    team of threads in the process, not a second pool spinning against torch's on the same cores."""
    assert threads(3) == 3 and lib.ts_threads() == 3
    assert threads(1) == 1
    # The kernels link libgomp.so.1 by soname; wheels that vendor their own rename it (libgomp-HASH).
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if line.endswith("/libgomp.so.1")}
    assert len(gomp) == 1, f"two OpenMP runtimes loaded: {sorted(gomp)}"
    assert Path(torch.__file__).parent in Path(gomp.pop()).parents, "the kernels' libgomp is not torch's"


def test_every_kernel_gives_the_same_bits_at_any_thread_count(
    lib: ctypes.CDLL, threads: Callable[[int], int]
) -> None:
    """Threads split outputs (tiles, sequences, rows), never a sum: 1, 2 and 3 threads agree bit for
    bit on decode attention and the row kernels, and where the build has them on the int4 decode and
    (with AMX) prompt matmuls and prompt attention, and the q8 head."""
    tiles = cpu_kernels.tile_matmuls()
    t = _blocks("Q4_1", 960, 576, seed=3)
    groups = int4_from_blocks(t)
    g8 = int8_groups_from_blocks(_blocks("Q8_0", 1000, 576, seed=5))
    assert groups is not None and g8 is not None
    bias = torch.randn(960, generator=torch.Generator().manual_seed(4))
    q4 = None if tiles is None else pack_amx_int4(groups, tiles, bias)
    q8 = None if tiles is None else pack_amx_int8(g8, tiles)
    bs, lens, heads, kv_heads, dim = 16, [1, 17, 100, 257, 40], 9, 3, 64
    width = max(-(-n // bs) for n in lens)
    g = torch.Generator().manual_seed(6)
    k_cache = torch.randn(len(lens) * width * bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(torch.bfloat16)
    tables = torch.randperm(len(lens) * width, generator=g).view(len(lens), width).contiguous()
    q = _bf(len(lens), heads, dim, seed=7)
    seq_lens = torch.tensor(lens)
    x_decode, x_prompt = _bf(16, 576, seed=8), _bf(300, 576, seed=9)
    qkv_prompt = _bf(len(lens) * width * bs, (heads + 2 * kv_heads) * dim, seed=12)  # every slot a prompt row
    gu, h0, delta, w = (
        _bf(300, 2 * 1536, seed=10),
        torch.randn(300, 576),
        _bf(300, 576, seed=11),
        torch.rand(576),
    )

    def run() -> list[torch.Tensor]:
        attn = torch.empty_like(q)
        lib.ts_paged_decode_attention(
            ptr(q), heads * dim, ptr(k_cache), ptr(v_cache), ptr(tables), width, ptr(seq_lens), ptr(attn),
            len(lens), heads, kv_heads, dim, bs, dim**-0.5,
        )  # fmt: skip
        act, h, normed = torch.empty(300, 1536, dtype=torch.bfloat16), h0.clone(), torch.empty_like(delta)
        lib.ts_silu_mul(ptr(gu), ptr(act), 300, 1536)
        lib.ts_add_rms_norm(ptr(h), ptr(delta), 576, ptr(w), ptr(normed), 300, 576, 1e-5)
        out = [attn, act, h, normed]
        prompt = _prompt_attention(
            lib, qkv_prompt, k_cache, v_cache, tables.view(-1), 0, heads, kv_heads, dim
        )
        out += [] if prompt is None else [prompt]
        if q4 is not None and q8 is not None:
            out += [q4.matmul(x_decode), q8.matmul(x_decode)]
            out += [q4.prefill_matmul(x_prompt)] if cpu_kernels.amx() is not None else []
        return out

    assert threads(1) == 1
    alone = run()
    for n in (2, 3):
        assert threads(n) == n
        for i, (a, b) in enumerate(zip(alone, run(), strict=True)):
            assert torch.equal(a, b), f"output {i} differs at {n} threads"


def test_the_fused_forward_is_the_same_at_two_threads(
    lib: ctypes.CDLL, smol: LoadedModel, threads: Callable[[int], int]
) -> None:
    """The real model, a prompt and a mixed step: the logits at 2 threads equal those at 1 exactly
    where every GEMM in the path rounds the same at any thread count. On a CPU without native bf16
    (no AVX512-BF16, no AMX: an Ice Lake Xeon) the head is torch's bf16 GEMM, which splits its sums
    by thread count there (a 2-row head product differs in the last bf16 bit at 2 threads): the
    logits then agree within a bf16 step, and the best token of every row, re-scored in float32
    from the same hidden state, is the same token with the same logit."""
    runner = _runner(smol, True)
    prompt = smol.tokenizer.encode("The river Tiber runs through the city of Rome, and its bridges")
    greedy = SamplingSpec(temperature=0.0)
    steps = [
        [SeqChunk(prompt, 0, [0, 1], True, greedy), SeqChunk(prompt[:7], 0, [2], True, greedy)],
        [
            SeqChunk([prompt[3]], len(prompt), [0, 1], True, greedy, decode=True),
            SeqChunk([prompt[4]], 7, [2], True, greedy, decode=True),
        ],
    ]
    got = {}
    for n in (1, 2):
        assert threads(n) == n
        got[n] = [runner.logits_for(chunks).clone() for chunks in steps]
    for a, b in zip(got[1], got[2], strict=True):
        if cpu_kernels.native_bf16() or runner.model.lm_head.kernel != "bf16":
            assert torch.equal(a, b)
            continue
        # Each side rounded its own float32 sum to bf16: at most one bf16 step (2^-7 relative) apart.
        bound = torch.maximum(a.abs(), b.abs()) * 2**-7 + a.abs().max() * 2**-12
        assert bool(((a - b).abs() <= bound).all()), f"max difference {(a - b).abs().max().item():.3g}"
        best = a.argmax(-1)
        assert torch.equal(b.argmax(-1), best)
        assert torch.equal(b.gather(-1, best[:, None]), a.gather(-1, best[:, None]))


def _decode_attention(
    lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
    lens: list[int], bs: int,
) -> torch.Tensor:  # fmt: skip
    """ts_paged_decode_attention: one query q[s] [heads, dim] per sequence over its paged context."""
    seqs, heads, dim = q.shape
    out = torch.empty_like(q)
    seq_lens = torch.tensor(lens)
    lib.ts_paged_decode_attention(
        ptr(q), heads * dim, ptr(k_cache), ptr(v_cache), ptr(tables), tables.stride(0), ptr(seq_lens), ptr(out),
        seqs, heads, k_cache.shape[1], dim, bs, dim**-0.5,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 64), (4, 2, 48)])
def test_a_long_context_decodes_to_the_same_bits_at_any_thread_count_and_in_any_batch(
    lib: ctypes.CDLL, threads: Callable[[int], int], heads: int, kv_heads: int, dim: int
) -> None:
    """A 1,500-key context (its keys split across the threads in segments, the last part-filled):
    alone at 1 thread, at 1-3 threads, and between sequences of 1, 300, 700 and 2,100 keys in either
    order, its output is the same bits (as is every other sequence's against its own run alone), and
    within bf16 of a float64 softmax attention (as are the others'). With AMX, 9 heads take the tile
    path; 32 heads the AVX-512 one, also head size 48. Slots no sequence reaches hold NaN, as a
    reused pool may hold anything there. A combine in finishing order rather than segment order would
    move a float32 sum by an ulp or so, which survives the rounding to bf16 in about one output of
    10,000-20,000: so the threaded runs repeat (~90,000 outputs compared), which catches it most times,
    not every time."""
    cpu_kernels.amx()  # the tile path is on wherever it can run
    bs, long_len, others = 16, 1500, [300, 1, 2100, 700]
    lens = [long_len, *others]
    widths = [-(-n // bs) for n in lens]
    g = torch.Generator().manual_seed(heads + dim)
    num_blocks = sum(widths) + 2
    k_cache = (torch.randn(num_blocks * bs, kv_heads, dim, generator=g) * 2).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int64)  # padded, as the runner builds them
    unreached = torch.ones(num_blocks * bs, dtype=torch.bool)
    for s, (n, table) in enumerate(zip(lens, torch.split(order[: sum(widths)], widths), strict=True)):
        tables[s, : len(table)] = table
        unreached[(table[:, None] * bs + torch.arange(bs)).flatten()[:n]] = False
    k_cache[unreached] = float("nan")
    v_cache[unreached] = float("nan")
    q = _bf(len(lens), heads, dim, seed=heads * dim, scale=2.0)

    assert threads(1) == 1
    each = [
        _decode_attention(lib, q[s : s + 1], k_cache, v_cache, tables[s : s + 1], lens[s : s + 1], bs)[0]
        for s in range(len(lens))
    ]
    alone = each[0]
    first, last = [0, 1, 2, 3, 4], [1, 2, 3, 4, 0]  # the long context first, then last
    for count in (1, 2, 3):
        assert threads(count) == count
        for _ in range(1 if count == 1 else 8):
            for rows in (first, last):
                lens_in = [lens[r] for r in rows]
                out = _decode_attention(lib, q[rows], k_cache, v_cache, tables[rows], lens_in, bs)
                for i, r in enumerate(rows):
                    assert torch.equal(out[i], each[r]), f"sequence {r}: {count} threads, sequences {rows}"

    for s, n in enumerate(lens):
        keys = gather_blocks(k_cache, tables[s, : widths[s]], bs)[:n].double()  # [n, kv_heads, dim]
        values = gather_blocks(v_cache, tables[s, : widths[s]], bs)[:n].double()
        per_head = torch.arange(heads) // (heads // kv_heads)
        scores = torch.einsum("hd,nhd->hn", q[s].double(), keys[:, per_head]) * dim**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[:, per_head])
        got = alone if s == 0 else out[last.index(s)]  # out: the last batch run above
        _assert_within_bf16(got, want)


@pytest.mark.usefixtures("fresh_kernels")
def test_without_openmp_the_kernels_build_single_threaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that refuses -fopenmp still builds the kernels: they run on the caller's thread."""
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None or platform.system() != "Linux":
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-no-openmp"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    caplog.set_level("INFO", logger="tailserve.kernels.cpu")
    lib = cpu_kernels.load()
    assert lib is not None
    assert "no OpenMP" in caplog.text
    assert lib.ts_set_threads(4) == 1
    x, ones = torch.randn(3, 8), torch.ones(8)
    out = torch.empty(3, 8, dtype=torch.bfloat16)
    lib.ts_rms_norm(ptr(x), ptr(ones), ptr(out), 3, 8, 1e-6)
    torch.testing.assert_close(out.float(), F.rms_norm(x, (8,), eps=1e-6), atol=1e-2, rtol=1e-2)
