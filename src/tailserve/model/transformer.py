"""The decoder-only transformer (Llama family, Qwen2) over a flattened batch of new tokens.

Weights are fused at build (q|k|v, gate|up) so a layer is four linears, each holding its weight in
the formats of `FormatPlan` (decode rows and prefill rows on their own kernels). The KV cache is
passed in, never owned; logits are computed only for the rows that will be sampled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.errors import UnsupportedModelError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.attention import AttentionBackend, AttentionMetadata
from tailserve.model.linear import Linear, WeightSource, fuse
from tailserve.weights.arch import ArchConfig
from tailserve.weights.formats import (
    AmxInt8,
    Int4Groups,
    Int8Groups,
    PackedInt4,
    PackedInt8,
    VnniInt4,
    int4_from_float,
    int8_from_float,
    int8_groups_from_float,
    pack_amx_int8,
    pack_int4,
    pack_int8,
    pack_vnni_int8,
)

if TYPE_CHECKING:
    from tailserve.model.sharding import ShardComm

HEAD_KERNELS = ("fp32", "bf16", "int8", "int4", "q8")


@dataclass(frozen=True)
class FormatPlan:
    """Which kernel each part of the model runs: layer linears per phase, and the LM head on its own."""

    # layer linears on decode rows: fp32, bf16, int4, int8, int4a8 (prompt rows' int8 dot products) or
    # int4a16 (the same codes, activations rounded to int16)
    decode: str
    # layer linears on prefill rows: fp32, bf16, fp32w (bf16 activations on a float32 weight copy,
    # for CPUs without bf16 arithmetic), int4 (AMX: groups widened to bf16) or int4a8 (the int4
    # groups times activations rounded to int8 per group of 32, on VNNI, for CPUs without bf16)
    prefill: str
    head: str  # the LM head, every sampled row: fp32, bf16, int8, q8 (int4 offered, hurts quality)
    # Opt-in, never a default: steps with at least this many decode rows run them on the prefill
    # kernel (bf16 beats int4 from ~16 rows). A request's tokens then depend on the batch it is in.
    dense_decode_from_rows: int | None = None

    @property
    def activation_dtype(self) -> torch.dtype:
        """What flows between layers and reaches attention (q, k, v): fp32 only in the fp32 plan."""
        return torch.float32 if self.prefill == "fp32" else torch.bfloat16


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 / linear scaling applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        w: Mapping[str, torch.Tensor],
        prefix: str,
        plan: FormatPlan,
        int4: Mapping[str, Int4Groups],
    ) -> None:
        super().__init__()
        self.arch = arch
        # Norm weights stay float32: the residual stream and its norms run in float32 whatever the
        # format (cheaper on CPU than bf16 norms, and no rounding piles up across layers).
        self.input_norm = nn.Parameter(w[prefix + "input_layernorm.weight"].float(), requires_grad=False)
        self.post_norm = nn.Parameter(
            w[prefix + "post_attention_layernorm.weight"].float(), requires_grad=False
        )
        self.activation_dtype = plan.activation_dtype
        self.eps = arch.rms_norm_eps

        def src(name: str) -> WeightSource:
            return WeightSource(w[prefix + name], int4.get(prefix + name))

        def linear(names: list[str], bias: list[str] | None = None) -> Linear:
            b = torch.cat([w[prefix + n] for n in bias]) if bias else None
            return Linear(
                fuse([src(n) for n in names]), b, plan.decode, plan.prefill, plan.dense_decode_from_rows
            )

        a, m = "self_attn.", "mlp."
        qkv = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        qkv_bias = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"] if arch.qkv_bias else None
        self.qkv = linear(qkv, qkv_bias)
        self.o = linear([a + "o_proj.weight"])
        self.gate_up = linear([m + "gate_proj.weight", m + "up_proj.weight"])
        self.down = linear([m + "down_proj.weight"])
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.qk_heads = arch.num_heads + arch.num_kv_heads
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.intermediate = arch.intermediate_size
        self.scale = arch.head_dim**-0.5
        self.tp: ShardComm | None = None  # set by TransformerLM.shard_over: o and down all-reduce

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        d, dim = meta.num_decodes, self.arch.head_dim
        qkv = self.qkv(self._norm(h, self.input_norm), d)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotate together: one rotation over [T, heads + kv_heads, head_dim].
        rotated = _rotate(qk.view(-1, self.qk_heads, dim), *rope)
        q, k = torch.split(rotated, [self.num_heads, self.num_kv_heads], 1)
        attn = backend.forward(q, k, v.view(-1, self.num_kv_heads, dim), k_cache, v_cache, meta, self.scale)
        h = h + self.reduce(self.o(attn.reshape(-1, self.q_size), d))
        gate, up = self.gate_up(self._norm(h, self.post_norm), d).chunk(2, dim=-1)
        out: torch.Tensor = h + self.reduce(self.down(F.silu(gate) * up, d))
        return out

    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's output summed over ranks (float32); as is without TP."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the float32 residual stream, handed to the linears in the activation dtype."""
        x = F.rms_norm(h, (h.shape[-1],), weight, self.eps)
        return x if x.dtype == self.activation_dtype else x.to(self.activation_dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (Hugging Face layout) in three ops.

    rotate_half(x) = (-x2, x1) equals the halves swapped times a sign, and the sign lives in
    `sin_signed` = (-sin, sin) (precomputed once per step), so x * cos + swap(x) * sin_signed.
    cos / sin_signed: [T, 1, head_dim].
    """
    t, n, dim = x.shape
    swapped = x.view(t, n, 2, dim // 2).flip(2).view(t, n, dim)
    return torch.addcmul(x * cos, swapped, sin_signed)


class LMHead(nn.Module):
    """The output projection on its own kernel (fp32, bf16, int8, int4 or q8); returns float32 logits.

    The 16-bit and int kernels round their output to bf16: at logits around 25 that is a step of
    0.125, enough to tie or swap the two best tokens. So the `REFINE_TOP` best of every row are
    re-scored in float32 from the bf16 weight rows (`refine_with`), a few thousand multiply-adds.
    `q8` (int8 codes, a float32 scale per 32 inputs: GGUF Q8_0 exactly) runs on the fused CPU
    kernels' tile matmul (AMX or AVX512-BF16), which sums and returns float32: nothing to re-score.
    Where the CPU has neither but has AVX512-VNNI, on int8 dot products with the activations rounded
    to int8 per group of 32 (ts_q8a8_matmul, float32 out), re-scored as the bf16 head is.
    """

    REFINE_TOP = 16

    def __init__(
        self,
        weight: torch.Tensor,
        kernel: str,
        int4: Int4Groups | None = None,
        refine_with: torch.Tensor | None = None,
        int8_groups: Int8Groups | None = None,
    ) -> None:
        super().__init__()
        if kernel not in HEAD_KERNELS:
            raise ValueError(f"LM head kernel must be one of {HEAD_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.weight: nn.Parameter | None = None
        self.packed: PackedInt4 | PackedInt8 | None = None
        self.q8: AmxInt8 | VnniInt4 | None = None
        if kernel == "q8":
            lib = cpu_kernels.tile_matmuls()
            vnni = cpu_kernels.int8_dots() if lib is None else None
            groups = int8_groups if int8_groups is not None else int8_groups_from_float(weight)
            if lib is None and vnni is None:
                raise ValueError(
                    "the q8 LM head needs the fused CPU kernels with AMX, AVX512-BF16, AVX512-VNNI or AVX2"
                )
            # With VNNI or AVX2 alone: the activations rounded to int8 per group of 32 too (int8 dot products),
            # so the best REFINE_TOP are re-scored as the bf16 head's are.
            if lib is not None:
                self.q8, refine_with = pack_amx_int8(groups, lib), None
            else:
                assert vnni is not None
                self.q8 = pack_vnni_int8(groups, vnni)
        elif kernel in ("fp32", "bf16"):
            dtype = torch.float32 if kernel == "fp32" else torch.bfloat16
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        elif kernel == "int8":
            self.packed = pack_int8(int8_from_float(weight))
        else:
            self.packed = pack_int4(int4 if int4 is not None else int4_from_float(weight))
        if kernel == "bf16" and refine_with is None:
            refine_with = self.weight
        self.refine_with = None if kernel == "fp32" else refine_with

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None:
            logits = self.q8.matmul(h.to(torch.bfloat16).contiguous())
        elif self.weight is not None:
            logits = F.linear(h.to(self.weight.dtype), self.weight).float()
        else:
            assert self.packed is not None
            logits = self.packed.matmul(h.to(torch.bfloat16).contiguous()).float()
        if self.refine_with is None or logits.shape[-1] <= self.REFINE_TOP:
            return logits
        top = logits.topk(self.REFINE_TOP, dim=-1).indices  # [R, k]
        rows = self.refine_with[top].float()  # [R, k, hidden]
        # A product and a sum over hidden, not bmm: bmm picks its kernel by the batch (one row vs
        # several), so a row's score would depend on who shares the step (seen on Zen 4).
        exact = (rows * h.float().unsqueeze(1)).sum(-1)
        return logits.scatter_(1, top, exact)


class FusedForward(Protocol):
    """`TransformerLM.forward`'s arguments less the backend, on another implementation."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


class TransformerLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, built from Hugging Face-named weights.

    `plan` None keeps the weights' own dtype everywhere (fp32 weights: the exact reference path).
    `int4` holds exact int4 groups by HF name (from the file's Q4 blocks); others are re-quantized.
    `head_weight` overrides the LM head's source (e.g. float32 decoded straight from Q8_0 blocks);
    `head_int8` gives a q8 head the file's own Q8_0 groups.
    """

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(
        self,
        arch: ArchConfig,
        weights: Mapping[str, torch.Tensor],
        max_positions: int,
        plan: FormatPlan | None = None,
        int4: Mapping[str, Int4Groups] | None = None,
        head_weight: torch.Tensor | None = None,
        head_int8: Int8Groups | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        embed = weights["model.embed_tokens.weight"]
        if plan is None:
            kind = "fp32" if embed.dtype == torch.float32 else "bf16"
            plan = FormatPlan(decode=kind, prefill=kind, head=kind)
        self.plan = plan
        dtype = plan.activation_dtype
        groups = int4 or {}
        self.embed = nn.Parameter(embed.to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, weights, f"model.layers.{i}.", plan, groups) for i in range(arch.num_layers)
        )
        self.norm = nn.Parameter(weights["model.norm.weight"].float(), requires_grad=False)
        self.eps = arch.rms_norm_eps
        tied = arch.tie_word_embeddings or "lm_head.weight" not in weights
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        source = head_weight if head_weight is not None else weights[head_name]
        if tied and head_weight is None and plan.head in ("fp32", "bf16") and _dtype(plan.head) == dtype:
            self.lm_head = LMHead(self.embed, plan.head)  # same dtype: shares the embedding's storage
        else:
            refine = self.embed if tied and dtype == torch.bfloat16 else None
            self.lm_head = LMHead(source, plan.head, groups.get(head_name), refine, head_int8)
        inv_freq = rope_inv_freq(arch)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        half_sin = freqs.sin()
        self.register_buffer("cos_table", torch.cat((freqs.cos(), freqs.cos()), -1).float().to(dtype), False)
        # (-sin, sin): the sign of rotate_half folded in, so a rotation is three ops (see _rotate).
        self.register_buffer("sin_table", torch.cat((-half_sin, half_sin), -1).float().to(dtype), False)
        # Set by model.cpu_fused.attach: the same forward through the fused CPU kernels.
        self.fused: FusedForward | None = None
        self.tp: ShardComm | None = None

    def shard_over(self, tp: ShardComm) -> None:
        """This model is one rank's shard: all-reduce after o and down, vocab-parallel embed and head."""
        self.tp = tp
        for layer in self.layers:
            cast(DecoderLayer, layer).tp = tp

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The float32 residual stream's first rows (summed over the vocabulary shards under TP)."""
        if self.tp is not None:
            return self.tp.embed(input_ids, self.embed)
        h = F.embedding(input_ids, self.embed)
        return h if h.dtype == torch.float32 else h.float()

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the normed rows; under TP rank 0 gathers every vocabulary shard."""
        logits: torch.Tensor = self.lm_head(h)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def prompt_linears(self) -> list[Linear]:
        """Every decoder layer's linears (what prompt rows run through)."""
        return [linear for layer in self.layers for linear in cast(DecoderLayer, layer).linears()]

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of hidden states and of the q / k / v handed to attention."""
        return self.plan.activation_dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        if self.embed.device.type == "cpu":
            cpu_kernels.sync_threads()  # the kernels split their matmuls over torch's thread count
        if self.fused is not None and backend.name == "torch":
            return self.fused(input_ids, positions, kv_caches, meta, logits_indices)
        h = self.embed_tokens(input_ids)  # the residual stream is float32
        rope = (self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1))
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = layer(h, rope, k_cache, v_cache, meta, backend)
        h = F.rms_norm(h.index_select(0, logits_indices), (h.shape[-1],), self.norm, self.eps)
        return self.head_logits(h)


def _dtype(kernel: str) -> torch.dtype:
    return torch.float32 if kernel == "fp32" else torch.bfloat16
