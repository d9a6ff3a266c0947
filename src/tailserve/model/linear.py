"""A linear layer whose weight is held in the format each phase of a step runs.

The flattened batch holds the step's decode rows first: they go through the decode kernel (int4 or
int8 weight-only where that wins), the prefill rows after them through the prefill one (bf16), so a
row's arithmetic depends on its phase, never on who shares the step. Never picks a format by batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.kernels import cpu as cpu_kernels
from tailserve.kernels import onednn as onednn_kernels
from tailserve.weights.formats import (
    AmxInt4,
    Int4Groups,
    PackedInt4,
    PackedInt8,
    VnniInt4,
    concat_int4,
    int4_from_float,
    int8_from_float,
    pack_amx_int4,
    pack_int4,
    pack_int8,
    pack_vnni_int4,
)

# Decode-row kernels. `int4a8` and `int4a16` (CPUs without bf16 arithmetic, with AVX512-VNNI or
# AVX2): the int4 groups on int8 dot products, the activations rounded to int8 (the prompt rows'
# kernel) or to int16 (plans.plan_for). `int4a16` also pairs with `fp32w` prompt rows (AVX2 alone).
KERNELS = ("fp32", "bf16", "int4", "int8", "int4a8", "int4a16")
PACK_ROWS_HINT = 256  # the rows oneDNN's weight layout is chosen for: a full step budget of prompt rows
# The dense copy's dtype per prompt-row kernel. `fp32w`: bf16 activations in and out, the product on
# a float32 copy of the weights, for CPUs that have no bf16 arithmetic (formats.plan_for): there
# torch's bf16 GEMM is emulated at ~60 GFLOP/s against ~290 for float32 (2-vCPU Xeon, 2026-12-06).
_DENSE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp32w": torch.float32}


@dataclass
class WeightSource:
    """One weight as loaded: dense floats, plus its exact int4 groups when the file stores Q4 blocks."""

    dense: torch.Tensor  # [N, K] float32 or bfloat16
    int4: Int4Groups | None = None

    def int4_groups(self) -> Int4Groups:
        """The file's own groups when it has them, else a min/max re-quantization of the floats."""
        return self.int4 if self.int4 is not None else int4_from_float(self.dense)


def fuse(parts: list[WeightSource]) -> WeightSource:
    """Stack weights along N (q|k|v, gate|up); exact int4 groups survive only if every part has them."""
    if len(parts) == 1:
        return parts[0]  # no copy
    exact = [p.int4 for p in parts]
    groups = concat_int4([g for g in exact if g is not None]) if all(g is not None for g in exact) else None
    dense = [p.dense for p in parts]
    if any(d.is_meta for d in dense):  # shapes only (no dense copy loaded): torch.cat on meta imports dynamo
        rows = sum(d.shape[0] for d in dense)
        fused = torch.empty(rows, *dense[0].shape[1:], dtype=dense[0].dtype, device="meta")
    else:
        fused = torch.cat(dense)
    return WeightSource(fused, groups)


