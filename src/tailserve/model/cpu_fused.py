"""The CPU forward pass over the fused kernels of cpu_kernels.c: per layer, four matmuls and five calls.

A decode step of the 30-layer default model ran ~80 torch ops per layer, ~14 ms a step of op
overhead against ~11 ms of int4 matmuls. Here each layer is: norm (fused into the previous residual
add), qkv matmul, RoPE + KV write in place, paged decode attention read straight from the cache, o
matmul, residual add + norm, gate|up matmul, SiLU x up, down matmul, residual add + the next
layer's norm. Prompt rows take the same kernels but attention: once RoPE has written a chunk's K/V
into the cache, the chunk's rows attend over it causally (a row at position p sees the first p + 1),
flash-attention style (ts_paged_prompt_attention: on AMX tiles where the CPU has them, else on
float32 FMAs where it has AVX-512) when the chunk has PROMPT_KERNEL_MIN_ROWS rows (AMX; any chunk
on the FMA kernel), else as one decode query each with that length (exact softmax either way). Same weights and formats as the
torch path; every kernel is row-wise, so a row's result does not depend on its batch, nor on its
chunk while chunks keep to one attention kernel. A step of
prompt rows only (no decodes) calls the same kernels from one loop with raw pointers, and a step of
decode rows only runs them all from one C call (ts_decode_layers): bit for bit the same.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from tailserve.kernels import cpu as cpu_kernels
from tailserve.kernels.cpu import ptr
from tailserve.model.attention import AttentionMetadata
from tailserve.model.transformer import DecoderLayer, TransformerLM

MAX_GROUP = 64  # query heads per kv head the attention kernel keeps per-head sums for
# Prompt chunks of fewer rows stay on the decode kernel: the prompt kernel transposes the chunk's
# whole context's V once per call, which a few rows do not pay back (measured on 2 threads of a
# Sapphire Rapids: 1 row over 1,345 positions 0.04 ms against 0.10, 8 rows even, 16 rows 1.7x faster).
PROMPT_KERNEL_MIN_ROWS = 8
# The float32 FMA prompt kernel (AVX-512 without AMX) takes every prompt chunk instead: its rows'
# bits do not depend on the chunk, so with row-invariant prompt matmuls (int4a8) a prompt over a
# cached prefix gives the bits of the whole prompt. On the decode kernel a 5-row chunk after 32
# cached positions moved the README question's first-token logits by up to 1.3 against the whole
# prompt, and its greedy answer from "The capital of France is Paris." to French nonsense (its two
# best tokens lie 0.06-0.11 apart). The widening it pays per call: 0.21 against 0.04 ms for 1 row
# over 1,344 positions, one layer, 2 threads.
FMA_PROMPT_KERNEL_MIN_ROWS = 1
# Bumped when what this forward computes changes (so the quality gate re-measures): 2 = prompt
# attention on the decode kernel, prompt matmuls on weights prepacked for oneDNN; 3 = prompt
# attention on the AMX flash kernel (ts_paged_prompt_attention) where it runs; 4 = SiLU x up on
# AVX-512 (e^x by polynomial, not expf: a rare last-bit difference after bf16 rounding); 5 = prompt
# attention on the float32 FMA flash kernel where AVX-512 runs without AMX (was the decode kernel);
# 6 = decode rows and the q8 head on int8 dot products where the CPU has VNNI but no bf16 arithmetic;
# 7 = the FMA prompt attention's scores on int8 dot products where the build has VNNI.
FORWARD_REVISION = 7


def attach(model: TransformerLM, kv_dtype: torch.dtype) -> bool:
    """Run `model`'s forward through the fused CPU kernels from now on, if they build and fit it;
    its bf16 linears also keep their weights prepacked for oneDNN's prompt rows."""
    lib = cpu_kernels.load() if supports(model, kv_dtype) else None
    model.fused = None if lib is None else FusedCpuForward(model, lib)
    if model.fused is not None:
        cpu_kernels.tile_isa()  # asks the OS for AMX tile data, which both attention kernels use where granted
        for linear in model.prompt_linears():
            linear.pack_for_cpu()
    return model.fused is not None


