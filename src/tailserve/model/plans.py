"""Weight format names (`--weight-format`) -> the kernel plan of each part, and the model built in it.

At start-up the quality gate resolves `auto` first (`quality_gate.choose_weight_format`: the fastest
format that passed); `auto` reaching this module directly means the gate's first CPU candidate, int4
(bf16 on CUDA: the int kernels used here are CPU ones). Never loads weights; never touches the KV pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tailserve.errors import ConfigError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.transformer import FormatPlan, TransformerLM
from tailserve.weights.formats import (
    Int4Groups,
    dequantize_tensor,
    int4_from_blocks,
    int8_groups_from_blocks,
)
from tailserve.weights.loader import LoadedModel

if TYPE_CHECKING:
    from tailserve.model.sharding import ShardComm

log = logging.getLogger(__name__)

AUTO_CPU_FORMAT = "int4"  # measured fastest at 1-4 rows; quality figures in docs/ENGINE.md
PLANS = {
    "fp32": FormatPlan(decode="fp32", prefill="fp32", head="fp32"),
    "bf16": FormatPlan(decode="bf16", prefill="bf16", head="bf16"),
    # Decode rows on the weight-only int kernels, prompt rows on bf16 GEMMs (faster from ~16 rows).
    # The head is bf16 (it shares the embedding table): int8 is faster for 1-4 rows but 1.8x slower
    # at 16, and 4 bits there cost far more quality than they save (docs/ENGINE.md, CPU fast path).
    # With the fused CPU kernels' AMX matmuls, prompt rows widen the same int4 groups to bf16 on the
    # fly (no dense copy kept); with AMX or AVX512-BF16 the head is q8: the file's Q8_0 groups,
    # float32 sums. Where those are missing, plan_for makes them bf16 (prompt rows on a float32
    # copy, `fp32w`, where the CPU has no bf16 arithmetic), or, on such a CPU with AVX512-VNNI, runs
    # every row and the q8 head on int8 dot products (`int4a8` prompt rows, `int4a16` decode rows).
    "int4": FormatPlan(decode="int4", prefill="int4", head="q8"),
    "int8": FormatPlan(decode="int8", prefill="bf16", head="int8"),
}


def resolve_format(weight_format: str, device: torch.device) -> str:
    """`auto` -> a concrete format for the device; int formats on CUDA are refused."""
    if weight_format == "auto":
        return AUTO_CPU_FORMAT if device.type == "cpu" else "bf16"
    if weight_format not in PLANS:
        raise ConfigError(f"--weight-format must be one of auto, {', '.join(PLANS)}, got {weight_format!r}")
    if device.type != "cpu" and weight_format in ("int4", "int8"):
        raise ConfigError(f"--weight-format {weight_format} runs on CPU only; use bf16 on {device.type}")
    return weight_format


def plan_for(
    weight_format: str,
    device: torch.device,
    head: str | None = None,
    dense_decode_from_rows: int | None = None,
) -> FormatPlan:
    """The kernel plan of a format; `head` overrides the LM head's kernel (fp32, bf16, int8, int4).

    `dense_decode_from_rows` (opt-in, batch-dependent) sends decode rows of steps with at least that
    many decodes through the prefill kernel (bf16): faster at large batches, see docs/ENGINE.md.
    """
    plan = PLANS[resolve_format(weight_format, device)]
    head, prefill = head or plan.head, plan.prefill
    cpu = device.type == "cpu"
    if not cpu or (
        cpu_kernels.tile_matmuls() is None and (cpu_kernels.native_bf16() or cpu_kernels.int8_dots() is None)
    ):
        # q8 without tile matmuls: on int8 dot products where the CPU has them (VNNI, or AVX2) but no
        # bf16 arithmetic (torch's bf16 head is emulated there: 3.1 / 20.7 ms for 1 / 16 rows against
        # 1.4 / 3.0 on 2 vCPUs of the VNNI kind), else the bf16 head.
        head = "bf16" if head == "q8" else head
    if not cpu or cpu_kernels.amx() is None:
        prefill = "bf16" if prefill == "int4" else prefill
    decode = plan.decode
    if cpu and prefill == "bf16" and plan.decode != "bf16" and not cpu_kernels.native_bf16():
        # The dense copy only serves prompt rows here: float32 runs them ~4.5x faster than torch's
        # emulated bf16 GEMM (docs/ENGINE.md, "CPUs without bf16 arithmetic"), for the same memory
        # as the bf16 copy and its oneDNN-packed twin. int4 with AVX512-VNNI goes further: its
        # groups times int8-rounded activations on int8 dot products (`int4a8`), no dense copy. Its
        # decode rows take the same codes with int16-rounded activations (`int4a16`: torch's int4
        # kernel runs bf16 emulated there, 1.5-2.6x slower; int8 decode rows would be faster at 4+
        # rows but cost a decode row's top-1 1.5 points, docs/ENGINE.md). With AVX2 alone (no
        # VNNI: AMD Zen 3) the same decode rows run on AVX2's int8 products, and prompt rows stay on
        # the float32 copy: int4a8 there bought only 0.73-0.82x a prefill step and turned the
        # README's greedy answer (docs/notes/tail-under-slo.md, 2026-12-07).
        prefill = "int4a8" if plan.decode == "int4" and cpu_kernels.vnni() is not None else "fp32w"
        if plan.decode == "int4" and cpu_kernels.int8_dots() is not None:
            decode = "int4a16"

    return FormatPlan(decode, prefill, head, dense_decode_from_rows)


def activation_dtype(weight_format: str, device: torch.device) -> torch.dtype:
    """The dtype to load dense weights in, of hidden states, and of the q / k / v attention receives."""
    return plan_for(weight_format, device).activation_dtype


def build_model(
    loaded: LoadedModel,
    weight_format: str,
    device: torch.device,
    max_positions: int,
    head: str | None = None,
    dense_decode_from_rows: int | None = None,
    tp: ShardComm | None = None,
) -> TransformerLM:
    """The transformer in `weight_format` on `device`, from weights already loaded (any load dtype).

    With `tp`, only this rank's shard of every weight (and of the file's int4 / Q8_0 groups) is built.
    """
    plan = plan_for(weight_format, device, head, dense_decode_from_rows)
    blocks = loaded.blocks
    int4: dict[str, Int4Groups] = {}
    if plan.decode in ("int4", "int4a8", "int4a16") or plan.head == "int4":
        for name, t in blocks.items():
            groups = int4_from_blocks(t)
            if groups is not None:  # cut at once under TP: never every layer's whole groups at a time
                int4[name] = groups if tp is None else tp.keep_int4(name, groups)
    head_name = "lm_head.weight" if "lm_head.weight" in loaded.weights else "model.embed_tokens.weight"
    head_weight = None
    head_int8 = (
        int8_groups_from_blocks(blocks[head_name]) if plan.head == "q8" and head_name in blocks else None
    )
    if (
        plan.head not in ("bf16", "q8")
        and head_name in blocks
        and loaded.weights[head_name].dtype != torch.float32
    ):
        # fp32 and 8/4-bit heads start from the file's exact values, not a bf16 copy of them.
        head_weight = dequantize_tensor(blocks[head_name])
    weights = loaded.weights
    if plan.activation_dtype == torch.float32 and any(w.dtype != torch.float32 for w in weights.values()):
        log.warning("fp32 format over weights loaded in a lower precision: upcast, not re-read")
        weights = {k: w.float() for k, w in weights.items()}
    arch = loaded.arch
    if tp is not None:
        arch = tp.local_arch
        if not loaded.sharded:  # weights loaded whole (tests pass them in): cut them here
            weights = {n: tp.keep(n, w) for n, w in weights.items()}
        head_weight = None if head_weight is None else tp.keep(head_name, head_weight)
        head_int8 = None if head_int8 is None else tp.keep_int8_rows(head_name, head_int8)
    model = TransformerLM(arch, weights, max_positions, plan, int4, head_weight, head_int8)
    if tp is not None:
        model.shard_over(tp)
    return model.to(device)
