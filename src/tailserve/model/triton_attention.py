"""Paged attention for CUDA in Triton: split-K decode and varlen prefill over a cached prefix.

Same contract as the portable TorchPagedAttention (write the step's K/V, then attend). It never
allocates KV memory and never reads a device value on the host, so a decode step can be captured
in a CUDA graph. Runs on CPU tensors only under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

from tailserve.model.attention import AttentionMetadata

_MAX_SPLITS = 64


@triton.jit  # type: ignore[misc,unused-ignore]
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_ct,
    ROW: tl.constexpr,  # kv_heads * head_dim, contiguous in k, v and the cache
    BLOCK: tl.constexpr,
):
    """One program per new token: copy its K and V rows into their slot; slot < 0 is padding, skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_ct + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_ct + offs, v, mask=mask)


@triton.jit  # type: ignore[misc,unused-ignore]
def _kv_tile(table, pos, end, kvh, offs_d, d_mask, stride_ct, stride_ch, PAGE: tl.constexpr):
    """Context positions `pos` -> their K/V offsets in the paged cache (through the block table), the
    mask of those before `end` over the head dim, and that mask over positions alone."""
    n_mask = pos < end
    block = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    slot = block * PAGE + pos % PAGE
    kv_offs = slot[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
    return kv_offs, n_mask[:, None] & d_mask[None, :], n_mask


@triton.jit  # type: ignore[misc,unused-ignore]
def _softmax_step(s, v_ptrs, kv_mask, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One tile of online softmax: rescale the running sum and output to the new row max, then add
    this tile's scores `s` times its V. Returns the new (row max, sum, output)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["split_len", "num_splits"])  # type: ignore[misc,unused-ignore]
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    split_len,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    DIRECT: tl.constexpr,  # one split: write the output itself
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): all GROUP query heads of one KV head over one slice of the context.

    With one split it writes the normalized output; otherwise the slice's normalized partial output
    and its log-sum-exp, combined by _decode_reduce_kernel. Split counts are runtime values, so a
    changing batch compiles no new variant.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    if start >= seq_len:
        return  # empty slice: the reduction never reads it
    end = tl.minimum(start + split_len, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        kv_offs, kv_mask, n_mask = _kv_tile(table, pos, end, kvh, offs_d, d_mask, stride_ct, stride_ch, PAGE)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v_cache_ptr + kv_offs, kv_mask, m_i, l_i, acc, DOT_PRECISION)
    acc = acc / l_i[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [seqs, heads, num_splits, HEAD_DIM] and lse [seqs, heads, num_splits], contiguous
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log(l_i), mask=g_mask)


@triton.jit(do_not_specialize=["split_len", "num_splits"])  # type: ignore[misc,unused-ignore]
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_len,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,  # a power of two >= num_splits
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, head): combine the non-empty slices' partial outputs, weighted by their softmax mass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_valid = (seq_len + split_len - 1) // split_len
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_valid
    d_mask = offs_d < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))
    weight = tl.where(s_mask, weight, 0.0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


@triton.jit  # type: ignore[misc,unused-ignore]
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_qt,  # queries and outputs: rows by token, then head
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (query tile, seq, head): causal attention of new tokens over cached prefix + themselves.

    K/V of every position come from the cache (this step's were written first), found through the
    block table; query i of a chunk sits at absolute position prefix + i.
    """
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len
    kvh = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)  # causal: nothing past the tile's last query
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        kv_offs, kv_mask, n_mask = _kv_tile(table, pos, end, kvh, offs_d, d_mask, stride_ct, stride_ch, PAGE)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        # Position 0 is visible to every row, so each row's max is finite after the first tile.
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v_cache_ptr + kv_offs, kv_mask, m_i, l_i, acc, DOT_PRECISION)
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


class TritonPagedAttention:
    """CUDA backend: one Triton KV write, split-K decode (+ reduction), one varlen prefill launch.

    `target_programs` is how many decode programs keep the device busy (default: 2 per SM on CUDA);
    the context is split until (seqs x kv_heads x splits) reaches it, never into slices shorter
    than `min_split_tokens`. The split count depends only on shapes, so it is fixed under a CUDA graph.
    """

    name = "triton"

    def __init__(
        self,
        block_n: int = 64,
        block_m: int = 64,
        min_split_tokens: int = 256,
        max_splits: int = 32,
        target_programs: int | None = None,
    ) -> None:
        if block_n < 16 or block_n & (block_n - 1) or block_m < 16 or block_m & (block_m - 1):
            raise ValueError("block_n and block_m must be powers of two >= 16")
        self.block_n = block_n
        self.block_m = block_m
        self.min_split_tokens = max(min_split_tokens, 1)
        self.max_splits = max(1, min(max_splits, _MAX_SPLITS))
        self.target_programs = target_programs
        self._sm_count: dict[int, int] = {}

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
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            self.decode(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta, scale, out
            )
        if meta.prefills:
            self.prefill(q, k_cache, v_cache, meta, scale, out)
        return out

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Copy each new token's K/V into its slot of the cache; negative slots are skipped."""
        num_tokens, kv_heads, dim = k.shape
        if num_tokens == 0:
            return
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        if k_cache.stride(1) != dim or k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride():
            raise ValueError("the KV cache must be [slots, kv_heads, head_dim] with contiguous rows")
        row = kv_heads * dim
        _write_kv_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            k_cache.stride(0),
            ROW=row,
            BLOCK=triton.next_power_of_2(row),
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the first len(context_lens) rows of q (one new token each) over their blocks."""
        num_seqs = context_lens.shape[0]
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        group = heads // kv_heads
        max_ctx = block_tables.shape[1] * meta.block_size  # a shape, so fixed under a CUDA graph
        num_splits, split_len = self.plan_splits(num_seqs, kv_heads, max_ctx, q.device)
        block_d = triton.next_power_of_2(dim)
        if num_splits > 1:
            part_out = torch.empty((num_seqs, heads, num_splits, dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_seqs, heads, num_splits), dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused by the kernel when there is one split
        _decode_kernel[(num_seqs, kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            part_out,
            part_lse,
            scale,
            split_len,
            num_splits,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            DIRECT=num_splits == 1,
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=dim,
            BLOCK_D=block_d,
            PAGE=meta.block_size,
            BLOCK_N=self.block_n,
            DOT_PRECISION=_dot_precision(q.dtype),
        )
        if num_splits > 1:
            _decode_reduce_kernel[(num_seqs, heads)](
                part_out,
                part_lse,
                context_lens,
                out,
                split_len,
                num_splits,
                out.stride(0),
                out.stride(1),
                BLOCK_S=triton.next_power_of_2(self.max_splits),  # one compiled variant for every split count
                HEAD_DIM=dim,
                BLOCK_D=block_d,
            )

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """All prefill chunks (the sequences after the decodes) in one launch."""
        d = meta.num_decodes
        num_prefills = len(meta.prefills)
        max_q_len = max(span.q_len for span in meta.prefills)
        heads, dim = q.shape[1], q.shape[2]
        group = heads // k_cache.shape[1]
        block_tables = meta.block_tables[d:]
        grid = (triton.cdiv(max_q_len, self.block_m), num_prefills, heads)
        _prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            meta.query_start_loc[d:],
            meta.seq_lens[d:],
            scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            block_tables.stride(0),
            GROUP=group,
            HEAD_DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            PAGE=meta.block_size,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            DOT_PRECISION=_dot_precision(q.dtype),
        )

    def plan_splits(
        self, num_seqs: int, kv_heads: int, max_ctx: int, device: torch.device
    ) -> tuple[int, int]:
        """(number of context slices, tokens per slice): enough programs to fill the device, no tiny slices."""
        target = self.target_programs if self.target_programs is not None else 2 * self._sms(device)
        want = triton.cdiv(target, max(num_seqs * kv_heads, 1))
        splits = max(1, min(want, self.max_splits, triton.cdiv(max_ctx, self.min_split_tokens)))
        split_len = triton.cdiv(triton.cdiv(max_ctx, splits), self.block_n) * self.block_n
        return triton.cdiv(max_ctx, split_len), split_len

    def _sms(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 1
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sm_count:
            self._sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sm_count[index]


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, dim] with each token's heads x dim contiguous (a row stride may be anything)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must stay exact (parity tests); for bf16/fp16 the setting is moot.
    return "ieee" if dtype == torch.float32 else "tf32"