class Linear(nn.Module):
    """y = x W^T + b with the decode rows (the first `num_decodes`) and the rest on their own kernels."""

    def __init__(
        self,
        source: WeightSource,
        bias: torch.Tensor | None,
        decode: str,
        prefill: str,
        dense_decode_from_rows: int | None = None,
    ) -> None:
        super().__init__()
        # Opt-in and batch-dependent: steps with at least this many decode rows run them dense too.
        self.dense_decode_from_rows = dense_decode_from_rows
        amx_prefill = prefill == "int4"  # prompt rows on the AMX kernel from the int4 groups, no dense copy
        vnni_prefill = prefill == "int4a8"  # int8 dot products over the same groups, no dense copy either
        # int4 groups on prompt rows pair with int4 decode rows; int4a8 also with the VNNI decode kernels
        int4_decodes = ("int4", "int4a8", "int4a16") if vnni_prefill else ("int4",)
        int8_decodes = decode in ("int4a8", "int4a16")  # the int4 groups' int8 dot products on decode rows
        if (
            decode not in KERNELS
            or (
                prefill not in _DENSE_DTYPES
                and not ((amx_prefill or vnni_prefill) and decode in int4_decodes)
            )
            or (prefill == "fp32") != (decode == "fp32")
            or (int8_decodes and not (vnni_prefill or (prefill == "fp32w" and decode == "int4a16")))
        ):
            raise ValueError(f"unsupported kernel pair decode={decode!r} prefill={prefill!r}")
        self.decode_kernel, self.prefill_kernel = decode, prefill
        self.out_features, self.in_features = source.dense.shape
        self.activation_dtype = torch.float32 if prefill == "fp32" else torch.bfloat16
        # The dense copy serves prefill rows (and decode rows when decode is dense too); with
        # prefill int4 the prompt rows widen the int4 groups to bf16 on the fly instead.
        self.weight: nn.Parameter | None = None
        if not amx_prefill and not vnni_prefill:
            self.weight = nn.Parameter(source.dense.to(_DENSE_DTYPES[prefill]), requires_grad=False)
        # int4 runs on the fused kernels' tile matmul where it can (AMX or AVX512-BF16; exact to the
        # groups' float32 scales), else on torch's int4 kernel (scales rounded to bf16). One of the
        # two is kept.
        self.amx4: AmxInt4 | None = None
        self.int4: PackedInt4 | None = None
        if decode == "int4":
            groups = source.int4_groups()
            lib = cpu_kernels.tile_matmuls()
            self.amx4 = None if lib is None else pack_amx_int4(groups, lib, bias)
            self.int4 = pack_int4(groups) if self.amx4 is None else None
        if amx_prefill and (self.amx4 is None or cpu_kernels.amx() is None):
            raise ValueError("prefill int4 needs the fused CPU kernels with AMX")
        self.vnni4: VnniInt4 | None = None
        if vnni_prefill or int8_decodes:
            vnni = cpu_kernels.int8_dots()
            if vnni is None:
                raise ValueError(
                    f"{'prefill int4a8' if vnni_prefill else f'decode {decode}'} needs the fused CPU kernels' "
                    "int8 dot products (AVX512-VNNI or AVX2)"
                )
            self.vnni4 = pack_vnni_int4(source.int4_groups(), vnni, bias)
        self.int8: PackedInt8 | None = pack_int8(int8_from_float(source.dense)) if decode == "int8" else None
        self.bias = (
            None if bias is None else nn.Parameter(bias.to(self.activation_dtype), requires_grad=False)
        )
        self.onednn: torch.Tensor | None = None  # the bf16 weight in oneDNN's blocked layout (pack_for_cpu)

    def forward(self, x: torch.Tensor, num_decodes: int) -> torch.Tensor:
        """x [T, K] contiguous, in the activation dtype; rows [0, num_decodes) are decodes."""
        split = self.prompt_rows_from(num_decodes, x.shape[0])
        if split == 0:
            return self.prefill_matmul(x)
        if split >= x.shape[0]:
            return self.decode_matmul(x)
        return torch.cat([self.decode_matmul(x[:split]), self.prefill_matmul(x[split:])])

    def prompt_rows_from(self, num_decodes: int, rows: int) -> int:
        """The first of `rows` rows that `forward` runs on the prompt-row kernel (`rows`: none); the
        rows before it run on the decode kernel."""
        dense_decodes = self.dense_decode_from_rows is not None and num_decodes >= self.dense_decode_from_rows
        same = self.decode_kernel == self.prefill_kernel and (
            self.weight is not None or self.prefill_kernel == "int4a8"
        )
        return 0 if same or num_decodes == 0 or dense_decodes else min(num_decodes, rows)

    def fuses_silu(self) -> bool:
        """Whether this (gate|up) linear's prompt rows can come out as silu(gate) * up straight from
        the AMX int4 kernel (`AmxInt4.prefill_silu_matmul`): int4 prompt rows, halves of 16-output tiles."""
        return (
            self.weight is None
            and self.amx4 is not None
            and self.out_features % (2 * 16) == 0
            and self.amx4.scale.shape[0] * 16 == self.out_features
        )

    def prefill_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous through the prompt-row kernel: the dense copy, the AMX int4 widening,
        or int8 dot products over the int4 groups (`int4a8`)."""
        if self.prefill_kernel == "int4a8":
            assert self.vnni4 is not None
            return self.vnni4.matmul(x)
        if self.weight is None:
            assert self.amx4 is not None
            return self.amx4.prefill_matmul(x)
        if x.shape[0] == 1:
            # torch runs a single row on another kernel than two or more (seen on Zen 4: other
            # rounding), so a lone decode row would not equal the same row in a batch: run it as two.
            return self.prefill_matmul(x.expand(2, -1).contiguous())[:1]
        if self.weight.dtype != x.dtype:  # fp32w: float32 product, rounded once to the activations' bf16
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight, bias).to(x.dtype)
        if self.onednn is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.onednn, self.bias, "none", [None], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> None:
        """Keep the bf16 weight also in oneDNN's blocked layout, reordered once here instead of inside
        every call: prompt rows 5-10% faster at 150-256 rows and 20-60% at 16-64 (2-core Zen 4), within
        bf16 of F.linear but not batch-invariant (oneDNN blocks by row and thread count). Costs a second copy of the dense weight (the torch path and
        TP keep reading `weight`). No-op off CPU, for other dtypes, or where oneDNN has no bf16
        kernels (`onednn_kernels.bf16_packs`: an AVX2-only CPU), which leaves prompt rows on F.linear."""
        w = self.weight
        if (
            w is None
            or w.dtype != torch.bfloat16
            or w.device.type != "cpu"
            or not onednn_kernels.bf16_packs()
        ):
            return
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)

    def decode_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous through the decode kernel alone (what every decode row runs)."""
        if self.decode_kernel in ("int4a8", "int4a16"):
            assert self.vnni4 is not None
            return self.vnni4.matmul(x, wide=self.decode_kernel == "int4a16")
        if self.amx4 is not None:
            return self.amx4.matmul(x)
        packed = self.int4 if self.int4 is not None else self.int8
        assert packed is not None
        out = packed.matmul(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        amx = " (AMX)" if self.amx4 is not None else ""
        return f"{self.in_features}->{self.out_features}, decode={self.decode_kernel}{amx}, prefill={self.prefill_kernel}"

    def weight_bytes(self) -> int:
        """Bytes of every stored form of the weight (for the load log)."""
        kept: list[torch.Tensor] = [] if self.weight is None else [self.weight]
        if self.int4 is not None:
            kept += [self.int4.packed, self.int4.scale_zeros]
        if self.amx4 is not None:
            kept += [self.amx4.packed, self.amx4.scale, self.amx4.shifted_min]
        if self.int8 is not None:
            kept += [self.int8.codes, self.int8.scale]
        if self.onednn is not None:
            kept.append(self.onednn)
        if self.vnni4 is not None:
            kept += [self.vnni4.codes, self.vnni4.scale, self.vnni4.min]
        return sum(t.numel() * t.element_size() for t in kept)