def supports(model: TransformerLM, kv_dtype: torch.dtype) -> bool:
    """Whether the fused path can run this model: bf16 activations and KV cache, on CPU."""
    arch = model.arch
    return (
        model.embed.device.type == "cpu"
        and model.activation_dtype == torch.bfloat16
        and kv_dtype == torch.bfloat16
        and arch.head_dim % 2 == 0
        and arch.num_heads % arch.num_kv_heads == 0
        and arch.num_heads // arch.num_kv_heads <= MAX_GROUP
    )


class FusedCpuForward:
    """`TransformerLM.forward` for CPU through the fused kernels (see the module docstring)."""

    def __init__(self, model: TransformerLM, lib: ctypes.CDLL) -> None:
        self.model = model
        self.layers = cast(list[DecoderLayer], list(model.layers))
        self.lib = lib
        arch = model.arch
        half = arch.head_dim // 2
        # float32 half tables: RoPE is computed in float32 from the bf16 q/k and rounded once.
        cos = model.cos_table.float()[:, :half].contiguous()
        sin = model.sin_table.float()[:, half:].contiguous()  # sin_table is (-sin, sin)
        self.cos_half, self.sin_half = cos, sin
        self.hidden = arch.hidden_size
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.qkv_width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
        self.inter = arch.intermediate_size
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim**-0.5
        self._plans: list[_LayerPlan | None] | None = None
        self._decode_steps: list[_LayerPlan | None] | None = None
        self._dense_decode_from: int | None = None
        self._decode_key: tuple[int, ...] | None = None
        self._decode_args: ctypes.Array[cpu_kernels.DecodeLayer] | None = None
        # Rows a prompt chunk needs for the prompt attention kernel (fewer: a decode query each).
        amx = cpu_kernels.amx() is not None
        self.prompt_min_rows = PROMPT_KERNEL_MIN_ROWS if amx else FMA_PROMPT_KERNEL_MIN_ROWS
        # ts_decode_layers' matmul: 1 / 2 where every decode row runs int8 dot products (int4a8 /
        # int4a16), 0 (the int4 tile kernel) otherwise
        kernels = {linear.decode_kernel for layer in self.layers for linear in layer.linears()}
        self.decode_vnni = {frozenset({"int4a8"}): 1, frozenset({"int4a16"}): 2}.get(frozenset(kernels), 0)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        lib, model = self.lib, self.model
        layers = self.layers
        t, dim, eps = input_ids.shape[0], self.hidden, self.eps
        heads, kv_heads, hd = self.heads, self.kv_heads, self.head_dim
        d = meta.num_decodes
        h = model.embed_tokens(input_ids).contiguous()  # the float32 residual stream, updated in place
        x = torch.empty(t, dim, dtype=torch.bfloat16)
        lib.ts_rms_norm(ptr(h), ptr(layers[0].input_norm), ptr(x), t, dim, eps)
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        tables, lens = meta.decode_block_tables, meta.decode_context_lens.contiguous()
        if d and tables.stride(1) != 1:
            tables = tables.contiguous()
        cos_p, sin_p, pos_p, slot_p = ptr(self.cos_half), ptr(self.sin_half), ptr(positions), ptr(slots)
        h_p, x_p = ptr(h), ptr(x)
        prompts = self._prompt_queries(meta)
        q_size = self.q_size
        plans = self._prompt_plans() if self.model.tp is None else None
        if plans is not None and (d == 0 or (plans[0].int4a8 and self.decode_vnni and d < t)):
            # prompt rows only, or (int8 dot products for both kinds of rows) decodes beside them
            self._prompt_layers(
                plans,
                x,
                h,
                kv_caches,
                prompts,
                (cos_p, sin_p, pos_p, slot_p),
                meta.block_size,
                (d, tables, lens),
            )
            out = F.rms_norm(h.index_select(0, logits_indices), (dim,), model.norm, eps)
            return model.head_logits(out)
        steps = self._decode_plans(d) if d == t and self.model.tp is None else None
        if steps is not None:
            self._decode_layers(
                steps, x, h, kv_caches, (tables, lens), (cos_p, sin_p, pos_p, slot_p), meta.block_size
            )
            out = F.rms_norm(h.index_select(0, logits_indices), (dim,), model.norm, eps)
            return model.head_logits(out)
        for i, layer in enumerate(layers):
            k_cache, v_cache = kv_caches[i]
            qkv = layer.qkv(x, d).contiguous()
            lib.ts_rope_write_kv(
                ptr(qkv), pos_p, cos_p, sin_p, slot_p, ptr(k_cache), ptr(v_cache), t, heads, kv_heads, hd
            )
            attn = torch.empty(t, heads, hd, dtype=torch.bfloat16)
            if d:
                lib.ts_paged_decode_attention(
                    ptr(qkv), self.qkv_width, ptr(k_cache), ptr(v_cache), ptr(tables), tables.stride(0),
                    ptr(lens), ptr(attn), d, heads, kv_heads, hd, meta.block_size, self.scale,
                )  # fmt: skip
            for q_start, rows, start_pos, prompt_table, prompt_lens in prompts:
                if rows >= self.prompt_min_rows and lib.ts_paged_prompt_attention(
                    ptr(qkv[q_start:]), self.qkv_width, ptr(k_cache), ptr(v_cache), ptr(prompt_table), rows,
                    start_pos, ptr(attn[q_start:]), heads, kv_heads, hd, meta.block_size, self.scale,
                ):  # fmt: skip
                    continue  # a prompt kernel ran it; else (no AVX-512, or a shape it declines) decode queries
                lib.ts_paged_decode_attention(
                    ptr(qkv[q_start:]), self.qkv_width, ptr(k_cache), ptr(v_cache), ptr(prompt_table), 0,
                    ptr(prompt_lens), ptr(attn[q_start:]), rows, heads, kv_heads, hd, meta.block_size, self.scale,
                )  # fmt: skip
            o = self._reduce(layer.o(attn.view(t, q_size), d))
            lib.ts_add_rms_norm(h_p, ptr(o), o.stride(0), ptr(layer.post_norm), x_p, t, dim, eps)
            act = self._silu_gate_up(layer, x, d)
            down = self._reduce(layer.down(act, d))
            nxt = ptr(layers[i + 1].input_norm) if i + 1 < len(layers) else None
            lib.ts_add_rms_norm(h_p, ptr(down), down.stride(0), nxt, x_p, t, dim, eps)
        out = F.rms_norm(h.index_select(0, logits_indices), (dim,), model.norm, eps)
        return model.head_logits(out)

    def _prompt_plans(self) -> list[_LayerPlan] | None:
        """Per layer, the raw arguments of its four int4 prompt-row matmuls and norms (see
        `_prompt_layers`), or None where a layer's linears do not all run the AMX int4 prompt kernel
        unpadded (the module path then runs). Made once: the weights never move after load."""
        if self._plans is None:
            self._plans = [_layer_plan(layer) for layer in self.layers]
        if any(plan is None for plan in self._plans):
            return None
        return cast(list[_LayerPlan], self._plans)

    def _prompt_layers(
        self,
        plans: list[_LayerPlan],
        x: torch.Tensor,
        h: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        prompts: list[tuple[int, int, int, torch.Tensor, torch.Tensor]],
        rope: tuple[int, int, int, int],
        block: int,
        decodes: tuple[int, torch.Tensor, torch.Tensor],
    ) -> None:
        """Every layer of a step of prompt rows (and, over int4a8, the `decodes` rows before them:
        their count, block tables and context lengths), the kernels called straight from one loop on
        buffers made once a step: the calls, arguments and so the bits of the module path, with
        little Python between them. Through the modules, the time from one kernel's threads ending
        to the next's starting was 14-50 us (~6.5 ms of a 512-token step on 2 threads of a Sapphire
        Rapids, one core idle all along), though the same Python with the kernels stubbed out takes
        ~0.6 ms a step: run right after a kernel that streamed its weights through the caches, it
        runs cold. Here 4-7 us (~1.3 ms a step); the step 81.5 -> 73.3 ms (see docs/ENGINE.md)."""
        lib = self.lib
        t, dim, eps = x.shape[0], self.hidden, self.eps
        heads, kv_heads, hd, width = self.heads, self.kv_heads, self.head_dim, self.qkv_width
        qkv = torch.empty(t, width, dtype=torch.bfloat16)
        attn = torch.empty(t, heads * hd, dtype=torch.bfloat16)
        o = torch.empty(t, dim, dtype=torch.bfloat16)
        act = torch.empty(t, self.inter, dtype=torch.bfloat16)
        x_p, h_p, qkv_p, attn_p, o_p, act_p = ptr(x), ptr(h), ptr(qkv), ptr(attn), ptr(o), ptr(act)
        cos_p, sin_p, pos_p, slot_p = rope
        row = 2 * width  # bytes of a qkv row
        spans = [
            (qkv_p + q_start * row, rows, start_pos, ptr(table), ptr(lens), attn_p + q_start * 2 * heads * hd)
            for q_start, rows, start_pos, table, lens in prompts
        ]
        silu, add_norm = lib.ts_q4_prefill_silu_matmul, lib.ts_add_rms_norm
        prefill: Callable[..., object] = lib.ts_q4_prefill_matmul
        int4a8 = plans[
            0
        ].int4a8  # int8 dot products: gate|up written, then SiLU x up (the module path's calls)
        d, tables, lens = decodes
        if int4a8:
            prefill = lib.ts_q4a8_prefill_matmul
            if d and self.decode_vnni == 2:  # decode rows on int16 activations, the rest on int8
                prefill = _split_rows(d, lib.ts_q4a16_matmul, lib.ts_q4a8_prefill_matmul)
        gu = torch.empty(t, 2 * self.inter, dtype=torch.bfloat16) if int4a8 else None  # held to the end
        gu_p = None if gu is None else ptr(gu)
        scale = self.scale
        dec_tables_p, dec_lens_p, table_width = ptr(tables), ptr(lens), tables.stride(0) if d else 0
        for i, plan in enumerate(plans):
            k_p, v_p = ptr(kv_caches[i][0]), ptr(kv_caches[i][1])
            prefill(x_p, t, dim, *plan.qkv, width, qkv_p)
            lib.ts_rope_write_kv(qkv_p, pos_p, cos_p, sin_p, slot_p, k_p, v_p, t, heads, kv_heads, hd)
            if d:
                lib.ts_paged_decode_attention(
                    qkv_p,
                    width,
                    k_p,
                    v_p,
                    dec_tables_p,
                    table_width,
                    dec_lens_p,
                    attn_p,
                    d,
                    heads,
                    kv_heads,
                    hd,
                    block,
                    scale,
                )
            for q_p, rows, start_pos, table_p, lens_p, out_p in spans:
                if rows >= self.prompt_min_rows and lib.ts_paged_prompt_attention(
                    q_p, width, k_p, v_p, table_p, rows, start_pos, out_p, heads, kv_heads, hd, block, scale
                ):
                    continue
                lib.ts_paged_decode_attention(
                    q_p, width, k_p, v_p, table_p, 0, lens_p, out_p, rows, heads, kv_heads, hd, block, scale
                )
            prefill(attn_p, t, heads * hd, *plan.o, dim, o_p)
            add_norm(h_p, o_p, dim, plan.post_norm, x_p, t, dim, eps)
            if gu_p is not None:
                prefill(x_p, t, dim, *plan.gate_up, 2 * self.inter, gu_p)
                lib.ts_silu_mul(gu_p, act_p, t, self.inter)
            else:
                silu(x_p, t, dim, *plan.gate_up, self.inter, act_p)
            prefill(act_p, t, self.inter, *plan.down, dim, o_p)
            add_norm(h_p, o_p, dim, plans[i + 1].input_norm if i + 1 < len(plans) else None, x_p, t, dim, eps)

    def _decode_plans(self, rows: int) -> list[_LayerPlan] | None:
        """Per layer, the raw arguments of its four int4 decode matmuls (ts_q4_matmul) and norms, or
        None where a layer's linears would not all run `rows` decode rows on that kernel unpadded (the
        module path then runs). Made once: the weights never move after load."""
        if self._decode_steps is None:
            self._decode_steps = [_decode_plan(layer) for layer in self.layers]
            dense = [
                linear.dense_decode_from_rows
                for layer in self.layers
                for linear in layer.linears()
                if linear.dense_decode_from_rows is not None
            ]
            self._dense_decode_from = min(dense, default=None)
        if any(plan is None for plan in self._decode_steps):
            return None
        if self._dense_decode_from is not None and rows >= self._dense_decode_from:
            return None  # this many decode rows run on the dense copy (Linear.prompt_rows_from)
        return cast(list[_LayerPlan], self._decode_steps)

    def _decode_layers(
        self,
        plans: list[_LayerPlan],
        x: torch.Tensor,
        h: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        context: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[int, int, int, int],
        block: int,
    ) -> None:
        """Every layer of a step of decode rows only in one call (ts_decode_layers), on buffers made
        once a step: the module path's kernels, arguments and so bits, with no Python between them
        (through the modules a decode step of one stream spent about half its time between kernels,
        the other core spinning; see docs/ENGINE.md)."""
        t, dim = x.shape[0], self.hidden
        heads, hd, inter = self.heads, self.head_dim, self.inter
        qkv = torch.empty(t, self.qkv_width, dtype=torch.bfloat16)
        attn = torch.empty(t, heads * hd, dtype=torch.bfloat16)
        o = torch.empty(t, dim, dtype=torch.bfloat16)
        gate_up = torch.empty(t, 2 * inter, dtype=torch.bfloat16)
        act = torch.empty(t, inter, dtype=torch.bfloat16)
        tables, lens = context
        cos_p, sin_p, pos_p, slot_p = rope
        self.lib.ts_decode_layers(
            self._decode_table(plans, kv_caches), len(plans), ptr(h), ptr(x), ptr(qkv), ptr(attn), ptr(o),
            ptr(gate_up), ptr(act), t, dim, heads, self.kv_heads, hd, inter, pos_p, cos_p, sin_p, slot_p,
            ptr(tables), tables.stride(0), ptr(lens), block, self.eps, self.scale, self.decode_vnni,
        )  # fmt: skip

    def _decode_table(
        self, plans: list[_LayerPlan], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> ctypes.Array[cpu_kernels.DecodeLayer]:
        """The layers' pointers as ts_decode_layers reads them, made again only if the caches moved."""
        key = tuple(ptr(c) for pair in kv_caches for c in pair)
        if self._decode_key != key:
            table = (cpu_kernels.DecodeLayer * len(plans))()
            for row, plan, (k_cache, v_cache) in zip(table, plans, kv_caches, strict=True):
                for j, (packed, scale, shifted_min, bias) in enumerate(
                    (plan.qkv, plan.o, plan.gate_up, plan.down)
                ):
                    row.packed[j], row.scale[j], row.shifted_min[j], row.bias[j] = (
                        packed,
                        scale,
                        shifted_min,
                        bias,
                    )
                row.input_norm, row.post_norm = plan.input_norm, plan.post_norm
                row.k_cache, row.v_cache = ptr(k_cache), ptr(v_cache)
            self._decode_args, self._decode_key = table, key
        assert self._decode_args is not None
        return self._decode_args

    def _silu_gate_up(self, layer: DecoderLayer, x: torch.Tensor, d: int) -> torch.Tensor:
        """silu(gate) * up of the normed rows x: prompt rows straight from the AMX int4 kernel where it
        runs them (the product never written), the rest as the gate|up matmul then SiLU x up. Same bits."""
        t, inter, gate_up = x.shape[0], self.inter, layer.gate_up
        act = torch.empty(t, inter, dtype=torch.bfloat16)
        split = gate_up.prompt_rows_from(d, t)
        if split >= t or not gate_up.fuses_silu():
            gu = gate_up(x, d).contiguous()
            self.lib.ts_silu_mul(ptr(gu), ptr(act), t, inter)
            return act
        if split:
            gu = gate_up.decode_matmul(x[:split]).contiguous()
            self.lib.ts_silu_mul(ptr(gu), ptr(act), split, inter)
        assert gate_up.amx4 is not None
        gate_up.amx4.prefill_silu_matmul(x[split:], act[split:])
        return act

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism, the row-parallel partial sums added over ranks in float32 and
        handed back in bf16 (what the residual-add kernel reads); as is otherwise."""
        if self.model.tp is None:
            return partial
        return self.model.tp.all_reduce(partial).to(torch.bfloat16)

    @staticmethod
    def _prompt_queries(meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """Per prompt chunk: its first row, its rows, its first position, its sequence's block table
        and each row's context length (position + 1): the prompt kernel's arguments and the decode
        kernel's, one table shared by every row (row stride 0). Prompt chunk i is the step's sequence
        num_decodes + i."""
        prompts = []
        for i, span in enumerate(meta.prefills):
            table = meta.block_tables[meta.num_decodes + i].contiguous()
            lens = torch.arange(span.start_pos + 1, span.start_pos + span.q_len + 1, dtype=torch.long)
            prompts.append((span.q_start, span.q_len, span.start_pos, table, lens))
        return prompts


class _LayerPlan(NamedTuple):
    """A layer's raw pointers for `FusedCpuForward._prompt_layers` (per matmul: packed, scale, min,
    bias as ts_q4_prefill_matmul takes them) or `_decode_layers` (packed, scale, shifted min, bias as
    ts_q4_matmul takes them), and its two norm weights."""

    qkv: tuple[int, int, int, int | None]
    o: tuple[int, int, int, int | None]
    gate_up: tuple[int, int, int, int | None]
    down: tuple[int, int, int, int | None]
    input_norm: int
    post_norm: int
    # prompt rows on int8 dot products (ts_q4a8_prefill_matmul, the same arguments; gate|up then
    # SiLU x up as two calls) rather than the AMX int4 kernel
    int4a8: bool = False


def _layer_plan(layer: DecoderLayer) -> _LayerPlan | None:
    """The layer's plan, or None unless each linear runs its prompt rows on one kernel with no padded
    outputs: the AMX int4 one, gate|up fusing SiLU x up, or int8 dot products (`int4a8`), gate|up
    then SiLU x up (what the module path would then run)."""
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    plan = (ptr(layer.input_norm), ptr(layer.post_norm))
    if all(linear.prefill_kernel == "int4a8" for linear in linears):
        return _int8_dots_plan(layer)
    args: list[tuple[int, int, int, int | None]] = []
    for linear in linears:
        amx4 = linear.amx4
        if linear.weight is not None or amx4 is None or amx4.scale.shape[0] * 16 != linear.out_features:
            return None
        bias = None if amx4.bias is None else ptr(amx4.bias)
        args.append((ptr(amx4.packed), ptr(amx4.scale), ptr(amx4.min), bias))
    if not layer.gate_up.fuses_silu():
        return None
    qkv, o, gate_up, down = args
    return _LayerPlan(qkv, o, gate_up, down, *plan)


def _int8_dots_plan(layer: DecoderLayer) -> _LayerPlan | None:
    """The layer's plan on int8 dot products (its linears' `vnni4` codes; `int4a8` set), or None where a
    linear has no such codes or padded outputs."""
    args: list[tuple[int, int, int, int | None]] = []
    for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
        v = linear.vnni4
        if v is None or v.scale.shape[0] * 16 != linear.out_features:
            return None
        args.append((ptr(v.codes), ptr(v.scale), ptr(v.min), None if v.bias is None else ptr(v.bias)))
    qkv, o, gate_up, down = args
    return _LayerPlan(qkv, o, gate_up, down, ptr(layer.input_norm), ptr(layer.post_norm), int4a8=True)


def _decode_plan(layer: DecoderLayer) -> _LayerPlan | None:
    """The layer's plan for decode rows, or None unless each linear runs them on the int4 tile kernel
    (ts_q4_matmul: the AMX or AVX512-BF16 build) or all on int8 dot products (`int4a8`: the prompt
    rows' codes, whatever runs the prompt rows) with no padded outputs."""
    if all(linear.decode_kernel in ("int4a8", "int4a16") for linear in layer.linears()):
        return _int8_dots_plan(layer)
    args: list[tuple[int, int, int, int | None]] = []
    for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
        amx4 = linear.amx4
        if amx4 is None or amx4.scale.shape[0] * 16 != linear.out_features or linear.decode_kernel != "int4":
            return None
        bias = None if amx4.bias is None else ptr(amx4.bias)
        args.append((ptr(amx4.packed), ptr(amx4.scale), ptr(amx4.shifted_min), bias))
    qkv, o, gate_up, down = args
    return _LayerPlan(qkv, o, gate_up, down, ptr(layer.input_norm), ptr(layer.post_norm))


def _split_rows(d: int, first: Callable[..., int], rest: Callable[..., int]) -> Callable[..., None]:
    """A matmul with ts_q4a8_prefill_matmul's arguments that runs the first `d` rows on `first` and
    the others on `rest` (bf16 rows: 2 bytes an element)."""

    def run(
        x: int, rows: int, k: int, codes: int, scale: int, low: int, bias: int | None, n: int, out: int
    ) -> None:
        first(x, d, k, codes, scale, low, bias, n, out)
        rest(x + 2 * d * k, rows - d, k, codes, scale, low, bias, n, out + 2 * d * n)

    return run
