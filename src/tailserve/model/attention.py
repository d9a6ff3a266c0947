"""Attention over the paged KV cache, behind a small backend interface.

The portable backend is plain torch (CPU and CUDA). Context is gathered a whole block at a time;
grouped-query heads are never repeated; no `[query, context]` mask is built for a prompt chunk: a
chunk attends to its cached prefix (no mask) and to itself (causal) separately, and the two halves
are merged exactly by their log-sum-exp. Backends never allocate KV memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens in the flattened batch, after `start_pos` cached tokens."""

    q_start: int
    q_len: int
    start_pos: int  # tokens already in the cache before this chunk (0: the chunk starts the sequence)
    block_table: torch.Tensor | None  # [blocks] of the cached prefix; None when start_pos == 0


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to; shared by every layer of a step.

    The flattened batch holds `num_decodes` single-token decodes first, then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] (padded with any valid block id)
    decode_context_lens: torch.Tensor  # [D]
    decode_key_mask: (
        torch.Tensor | None
    )  # [D, 1, 1, max_blocks * block_size] bool; None: lengths need no mask
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


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache rows of the given blocks, in table order: [..., blocks * block_size, kv_heads, dim].

    One copy of whole blocks (contiguous runs of block_size rows), not a gather of single rows."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    picked = blocks.index_select(0, block_table.flatten())
    return picked.view(*block_table.shape[:-1], -1, *cache.shape[1:])


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
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        d = meta.num_decodes
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self.prefill_span(
                q[rows], k[rows], v[rows], k_cache, v_cache, span, meta.block_size, scale
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_seqs, heads, dim = q.shape
        bs = meta.block_size
        # [D, L, kv_heads, dim] -> [D, kv_heads, L, dim]; one gather per K and V for the whole batch.
        keys = gather_blocks(k_cache, meta.decode_block_tables, bs).transpose(1, 2)
        values = gather_blocks(v_cache, meta.decode_block_tables, bs).transpose(1, 2)
        mask = meta.decode_key_mask
        if mask is None:  # every sequence has the same length: cut the padding of the last block instead
            length = int(meta.decode_context_lens[0])
            keys, values = keys[:, :, :length], values[:, :, :length]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.view(num_seqs, heads, dim)

    @staticmethod
    def prefill_span(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: PrefillSpan,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, dim]
        vh = v.transpose(0, 1).unsqueeze(0)
        if span.block_table is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            return o.squeeze(0).transpose(0, 1)
        # The chunk over its cached prefix: every prefix key is visible to every query (no mask), and
        # the chunk's own keys are causal (a square mask-free kernel call). Merge by log-sum-exp.
        prefix = span.start_pos
        pk = gather_blocks(k_cache, span.block_table, block_size)[:prefix].transpose(0, 1).unsqueeze(0)
        pv = gather_blocks(v_cache, span.block_table, block_size)[:prefix].transpose(0, 1).unsqueeze(0)
        o_prefix, lse_prefix = _attention_with_lse(qh, pk.to(q.dtype), pv.to(q.dtype), False, scale)
        o_self, lse_self = _attention_with_lse(qh, kh, vh, True, scale)
        top = torch.maximum(lse_prefix, lse_self)
        w_prefix = (lse_prefix - top).exp().unsqueeze(-1)
        w_self = (lse_self - top).exp().unsqueeze(-1)
        o = (o_prefix.float() * w_prefix + o_self.float() * w_self) / (w_prefix + w_self)
        return o.to(q.dtype).squeeze(0).transpose(0, 1)


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its per-query log-sum-exp ([1, heads, n]), grouped-query heads shared.

    On CPU the fused flash kernel returns both; elsewhere the scores are formed explicitly (CUDA
    runs the Triton backend in practice, so this is the correctness path, not the fast one)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse
    group = q.shape[1] // k.shape[1]
    kf = k.repeat_interleave(group, dim=1).float()
    vf = v.repeat_interleave(group, dim=1).float()
    scores = q.float() @ kf.transpose(-1, -2) * scale
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    lse = torch.logsumexp(scores, dim=-1)
    return (scores - lse.unsqueeze(-1)).exp() @ vf, lse
