"""Weight formats and their conversions: GGUF blocks -> dense floats, int4 groups, int8 rows.

GGUF Q4_0 / Q4_1 blocks map exactly onto torch's int4 weight-only kernel (group 32 along K, code
q dequantized as `(q - 8) * scale + zero`), so they are never re-quantized; everything else that
must become int4 or int8 is re-quantized from floats here, and only here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tailserve.errors import UnsupportedModelError
from tailserve.kernels.cpu import ptr
from tailserve.weights.gguf_file import GGUFTensor

INT4_GROUP = 32  # the GGUF block length; also a group size torch's int4 kernel accepts
_INT4_N_MULTIPLE = 16  # torch's int4 packing wants the output dimension in multiples of 16


@dataclass
class Int4Groups:
    """4-bit codes with one affine pair per group of 32 inputs: w = (code - 8) * scale + zero."""

    codes: np.ndarray  # uint8 [N, K], values 0..15
    scale: np.ndarray  # float32 [N, K // 32]
    zero: np.ndarray  # float32 [N, K // 32]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these groups stand for, computed in float32 and rounded once to `dtype`."""
        n, k = self.codes.shape
        codes = torch.from_numpy(self.codes).view(n, k // INT4_GROUP, INT4_GROUP)
        scale, zero = torch.from_numpy(self.scale)[..., None], torch.from_numpy(self.zero)[..., None]
        out = torch.empty(n, k // INT4_GROUP, INT4_GROUP, dtype=dtype)
        # Row tiles that stay in cache: one pass over memory instead of four full-size temporaries.
        step = max(1, (1 << 16) // k)
        for r in range(0, n, step):
            q = codes[r : r + step].float().sub_(8.0)
            out[r : r + step] = q.mul_(scale[r : r + step]).add_(zero[r : r + step])
        return out.view(n, k)


@dataclass
class Int8Rows:
    """Symmetric 8-bit codes with one scale per output row: w = code * scale."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale[:, None]


@dataclass
class Int8Groups:
    """Symmetric 8-bit codes with one scale per group of 32 inputs: w = code * scale (GGUF Q8_0)."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        return (self.codes.float().view(n, -1, INT4_GROUP) * self.scale[..., None]).view(n, k)


def concat_int4(parts: list[Int4Groups]) -> Int4Groups:
    """Stack along the output dimension (fused q|k|v, gate|up): codes and groups row for row."""
    return Int4Groups(
        codes=np.concatenate([p.codes for p in parts]),
        scale=np.concatenate([p.scale for p in parts]),
        zero=np.concatenate([p.zero for p in parts]),
    )


def concat_int8(parts: list[Int8Rows]) -> Int8Rows:
    return Int8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))


# --- GGUF blocks -------------------------------------------------------------------------------


def _f16(data: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte `start` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(data[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _blocks(t: GGUFTensor, block_bytes: int) -> np.ndarray:
    rows = t.data.shape[0]
    return t.data.reshape(rows, -1, block_bytes)  # [rows, blocks, bytes]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 packed bytes per block -> 32 codes: low nibbles are elements 0..15, high ones 16..31."""
    out = np.empty((*qs.shape[:-1], 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., :16])
    np.right_shift(qs, 4, out=out[..., 16:])
    return out


def int4_from_blocks(t: GGUFTensor) -> Int4Groups | None:
    """Q4_0 / Q4_1 blocks as kernel groups, exactly; None for any other type (re-quantize instead)."""
    if t.type_name not in ("Q4_0", "Q4_1"):
        return None
    rows = t.data.shape[0]
    if t.type_name == "Q4_0":  # w = d * (q - 8)
        b = _blocks(t, 18)
        scale = _f16(b, 0)
        zero = np.zeros_like(scale)
        qs = b[..., 2:]
    else:  # Q4_1: w = d * q + m = (q - 8) * d + (m + 8 d)
        b = _blocks(t, 20)
        scale = _f16(b, 0)
        zero = _f16(b, 2) + 8.0 * scale
        qs = b[..., 4:]
    codes = _nibbles(qs).reshape(rows, -1)
    return Int4Groups(codes=codes, scale=scale, zero=zero)


def int8_groups_from_blocks(t: GGUFTensor) -> Int8Groups | None:
    """Q8_0 blocks (d, then 32 int8 codes) as groups, exactly; None for any other type."""
    if t.type_name != "Q8_0":
        return None
    rows = t.data.shape[0]
    b = _blocks(t, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
    return Int8Groups(torch.from_numpy(codes.copy()), torch.from_numpy(_f16(b, 0)))


def dequantize_tensor(t: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any GGUF tensor in its row-major shape, computed in float32 and rounded once to `dtype`."""
    rows = t.data.shape[0]
    if t.type_name == "F32":
        out = t.data.view(np.float32).copy()  # the map is read-only
    elif t.type_name == "F16":
        out = t.data.view(np.float16).astype(np.float32)
    elif t.type_name == "BF16":
        out = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t.type_name == "Q8_0":
        b = _blocks(t, 34)
        out = (b[..., 2:].view(np.int8).astype(np.float32) * _f16(b, 0)[..., None]).reshape(rows, -1)
    elif t.type_name in ("Q4_0", "Q4_1"):
        groups = int4_from_blocks(t)
        assert groups is not None
        return groups.dequantize(dtype).view(t.shape)
    else:
        out = _dequantize_with_gguf(t)
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(t.shape)).to(dtype)


def _dequantize_with_gguf(t: GGUFTensor) -> np.ndarray:
    import gguf

    try:
        return np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.type_id)))
    except NotImplementedError as exc:
        raise UnsupportedModelError(f"GGUF tensor {t.name}: quantization {t.type_name} unsupported") from exc


# --- re-quantization from floats ---------------------------------------------------------------


def int4_from_float(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Groups:
    """Asymmetric min/max per group of `group` inputs (for HF weights and non-Q4 GGUF tensors)."""
    n, k = w.shape
    if k % group:
        raise UnsupportedModelError(f"int4 needs the input dimension ({k}) to be a multiple of {group}")
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    # code q means lo + q * scale = (q - 8) * scale + (lo + 8 * scale)
    zero = lo + 8.0 * scale
    return Int4Groups(codes.reshape(n, k).numpy(), scale.numpy(), zero.numpy())


def int8_from_float(w: torch.Tensor) -> Int8Rows:
    """Symmetric per output row: the largest magnitude of each row maps to 127."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(-1) / 127.0).clamp_min(1e-12)
    codes = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Rows(codes, scale)


def int8_groups_from_float(w: torch.Tensor, group: int = INT4_GROUP) -> Int8Groups:
    """Symmetric per group of `group` inputs (Q8_0's rule): the group's largest magnitude maps to 127."""
    n, k = w.shape
    if k % group:
        raise UnsupportedModelError(f"int8 groups need the input dimension ({k}) to be a multiple of {group}")
    g = w.detach().float().reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / 127.0).clamp_min(1e-12)
    codes = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Groups(codes.reshape(n, k), scale)


# --- what the kernels read ---------------------------------------------------------------------


@dataclass
class PackedInt4:
    """torch's int4 weight-only layout: packed codes plus bf16 [K/32, N, 2] (scale, zero)."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    out_features: int  # N before padding to the packing's multiple of 16

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (bf16, contiguous) @ w.T -> [M, N] bf16."""
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, INT4_GROUP, self.scale_zeros
        )
        return out if out.shape[-1] == self.out_features else out[:, : self.out_features]


def pack_int4(groups: Int4Groups) -> PackedInt4:
    """Pad N to the packing's multiple, then let torch lay the codes out for its kernel (CPU)."""
    n, _ = groups.codes.shape
    pad = -n % _INT4_N_MULTIPLE
    codes, scale, zero = groups.codes, groups.scale, groups.zero
    if pad:
        codes = np.pad(codes, ((0, pad), (0, 0)), constant_values=8)
        scale = np.pad(scale, ((0, pad), (0, 0)))
        zero = np.pad(zero, ((0, pad), (0, 0)))
    # The packed layout depends on the CPU's vector width (torch picks it at run time), so the
    # final interleave is torch's; we only hand it exact codes.
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
    sz = torch.from_numpy(np.stack([scale, zero], axis=-1)).transpose(0, 1).contiguous()
    return PackedInt4(packed, sz.to(torch.bfloat16), n)


@dataclass
class PackedInt8:
    """torch's int8 weight-only layout: int8 [N, K] and bf16 per-row scales."""

    codes: torch.Tensor
    scale: torch.Tensor

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        return out


def pack_int8(rows: Int8Rows) -> PackedInt8:
    return PackedInt8(rows.codes.contiguous(), rows.scale.to(torch.bfloat16))


# --- the fused CPU kernels' AMX layouts (cpu_kernels.c: ts_q4_matmul, ts_q8_matmul) ------------

_TILE_N = 16  # output channels per tile


@dataclass
class AmxInt4:
    """Int4 groups laid out for ts_q4_matmul: per 16 outputs and k-quad, 32 bytes of nibbles, plus
    float32 [N/16, K/32, 16] scale and min - 128 * scale (the kernel's 128 + q trick). N is padded
    to a multiple of 16 (zero weights); the padding is cut off the output."""

    packed: torch.Tensor  # uint8 [N/16, K/4, 32]
    scale: torch.Tensor
    shifted_min: torch.Tensor
    min: torch.Tensor  # the groups' own min (for the prompt-row kernel)
    bias: torch.Tensor | None  # bf16 [padded N]
    out_features: int
    in_features: int
    lib: ctypes.CDLL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 contiguous @ w.T (+ bias) -> [M, N] bf16 (a view when N was padded)."""
        return self._run(self.lib.ts_q4_matmul, self.shifted_min, x)

    def prefill_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows: the same groups widened to bf16 weights on the fly (the dense bf16 copy's
        values, without the copy), float32 sums over all of K. -> [M, N] bf16."""
        return self._run(self.lib.ts_q4_prefill_matmul, self.min, x)

    def prefill_silu_matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Prompt rows of a gate|up product (gate the first half of the outputs, up the second) into
        out [M, N/2] bf16 as silu(gate) * up, with the bits of `prefill_matmul` then SiLU x up in the
        fused kernels, never writing the product itself. Needs N/2 a multiple of 16 (no padding)."""
        inter = self.out_features // 2
        assert self.scale.shape[0] * _TILE_N == self.out_features and inter % _TILE_N == 0
        bias = None if self.bias is None else ptr(self.bias)
        self.lib.ts_q4_prefill_silu_matmul(
            ptr(x),
            x.shape[0],
            self.in_features,
            ptr(self.packed),
            ptr(self.scale),
            ptr(self.min),
            bias,
            inter,
            ptr(out),
        )

    def _run(self, kernel: Any, minimum: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m, padded = x.shape[0], self.scale.shape[0] * _TILE_N
        y = torch.empty(m, padded, dtype=torch.bfloat16)
        bias = None if self.bias is None else ptr(self.bias)
        kernel(
            ptr(x), m, self.in_features, ptr(self.packed), ptr(self.scale), ptr(minimum), bias, padded, ptr(y)
        )
        return y if padded == self.out_features else y[:, : self.out_features]


def _padded_groups(
    groups: Int4Groups, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scale, min, bf16 bias) with N padded to a multiple of 16 by zero weights, w = scale *
    code + min (the groups' zero - 8 scale)."""
    n, _ = groups.codes.shape
    pad = -n % _TILE_N
    codes = torch.from_numpy(groups.codes)
    scale = torch.from_numpy(groups.scale)
    low = torch.from_numpy(groups.zero) - 8.0 * scale
    if pad:
        codes = F.pad(codes, (0, 0, 0, pad))
        scale, low = F.pad(scale, (0, 0, 0, pad)), F.pad(low, (0, 0, 0, pad))
        bias = None if bias is None else F.pad(bias, (0, pad))
    return codes.contiguous(), scale, low, None if bias is None else bias.to(torch.bfloat16).contiguous()


def pack_amx_int4(groups: Int4Groups, lib: ctypes.CDLL, bias: torch.Tensor | None = None) -> AmxInt4:
    n, k = groups.codes.shape
    codes, scale, low, b = _padded_groups(groups, bias)
    shifted_min = low - 128.0 * scale
    packed = torch.empty(codes.shape[0] // _TILE_N, k // 4, 32, dtype=torch.uint8)
    lib.ts_pack_q4(ptr(codes), codes.shape[0], k, ptr(packed))
    return AmxInt4(packed, _tiles(scale), _tiles(shifted_min), _tiles(low), b, n, k, lib)


@dataclass
class VnniInt4:
    """Int4 groups laid out for ts_q4a8_prefill_matmul (rows as int8 dot products, the activations
    rounded to int8 per group of 32): per 16 outputs and k-quad, lane j's four codes (64 bytes),
    plus float32 [N/16, K/32, 16] scale and min (w = scale * code + min). N padded to a multiple of
    16 (zero weights), cut off the output. `logits`: Q8_0 groups stored as code + 128 (min = -128
    scale) for the LM head, float32 out of ts_q8a8_matmul (`pack_vnni_int8`)."""

    codes: torch.Tensor  # uint8 [N/16, K/4, 16, 4]
    scale: torch.Tensor
    min: torch.Tensor
    bias: torch.Tensor | None  # bf16 [padded N]
    out_features: int
    in_features: int
    lib: ctypes.CDLL
    logits: bool = False

    def matmul(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """x [M, K] bf16 contiguous @ w.T (+ bias) -> [M, N] bf16, float32 for `logits` (a view when N
        was padded). `wide`: the activations rounded to int16 instead (ts_q4a16_matmul: decode rows)."""
        m, padded = x.shape[0], self.scale.shape[0] * _TILE_N
        args = (ptr(x), m, self.in_features, ptr(self.codes), ptr(self.scale), ptr(self.min))
        if self.logits:
            y = torch.empty(m, padded, dtype=torch.float32)
            ran = self.lib.ts_q8a8_matmul(*args, padded, ptr(y))
        else:
            y = torch.empty(m, padded, dtype=torch.bfloat16)
            bias = None if self.bias is None else ptr(self.bias)
            kernel = self.lib.ts_q4a16_matmul if wide else self.lib.ts_q4a8_prefill_matmul
            ran = kernel(*args, bias, padded, ptr(y))
        if ran != 1:
            raise RuntimeError("the int8 dot-product kernels declined: they were built without AVX512-VNNI")
        return y if padded == self.out_features else y[:, : self.out_features]


def _vnni_layout(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (N a multiple of 16) -> [N/16, K/4, 16, 4]: lane j's k-quad side by side."""
    rows, k = codes.shape
    return codes.view(rows // _TILE_N, _TILE_N, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_vnni_int4(groups: Int4Groups, lib: ctypes.CDLL, bias: torch.Tensor | None = None) -> VnniInt4:
    n, k = groups.codes.shape
    codes, scale, low, b = _padded_groups(groups, bias)
    return VnniInt4(_vnni_layout(codes), _tiles(scale), _tiles(low), b, n, k, lib)


def pack_vnni_int8(groups: Int8Groups, lib: ctypes.CDLL) -> VnniInt4:
    """Q8_0 groups for ts_q8a8_matmul: each code stored plus 128 (0 .. 255, what VPDPBUSD's unsigned
    operand holds), min -128 scale, so scale * stored + min is the group's exact weight."""
    n, k = groups.codes.shape
    if k % INT4_GROUP:
        raise UnsupportedModelError(f"int8 groups need the input dimension ({k}) to be a multiple of 32")
    pad = -n % _TILE_N
    stored = (groups.codes.to(torch.int16) + 128).to(torch.uint8)
    scale = groups.scale.float()
    stored, scale = F.pad(stored, (0, 0, 0, pad)), F.pad(scale, (0, 0, 0, pad))
    return VnniInt4(_vnni_layout(stored), _tiles(scale), _tiles(-128.0 * scale), None, n, k, lib, logits=True)


@dataclass
class AmxInt8:
    """Int8 groups laid out for ts_q8_matmul: per 16 outputs and group, 16 k-pairs x 16 x 2 codes."""

    packed: torch.Tensor  # int8 [N/16, K/32, 16, 16, 2]
    scale: torch.Tensor  # float32 [N/16, K/32, 16]
    out_features: int
    in_features: int
    lib: ctypes.CDLL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 contiguous @ w.T -> [M, N] float32 (a view when N was padded)."""
        m, padded = x.shape[0], self.scale.shape[0] * _TILE_N
        y = torch.empty(m, padded, dtype=torch.float32)
        self.lib.ts_q8_matmul(ptr(x), m, self.in_features, ptr(self.packed), ptr(self.scale), padded, ptr(y))
        return y if padded == self.out_features else y[:, : self.out_features]


def pack_amx_int8(groups: Int8Groups, lib: ctypes.CDLL) -> AmxInt8:
    n, k = groups.codes.shape
    if k % INT4_GROUP:
        raise UnsupportedModelError(f"int8 groups need the input dimension ({k}) to be a multiple of 32")
    pad = -n % _TILE_N
    codes, scale = F.pad(groups.codes, (0, 0, 0, pad)), F.pad(groups.scale.float(), (0, 0, 0, pad))
    tiles = codes.view(-1, _TILE_N, k // INT4_GROUP, INT4_GROUP // 2, 2)
    packed = tiles.permute(0, 2, 3, 1, 4).contiguous()  # [tiles, groups, pairs, 16 outputs, 2]
    return AmxInt8(packed, _tiles(scale), n, k, lib)


def _tiles(per_group: torch.Tensor) -> torch.Tensor:
    """[N, K/32] -> [N/16, K/32, 16]: a tile's 16 outputs side by side for each group."""
    n, groups = per_group.shape
    return per_group.reshape(n // _TILE_N, _TILE_N, groups).transpose(1, 2).contiguous().float()
