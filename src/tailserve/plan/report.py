"""Turns a CapacityPlan into what `tailserve plan` prints: a readable report or a JSON document.

Formatting only: every number comes from capacity.py, nothing is recomputed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tailserve.plan.capacity import CapacityPlan, StepFloor


def gb(num_bytes: float) -> str:
    """Decimal gigabytes, as spec sheets and the field quote them."""
    return f"{num_bytes / 1e9:,.2f} GB"


def mb(num_bytes: float) -> str:
    """Decimal megabytes with three significant digits (KV bytes per token)."""
    return f"{num_bytes / 1e6:.3g} MB"


def ms(seconds: float) -> str:
    """Milliseconds with two decimals."""
    return f"{seconds * 1e3:.2f} ms"


def verdict(plan: CapacityPlan) -> str:
    """One line: does it fit, and can the TPOT SLO be met at the requested concurrency."""
    req = plan.request
    slo = f"TPOT <= {ms(req.tpot_slo_s)}"
    if plan.kv_pool_bytes_per_gpu <= 0:
        return (
            f"DOES NOT FIT: weights {gb(plan.weight_bytes_per_gpu)} + activations "
            f"{gb(plan.activation_bytes_per_gpu)} exceed the usable {gb(plan.usable_bytes_per_gpu)} per GPU; "
            "use more GPUs, a smaller dtype or a bigger card."
        )
    if not plan.fits:
        return (
            f"DOES NOT FIT at context {req.context_tokens}: the KV pool holds only "
            f"{plan.kv_capacity_tokens} tokens; shorten the context or add memory."
        )
    floor = plan.floor_at_concurrency.step_s
    if plan.floor_batch1.step_s > req.tpot_slo_s:
        return (
            f"MISSES SLO: even one request's step floor is {ms(plan.floor_batch1.step_s)} > {slo}; "
            "use more GPUs (tensor parallel), a smaller weight dtype or a card with more bandwidth."
        )
    if floor > req.tpot_slo_s:
        return (
            f"MISSES SLO: at {req.concurrency} concurrent requests the step floor is {ms(floor)} > {slo}; "
            f"at most {plan.max_batch_within_slo} concurrent requests can meet it."
        )
    if req.concurrency > plan.max_concurrency:
        return (
            f"OVER CAPACITY: {req.concurrency} requests do not fit in KV (max {plan.max_concurrency}); "
            f"the ones that run meet {slo} (floor {ms(plan.floor_at_concurrency.step_s)})."
        )
    share = floor / req.tpot_slo_s
    return (
        f"MEETS SLO on paper: {slo} at {req.concurrency} concurrent requests with a floor of {ms(floor)} "
        f"({share:.0%} of the budget); the engine must reach >= {share:.0%} of peak bandwidth. "
        f"Up to {plan.max_batch_within_slo} concurrent requests fit and stay within the SLO."
    )


def _floor_line(floor: StepFloor) -> str:
    """One decode-floor row."""
    compute = "n/a" if floor.compute_s is None else ms(floor.compute_s)
    return (
        f"  batch {floor.batch:>4}: step >= {ms(floor.step_s)} ({floor.bound}-bound; memory {ms(floor.memory_s)}, "
        f"compute {compute}) -> <= {floor.tokens_per_s_per_stream:,.0f} tok/s per stream, "
        f"<= {floor.tokens_per_s_total:,.0f} tok/s total"
    )


def render_text(plan: CapacityPlan) -> str:
    """The human report."""
    req, shape, gpu, p = plan.request, plan.request.model, plan.request.gpu, plan.params
    kv_elem = req.kv_bytes_per_element
    kv_name = "16-bit" if req.kv_dtype == "auto" else req.kv_dtype
    ratio = plan.kv_bytes_per_token_hidden_formula / plan.kv_bytes_per_token
    lines = [
        f"{shape.name} on {req.num_gpus} x {gpu.name} ({gpu.memory_gib:g} GiB, {gpu.bandwidth_gb_s:g} GB/s), "
        f"{req.dtype} weights, {kv_name} KV, context {req.context_tokens}, concurrency {req.concurrency}",
        "",
        f"model        {p.total / 1e9:.3f} B params: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_heads} heads / {shape.num_kv_heads} KV heads x {shape.head_dim}, MLP {shape.intermediate_size}, "
        f"vocab {shape.vocab_size}, {'tied' if shape.tie_word_embeddings else 'untied'} embeddings"
        f"{', qkv bias' if shape.qkv_bias else ''}",
        f"weights      {gb(plan.weight_bytes)} total, {gb(plan.weight_bytes_per_gpu)} per GPU",
        f"KV / token   {mb(plan.kv_bytes_per_token)} = 2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads "
        f"x {shape.head_dim} head_dim x {kv_elem:g} B   (grouped-query attention: use this)",
        f"             {mb(plan.kv_bytes_per_token_hidden_formula)} = 2 x {shape.num_layers} layers x "
        f"{shape.hidden_size} hidden x {kv_elem:g} B   (hidden-size formula often quoted in articles)",
        f"             the hidden-size formula assumes every query head has its own K/V head; this model "
        f"shares {shape.num_heads // shape.num_kv_heads} query heads per KV head, so it overstates KV {ratio:.1f}x.",
        f"memory       {gb(gpu.memory_bytes)} x {req.gpu_memory_utilization:g} = {gb(plan.usable_bytes_per_gpu)} usable "
        f"- {gb(plan.weight_bytes_per_gpu)} weights - {gb(plan.activation_bytes_per_gpu)} activations "
        f"= {gb(max(plan.kv_pool_bytes_per_gpu, 0))} KV pool per GPU = {plan.kv_capacity_tokens:,} tokens",
        f"capacity     {plan.max_concurrency} concurrent requests of {req.context_tokens} tokens "
        f"({'fits' if plan.fits else 'does not fit'})",
        "decode floor (weights + KV read) / bandwidth, or FLOPs / dense peak when higher:",
        _floor_line(plan.floor_batch1),
        _floor_line(plan.floor_at_concurrency),
        f"verdict      {verdict(plan)}",
    ]
    if (ar := plan.allreduce) is not None:
        lines.insert(
            -1,
            f"all-reduce   {ar.collectives} per decode step, {mb(ar.bytes_per_gpu)} sent per GPU at batch {ar.batch}: "
            f"~{ar.seconds * 1e3:.3f} ms over {req.interconnect_gb_s:g} GB/s = {ar.share:.0%} of the step",
        )
    lines += [f"note         {note}" for note in plan.notes]
    return "\n".join(lines)


def _floor_dict(floor: StepFloor) -> dict[str, Any]:
    """A StepFloor with its derived figures."""
    return {
        "batch": floor.batch,
        "bytes_read_per_gpu": floor.bytes_read_per_gpu,
        "memory_s": floor.memory_s,
        "compute_s": floor.compute_s,
        "step_s": floor.step_s,
        "bound": floor.bound,
        "tpot_floor_s": floor.step_s,
        "tokens_per_s_per_stream": floor.tokens_per_s_per_stream,
        "tokens_per_s_total": floor.tokens_per_s_total,
    }


def to_json_dict(plan: CapacityPlan) -> dict[str, Any]:
    """The machine-readable report (`tailserve plan --json`)."""
    req, shape, gpu = plan.request, plan.request.model, plan.request.gpu
    return {
        "model": {**{k: getattr(shape, k) for k in shape.__dataclass_fields__}, "params": plan.params.total},
        "gpu": {
            "name": gpu.name,
            "memory_gib": gpu.memory_gib,
            "bandwidth_gb_s": gpu.bandwidth_gb_s,
            "dense_tflops": dict(gpu.dense_tflops),
        },
        "num_gpus": req.num_gpus,
        "dtype": req.dtype,
        "kv_dtype": req.kv_dtype,
        "context_tokens": req.context_tokens,
        "concurrency": req.concurrency,
        "gpu_memory_utilization": req.gpu_memory_utilization,
        "token_budget": req.token_budget,
        "tpot_slo_s": req.tpot_slo_s,
        "weight_bytes": plan.weight_bytes,
        "weight_bytes_per_gpu": plan.weight_bytes_per_gpu,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_bytes_per_token_hidden_formula": plan.kv_bytes_per_token_hidden_formula,
        "kv_bytes_per_token_per_gpu": plan.kv_bytes_per_token_per_gpu,
        "usable_bytes_per_gpu": plan.usable_bytes_per_gpu,
        "activation_bytes_per_gpu": plan.activation_bytes_per_gpu,
        "kv_pool_bytes_per_gpu": plan.kv_pool_bytes_per_gpu,
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "max_concurrency": plan.max_concurrency,
        "max_batch_within_slo": plan.max_batch_within_slo,
        "fits": plan.fits,
        "meets_slo": plan.meets_slo,
        "floor_batch1": _floor_dict(plan.floor_batch1),
        "floor_at_concurrency": _floor_dict(plan.floor_at_concurrency),
        "verdict": verdict(plan),
        "notes": list(plan.notes),
        "allreduce": None if plan.allreduce is None else dataclasses.asdict(plan.allreduce),
    }
