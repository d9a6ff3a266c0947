"""Weight formats: GGUF blocks decode exactly, the int4 / int8 kernels equal their dequantized weights,
fused layers equal separate ones, and decode / prefill rows each take their own kernel."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tailserve.kernels import cpu as cpu_kernels
from tailserve.kernels import onednn
from tailserve.model.linear import Linear, WeightSource, fuse
from tailserve.model.transformer import LMHead
from tailserve.weights.formats import (
    dequantize_tensor,
    int4_from_blocks,
    int4_from_float,
    int8_from_float,
    pack_int4,
    pack_int8,
)
from tailserve.weights.gguf_file import GGUFTensor
from tailserve.weights.loader import LoadedModel

_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# (N, K): N off the packing's 16 and the kernel's 64-wide tile, K a multiple of 32 but not of 64/128.
ODD_SHAPES = [(24, 96), (80, 160), (16, 32), (1000, 224), (960, 576)]


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> GGUFTensor:
    """Random but well-formed GGUF blocks of `kind` for an [n, k] weight."""
    rng = np.random.default_rng(seed)
    type_id, size = _TYPES[kind]
    nb = k // 32
    raw = np.zeros((n, nb, size), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(0.002, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        raw[..., 2:] = rng.integers(-127, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
    else:
        start = 2
        if kind == "Q4_1":
            raw[..., 2:4] = rng.uniform(-0.4, 0.0, (n, nb, 1)).astype(np.float16).view(np.uint8)
            start = 4
        raw[..., start:] = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    return GGUFTensor("w", type_id, kind, (n, k), raw.reshape(n, nb * size))


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _assert_within_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to rounding the output to bf16 (plus fp32 accumulation order)."""
    if ref.numel() == 0:
        return
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2**-8 + ref.abs().max() * 2**-12
    assert bool((err <= bound).all()), (
        f"max error {err.max().item():.3g}, |ref| max {ref.abs().max().item():.3g}"
    )


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_decode_equals_gguf_reference(kind: str) -> None:
    t = _blocks(kind, 48, 96)
    ref = np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.type_id)), dtype=np.float32)
    assert torch.equal(dequantize_tensor(t), torch.from_numpy(ref.reshape(48, 96)))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("n", "k"), ODD_SHAPES)
def test_int4_kernel_equals_dequantized_blocks(kind: str, n: int, k: int) -> None:
    groups = int4_from_blocks(_blocks(kind, n, k, seed=n + k))
    assert groups is not None
    # The kernel stores scale and zero in bf16: that rounding is the format's only loss.
    ref_w = (torch.from_numpy(groups.codes).float() - 8) * _bf16(
        torch.from_numpy(groups.scale)
    ).repeat_interleave(32, 1) + _bf16(torch.from_numpy(groups.zero)).repeat_interleave(32, 1)
    assert torch.allclose(ref_w, groups.dequantize(), atol=0.05 * 2**-7 * 16)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = pack_int4(groups).matmul(x)
    assert out.shape == (5, n)
    _assert_within_bf16(out, x.float() @ ref_w.T)


@pytest.mark.parametrize(("n", "k"), ODD_SHAPES)
def test_int8_kernel_equals_dequantized_rows(n: int, k: int) -> None:
    w = dequantize_tensor(_blocks("Q8_0", n, k, seed=k))
    rows = int8_from_float(w)
    assert (rows.dequantize() - w).abs().max() <= rows.scale.max() / 2 + 1e-7  # round to nearest code
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    packed = pack_int8(rows)
    ref_w = rows.codes.float() * _bf16(rows.scale)[:, None]
    _assert_within_bf16(packed.matmul(x), x.float() @ ref_w.T)


