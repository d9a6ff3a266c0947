"""Attention over the paged KV cache, behind a small backend interface.

The portable backend is plain torch (CPU and CUDA): decodes batched over gathered blocks, prefill
chunks one sequence at a time on top of their cached prefix. Backends never allocate KV memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens in the flattened batch, after its cached context."""

    q_start: int
    q_len: int
    ctx_len: int  # cached + new tokens
    ctx_slots: torch.Tensor | None  # flat cache slots of all ctx_len tokens; None when nothing was cached
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend; None when causal from zero


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to; shared by every layer of a step.

    The flattened batch holds `num_decodes` single-token decodes first, then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [D, max_blocks]
    decode_context_lens: torch.Tensor  # [D]
    decode_key_mask: torch.Tensor  # [D, 1, 1, L] bool, True where a key position is valid
    decode_slots: torch.Tensor  # [D, L] flat cache slot of each context position (padded)
    prefills: list[PrefillSpan]
    block_size: int
    # The same batch in the generic varlen form (for kernels that want it).
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S] context length of each sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks]


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the cache, then attends; returns [T, heads, head_dim]."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks * block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Portable backend: torch ops only, exact in fp32."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        slots = meta.decode_slots  # [D, L]: every context slot of every decode, padded
        # One gather per K and V for the whole batch: [D, kv_heads, L, dim]. Few, large ops keep CPU
        # steps short (each op is a parallel region) and map to one fused kernel on GPU.
        keys = k_cache.index_select(0, slots.flatten()).view(num_seqs, -1, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, slots.flatten()).view(num_seqs, -1, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_key_mask, scale=scale, enable_gqa=True
        )
        return out.view(num_seqs, heads, dim)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: PrefillSpan,
        scale: float,
    ) -> torch.Tensor:
        heads, kv_heads = q.shape[1], k.shape[1]
        if span.ctx_slots is not None:
            k = k_cache.index_select(0, span.ctx_slots)
            v = v_cache.index_select(0, span.ctx_slots)
        group = heads // kv_heads
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
        if span.mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=span.mask, scale=scale)
        return o.squeeze(0).transpose(0, 1)