def test_int4_requantization_of_floats_is_close() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    groups = int4_from_float(w)
    step = (w.view(64, 4, 32).amax(-1) - w.view(64, 4, 32).amin(-1)) / 15
    err = (groups.dequantize() - w).abs().view(64, 4, 32)
    assert bool((err <= step[..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize("decode", ["int4", "int8", "bf16"])
def test_fused_layer_equals_separate_layers(decode: str) -> None:
    """q|k|v-style fusion: concatenated blocks give the concatenated outputs, per kernel."""
    prefill = "bf16"
    parts = [_blocks("Q4_1", n, 96, seed=n) for n in (48, 24, 24)]
    sources = [WeightSource(dequantize_tensor(t), int4_from_blocks(t)) for t in parts]
    bias = [torch.randn(t.shape[0]) for t in parts]
    fused = Linear(fuse(sources), torch.cat(bias), decode, prefill)
    alone = [Linear(s, b, decode, prefill) for s, b in zip(sources, bias, strict=True)]
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for num_decodes in (0, 2, 6):
        got = fused(x, num_decodes)
        want = torch.cat([layer(x, num_decodes) for layer in alone], dim=1)
        if decode == "bf16":
            _assert_within_bf16(got, want.float())
        else:
            assert torch.equal(got[:num_decodes], want[:num_decodes])  # the int kernels: bit for bit
            _assert_within_bf16(got[num_decodes:], want[num_decodes:].float())


def test_decode_rows_take_the_decode_kernel_and_ignore_their_neighbours() -> None:
    t = _blocks("Q4_1", 80, 160, seed=5)
    layer = Linear(WeightSource(dequantize_tensor(t), int4_from_blocks(t)), None, "int4", "bf16")
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    mixed = layer(x, 3)
    assert torch.equal(mixed[:3], layer.decode_matmul(x[:3].contiguous()))
    assert torch.equal(mixed[3:], torch.nn.functional.linear(x[3:], layer.weight))
    # A decode row's result is the same alone or among up to 39 other decodes (the AMX kernel
    # takes rows 16 at a time: a row in the second or third block must not notice either).
    alone = [layer(x[i : i + 1], 1) for i in (0, 17, 39)]
    for rows in (2, 9, 16, 17, 18, 31, 33, 40):
        out = layer(x[:rows], rows)
        for i, want in zip((0, 17, 39), alone, strict=True):
            if i < rows:
                assert torch.equal(out[i : i + 1], want), (rows, i)


SLICES = ((0, 1), (0, 2), (5, 17), (40, 64), (86, 90), (0, 256), (100, 199), (171, 129))


def test_prompt_rows_on_prepacked_weights_are_within_bf16_of_the_plain_gemm() -> None:
    """`pack_for_cpu` (oneDNN's blocked layout, what the fused CPU forward uses for bf16 prompt rows):
    every slice of a batch within bf16 of F.linear on the plain weight. Not bit for bit: oneDNN picks
    its blocking by row and thread count (on Sapphire Rapids 10 of 600 slices of 300 rows differ in
    their last bit at one thread, 92 at two), so bf16 prompt rows are not batch-invariant."""
    if not onednn.bf16_packs():
        pytest.skip("torch's oneDNN has no bf16 kernels on this CPU (or none at all): the plain GEMM runs")
    t = _blocks("Q4_1", 96, 576, seed=11)
    layer = Linear(WeightSource(dequantize_tensor(t), int4_from_blocks(t)), None, "int4", "bf16")
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    plain = torch.nn.functional.linear(x, layer.weight)
    layer.pack_for_cpu()
    assert layer.onednn is not None
    _assert_within_bf16(layer.prefill_matmul(x), plain.float())
    for start, rows in SLICES:
        _assert_within_bf16(
            layer.prefill_matmul(x[start : start + rows]), plain[start : start + rows].float()
        )


def test_bf16_prompt_rows_run_on_the_plain_gemm_where_onednn_cannot_pack_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU whose oneDNN has no bf16 kernels (AVX2 only: AMD Zen 3 raised on the first reorder and
    every bf16 engine failed to start), packing leaves the weight alone and prompt rows equal F.linear."""
    monkeypatch.setattr(onednn, "bf16_packs", lambda: False)  # what an AVX2-only CPU reports
    t = _blocks("Q4_1", 96, 576, seed=11)
    layer = Linear(WeightSource(dequantize_tensor(t), int4_from_blocks(t)), None, "int4", "bf16")
    layer.pack_for_cpu()
    assert layer.onednn is None
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    assert torch.equal(layer.prefill_matmul(x), torch.nn.functional.linear(x, layer.weight))


# 80: an odd count of 16-output tiles (the kernel pairs them); k 1,536 (the down projection's): more
# groups than a 2 x 2 block has rows, so some groups' products carry no rows of the previous block's
# epilogue (prefill_block spreads it over them).
@pytest.mark.parametrize(("n_out", "k"), [(96, 576), (80, 576), (96, 1536)])
def test_int4_prompt_rows_ignore_their_batch_bit_for_bit(n_out: int, k: int) -> None:
    """The AMX int4 prompt-row kernel (what the int4 plan runs prompt rows on where AMX is) sums all of
    K per tile in one fixed order: a row's bits are the same in any slice of any batch, under its
    work split by pairs of tiles alone (below 1,024 rows) and by row blocks too (from 1,024 on)."""
    if cpu_kernels.amx() is None:
        pytest.skip(
            f"needs AMX (Intel Sapphire Rapids or later); this CPU's tile ISA: {cpu_kernels.tile_isa()}"
        )
    t = _blocks("Q4_1", n_out, k, seed=11)
    source = WeightSource(dequantize_tensor(t), int4_from_blocks(t))
    layer = Linear(source, None, "int4", "int4")
    x = torch.randn(1300, k, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    full = layer.prefill_matmul(x)
    _assert_within_bf16(full, x.float() @ source.dense.to(torch.bfloat16).float().T)
    for start, rows in (*SLICES, (0, 1023), (276, 1024), (37, 1111)):
        assert torch.equal(layer.prefill_matmul(x[start : start + rows]), full[start : start + rows])


def test_int4_prompt_rows_streamed_output_has_the_bits_of_a_small_batch() -> None:
    """A prompt-row product of 4 MB or more (a 4,000-token step's qkv) goes out by non-temporal
    stores: its rows, with a bias too, are bit for bit those of slices small enough to be stored as
    usual."""
    if cpu_kernels.amx() is None:
        pytest.skip(
            f"needs AMX (Intel Sapphire Rapids or later); this CPU's tile ISA: {cpu_kernels.tile_isa()}"
        )
    t = _blocks("Q4_1", 1024, 576, seed=31)
    source = WeightSource(dequantize_tensor(t), int4_from_blocks(t))
    bias = torch.randn(1024, generator=torch.Generator().manual_seed(32))
    layer = Linear(source, bias, "int4", "int4")
    x = torch.randn(2100, 576, generator=torch.Generator().manual_seed(33)).to(torch.bfloat16)
    full = layer.prefill_matmul(x)  # 2,100 x 1,024 bf16: 4.3 MB
    _assert_within_bf16(
        full, x.float() @ source.dense.to(torch.bfloat16).float().T + bias.to(torch.bfloat16).float()
    )
    for start, rows in ((0, 1), (5, 17), (0, 1023), (1077, 1023)):
        assert torch.equal(layer.prefill_matmul(x[start : start + rows]), full[start : start + rows])


@pytest.mark.parametrize("rows", [1, 17, 40, 300, 600, 1100])
def test_int4_prompt_rows_silu_fused_equals_matmul_then_silu_bit_for_bit(rows: int) -> None:
    """Prompt rows of a gate|up linear through the fused SiLU x up epilogue give exactly the bits of
    the gate|up product followed by the SiLU x up kernel, at row counts on every path of the kernel
    (16-row tails, 2 x 2 tiles, several row blocks, the work split by row blocks), with a bias too."""
    if cpu_kernels.amx() is None:
        pytest.skip(
            f"needs AMX (Intel Sapphire Rapids or later); this CPU's tile ISA: {cpu_kernels.tile_isa()}"
        )
    lib = cpu_kernels.load()
    assert lib is not None
    inter, k = 96, 576
    gate, up = _blocks("Q4_1", inter, k, seed=21), _blocks("Q4_1", inter, k, seed=22)
    parts = [WeightSource(dequantize_tensor(t), int4_from_blocks(t)) for t in (gate, up)]
    bias = torch.randn(2 * inter, generator=torch.Generator().manual_seed(23))
    for b in (None, bias):
        layer = Linear(fuse(parts), b, "int4", "int4")
        assert layer.fuses_silu() and layer.amx4 is not None
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        gu = layer.prefill_matmul(x).contiguous()
        want = torch.empty(rows, inter, dtype=torch.bfloat16)
        lib.ts_silu_mul(cpu_kernels.ptr(gu), cpu_kernels.ptr(want), rows, inter)
        got = torch.empty(rows, inter, dtype=torch.bfloat16)
        layer.amx4.prefill_silu_matmul(x, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_real_model_int4_groups_are_exactly_its_weights(smol: LoadedModel) -> None:
    """Every Q4_1 tensor of the default model (Q/K rows already back in HF order) becomes int4 groups
    that stand for exactly the dequantized fp32 weight: no re-quantization anywhere."""
    q4 = {name: t for name, t in smol.blocks.items() if t.type_name in ("Q4_0", "Q4_1")}
    assert len(q4) == 7 * smol.arch.num_layers
    for name, t in q4.items():
        groups = int4_from_blocks(t)
        assert groups is not None
        assert torch.equal(groups.dequantize(), smol.weights[name]), name


def test_dense_decode_threshold_is_opt_in_and_batch_dependent() -> None:
    t = _blocks("Q4_1", 48, 96, seed=7)
    source = WeightSource(dequantize_tensor(t), int4_from_blocks(t))
    layer = Linear(source, None, "int4", "bf16", dense_decode_from_rows=4)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(layer(x, 3)[:3], layer.decode_matmul(x[:3].contiguous()))  # under the threshold
    assert torch.equal(layer(x, 4), torch.nn.functional.linear(x, layer.weight))  # at it: all dense
    assert Linear(source, None, "int4", "bf16").dense_decode_from_rows is None  # never by default


@pytest.mark.parametrize("kernel", ["bf16", "int8"])
def test_lm_head_rescores_its_best_tokens_in_float32(kernel: str) -> None:
    """bf16 output rounding (0.125 at logits near 25) must not tie or swap the best tokens."""
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(4096, 64, generator=gen) * 0.5).to(torch.bfloat16)
    h = torch.randn(8, 64, generator=gen) * 4
    head = LMHead(w, kernel, refine_with=w)
    exact = h @ w.float().T
    got = head(h)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.topk(4, dim=-1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), atol=1e-4)


def test_fp32w_prompt_rows_are_one_bf16_rounding_from_the_exact_product() -> None:
    """`fp32w` (the prompt rows of CPUs without bf16 arithmetic): bf16 rows in and out, the product on
    a float32 copy of the weights, so each output is the exact product (plus bias) rounded once to
    bf16: within half a bf16 step of it (2^-8 of its size at most) plus float32 summation error. A
    lone row gets the bits it gets in a batch of two."""
    t = _blocks("Q4_1", 96, 576, seed=13)
    dense = dequantize_tensor(t)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(14))
    layer = Linear(WeightSource(dense, int4_from_blocks(t)), bias, "int4", "fp32w")
    assert layer.weight is not None and layer.weight.dtype == torch.float32
    assert layer.activation_dtype == torch.bfloat16
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    got = layer(x, 3)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[:3], layer.decode_matmul(x[:3].contiguous()))  # decode rows: the int4 kernel
    exact = x[3:].double() @ dense.double().T + bias.to(torch.bfloat16).double()
    summed = x[3:].double().abs() @ dense.double().abs().T  # what float32 summation error scales with
    err = (got[3:].double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-8 + summed * 2**-16).all()), f"max error {err.max().item():.3g}"
    two = layer.prefill_matmul(x[3:5])
    assert torch.equal(layer.prefill_matmul(x[3:4]), two[:1])
