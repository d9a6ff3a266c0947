"""Capacity arithmetic: weight bytes, KV bytes per token, how many requests fit, the decode-step floor.

Pure functions of a model shape and a GPU spec (SPEC.md, "Capacity arithmetic"); no I/O, no
measurement. Every figure is a bound the real engine can only approach, never beat.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType

from tailserve.errors import ConfigError
from tailserve.model.tp_split import (
    TensorParallelSplit,
    allreduce_bytes_per_token,
    tensor_parallel_split,
)
from tailserve.plan.catalog import GIB, GpuSpec
from tailserve.plan.errors import PlanError
from tailserve.plan.shapes import ModelShape, ParamCount, count_params

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "int8")
DTYPE_BYTES = MappingProxyType({"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5})
INT4_GROUP_SIZE = 128  # AWQ / GPTQ default: one fp16 scale per 128 weights
UNQUANTIZED_BYTES = 2  # embeddings, lm_head, norms, biases and activations stay 16-bit
LOGIT_BYTES = 4  # logits are upcast to fp32 for sampling
RUNTIME_RESERVE_BYTES = 1 * GIB  # CUDA context, cuBLAS workspace, CUDA graphs, allocator slack
TPOT_SLO_S = 0.030
# Tensor-parallel all-reduce: assumed link bandwidth per GPU and fixed cost per collective. PCIe 5
# x16 is ~64 GB/s a direction; NVLink 4 ~450 (pass --interconnect-gb-s). A decode step's
# all-reduces are small, so their count times the per-call latency often dominates.
INTERCONNECT_GB_S = 64.0
ALLREDUCE_LATENCY_S = 10e-6
TP_COMM_SHARE_WARN = 0.20


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked: a model on `num_gpus` cards of one kind, serving `concurrency` requests."""

    model: ModelShape
    gpu: GpuSpec
    num_gpus: int = 1
    dtype: str = "bf16"
    kv_dtype: str = "auto"  # auto: 16-bit KV whatever the weight dtype (what engines default to)
    context_tokens: int = 4096  # prompt + output of one request
    concurrency: int = 32
    gpu_memory_utilization: float = 0.90
    token_budget: int = 2048  # tokens per engine step (sizes the activation peak)
    tpot_slo_s: float = TPOT_SLO_S
    interconnect_gb_s: float = INTERCONNECT_GB_S  # per-GPU all-reduce bandwidth (tensor parallel)

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise PlanError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise PlanError(f"unknown KV dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        for name in ("num_gpus", "context_tokens", "concurrency", "token_budget"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tpot_slo_s <= 0:
            raise PlanError(f"tpot_slo_s must be positive, got {self.tpot_slo_s}")
        if self.interconnect_gb_s <= 0:
            raise PlanError(f"interconnect_gb_s must be positive, got {self.interconnect_gb_s}")
        _ = self.split  # the runtime's rule: a GPU count the server would refuse is refused here too

    @property
    def split(self) -> TensorParallelSplit:
        """Heads and KV heads per GPU, by the rule `tailserve serve --tensor-parallel-size` uses."""
        try:
            return tensor_parallel_split(self.model.num_heads, self.model.num_kv_heads, self.num_gpus)
        except ConfigError as exc:
            raise PlanError(str(exc).replace("--tensor-parallel-size", "--gpus")) from None

    @property
    def kv_bytes_per_element(self) -> float:
        """Bytes of one cached K or V element."""
        return UNQUANTIZED_BYTES if self.kv_dtype == "auto" else DTYPE_BYTES[self.kv_dtype]


@dataclass(frozen=True)
class StepFloor:
    """The fastest one decode step can be at `batch` sequences of `context_tokens` each."""

    batch: int
    bytes_read_per_gpu: int
    memory_s: float  # bytes read / peak bandwidth
    compute_s: float | None  # FLOPs / dense peak; None when the catalog lacks TFLOPS for the dtype

    @property
    def step_s(self) -> float:
        """Best possible time per output token (TPOT) at this batch."""
        return max(self.memory_s, self.compute_s or 0.0)

    @property
    def bound(self) -> str:
        """Which resource sets the floor: "memory" or "compute"."""
        return "compute" if (self.compute_s or 0.0) > self.memory_s else "memory"

    @property
    def tokens_per_s_per_stream(self) -> float:
        """Best possible decode speed one user sees."""
        return 1.0 / self.step_s

    @property
    def tokens_per_s_total(self) -> float:
        """Best possible aggregate decode throughput."""
        return self.batch / self.step_s


@dataclass(frozen=True)
class CapacityPlan:
    """Every number `tailserve plan` reports, per GPU unless the name says otherwise."""

    request: PlanRequest
    params: ParamCount
    weight_bytes: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int  # 2 x layers x kv_heads x head_dim x bytes (whole model)
    kv_bytes_per_token_hidden_formula: int  # 2 x layers x hidden x bytes (ignores GQA)
    kv_bytes_per_token_per_gpu: int
    usable_bytes_per_gpu: int
    activation_bytes_per_gpu: int
    kv_pool_bytes_per_gpu: int  # negative when weights and activations alone overflow
    kv_capacity_tokens: int
    max_concurrency: int  # requests of `context_tokens` each that fit in the KV pool
    max_batch_within_slo: int  # largest batch that fits in KV and whose step floor meets the SLO
    floor_batch1: StepFloor
    floor_at_concurrency: StepFloor
    notes: tuple[str, ...] = field(default_factory=tuple)
    allreduce: AllReduceCost | None = None  # tensor parallel only

    @property
    def fits(self) -> bool:
        """True when the weights fit and at least one request of full context has KV room."""
        return self.max_concurrency >= 1

    @property
    def meets_slo(self) -> bool:
        """True when `concurrency` requests fit and their step floor is within the TPOT SLO."""
        return (
            self.fits
            and self.request.concurrency <= self.max_concurrency
            and self.floor_at_concurrency.step_s <= self.request.tpot_slo_s
        )


def weight_bytes(params: ParamCount, dtype: str) -> int:
    """Bytes of all weights: the layer matrices at `dtype`, everything else 16-bit."""
    per_weight = DTYPE_BYTES[dtype]
    if dtype == "int4":
        per_weight += UNQUANTIZED_BYTES / INT4_GROUP_SIZE  # group scales
    kept = (params.embedding + params.small + params.lm_head) * UNQUANTIZED_BYTES
    return math.ceil(params.linear * per_weight + kept)


def weight_bytes_per_gpu(params: ParamCount, dtype: str, num_gpus: int) -> int:
    """Tensor parallelism splits matrices and the vocabulary; norms and biases are replicated."""
    small = params.small * UNQUANTIZED_BYTES
    return math.ceil((weight_bytes(params, dtype) - small) / num_gpus) + small


def kv_bytes_per_token(shape: ModelShape, bytes_per_element: float, kv_heads: int | None = None) -> int:
    """K and V of one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
    heads = shape.num_kv_heads if kv_heads is None else kv_heads
    return math.ceil(2 * shape.num_layers * heads * shape.head_dim * bytes_per_element)


def kv_bytes_per_token_hidden_formula(shape: ModelShape, bytes_per_element: float) -> int:
    """The article formula 2 x layers x hidden x bytes: right only when every head has its own KV."""
    return math.ceil(2 * shape.num_layers * shape.hidden_size * bytes_per_element)


def kv_heads_per_gpu(shape: ModelShape, num_gpus: int) -> int:
    """KV heads each GPU holds (split, or one replicated per group): the runtime's own rule."""
    return tensor_parallel_split(shape.num_heads, shape.num_kv_heads, num_gpus).kv_heads_per_rank


@dataclass(frozen=True)
class AllReduceCost:
    """The all-reduces of one decode step at `batch` tokens: 2 per layer plus the embedding's."""

    batch: int
    collectives: int
    bytes_per_gpu: int  # sent by each GPU (ring: 2 (N-1)/N of the tensor)
    seconds: float  # bytes / interconnect + collectives x per-call latency
    share: float  # seconds / (seconds + the step floor): the part of a step spent communicating
    fits_one_gpu: bool  # the same request plan fits a single GPU


def allreduce_cost(request: PlanRequest, floor: StepFloor, fits_one_gpu: bool) -> AllReduceCost:
    """Communication of a tensor-parallel decode step against its floor (16-bit activations)."""
    shape, n = request.model, request.num_gpus
    per_token = allreduce_bytes_per_token(shape.num_layers, shape.hidden_size, n, UNQUANTIZED_BYTES)
    collectives = 2 * shape.num_layers + 1
    sent = per_token * floor.batch
    seconds = sent / (request.interconnect_gb_s * 1e9) + collectives * ALLREDUCE_LATENCY_S
    return AllReduceCost(
        floor.batch, collectives, sent, seconds, seconds / (seconds + floor.step_s), fits_one_gpu
    )


def activation_bytes_per_gpu(request: PlanRequest) -> int:
    """Peak transient memory of one step at the token budget, the fp32 logits, and a runtime reserve."""
    shape, n = request.model, request.num_gpus
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    # Residual + normed input, qkv output, and gate/up/act of the MLP are alive together at the peak.
    per_token = 2 * shape.hidden_size + (q_width + 2 * kv_width + 3 * shape.intermediate_size) / n
    hidden_states = request.token_budget * per_token * UNQUANTIZED_BYTES
    logit_rows = min(request.concurrency, request.token_budget)
    logits = 2 * logit_rows * shape.vocab_size * LOGIT_BYTES  # logits and the sampling probabilities
    return math.ceil(hidden_states + logits) + RUNTIME_RESERVE_BYTES


def compute_tflops(gpu: GpuSpec, dtype: str) -> float | None:
    """Dense peak a decode step runs at: W8A8 / FP8 on their own tensor cores, weight-only in 16 bits."""
    tflops = gpu.dense_tflops
    half = (
        (tflops.get(dtype) if dtype in ("bf16", "fp16") else None) or tflops.get("bf16") or tflops.get("fp16")
    )
    if dtype in ("fp8", "int8"):
        return tflops.get(dtype) or half
    return half


def step_floor(request: PlanRequest, params: ParamCount, batch: int) -> StepFloor:
    """The decode-step floor: (weights + KV read) / bandwidth, and FLOPs / peak when it is higher."""
    shape, n = request.model, request.num_gpus
    kv_per_gpu = kv_bytes_per_token(shape, request.kv_bytes_per_element, kv_heads_per_gpu(shape, n))
    bytes_read = weight_bytes_per_gpu(params, request.dtype, n) + batch * request.context_tokens * kv_per_gpu
    memory_s = bytes_read / request.gpu.bandwidth_bytes_s
    tflops = compute_tflops(request.gpu, request.dtype)
    compute_s = None
    if tflops is not None:
        matmul_params = params.linear + params.embedding  # the lm_head matmul runs even when tied
        attention_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim * request.context_tokens
        flops = batch * (2 * matmul_params + attention_flops) / n
        compute_s = flops / (tflops * 1e12)
    return StepFloor(batch, bytes_read, memory_s, compute_s)


def max_batch_within_slo(request: PlanRequest, params: ParamCount, limit: int) -> int:
    """Largest batch <= limit whose step floor meets the TPOT SLO (0 if even batch 1 misses)."""
    low, high = 0, limit
    while low < high:  # step_floor grows with batch, so bisect
        mid = (low + high + 1) // 2
        if step_floor(request, params, mid).step_s <= request.tpot_slo_s:
            low = mid
        else:
            high = mid - 1
    return low


def _notes(request: PlanRequest, max_concurrency: int) -> tuple[str, ...]:
    """Caveats a user should read next to the numbers."""
    shape, gpu, n = request.model, request.gpu, request.num_gpus
    notes: list[str] = []
    if request.dtype == "bf16" and "bf16" not in gpu.dense_tflops:
        notes.append(f"{gpu.name} has no bf16 tensor cores: serve in fp16 (same bytes, same floor).")
    if request.dtype in ("fp8", "int8") and request.dtype not in gpu.dense_tflops:
        notes.append(
            f"{gpu.name} has no {request.dtype} tensor cores: {request.dtype} works only as weight-only "
            "quantization (dequantized to 16 bits in the kernel); memory is saved, compute is not."
        )
    if request.context_tokens > shape.max_position_embeddings:
        notes.append(
            f"context {request.context_tokens} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings})."
        )
    if n > shape.num_kv_heads:
        notes.append(f"{n} GPUs > {shape.num_kv_heads} KV heads: each GPU keeps a replica of a KV head.")
    if n > 1:
        notes.append(f"{request.split.describe()}.")
        notes.append("tensor parallel: the floor ignores all-reduce time (see the all-reduce line).")
    if 0 < max_concurrency < request.concurrency:
        notes.append(
            f"only {max_concurrency} requests of {request.context_tokens} tokens fit in KV; the other "
            f"{request.concurrency - max_concurrency} of {request.concurrency} wait or get preempted."
        )
    return tuple(notes)


def make_plan(request: PlanRequest) -> CapacityPlan:
    """Run the capacity arithmetic for one request."""
    shape, n = request.model, request.num_gpus
    params = count_params(shape)
    kv_elem = request.kv_bytes_per_element
    kv_per_gpu = kv_bytes_per_token(shape, kv_elem, kv_heads_per_gpu(shape, n))
    usable = int(request.gpu.memory_bytes * request.gpu_memory_utilization)
    weights_gpu = weight_bytes_per_gpu(params, request.dtype, n)
    activations = activation_bytes_per_gpu(request)
    kv_pool = usable - weights_gpu - activations
    kv_tokens = max(kv_pool, 0) // kv_per_gpu
    max_conc = kv_tokens // request.context_tokens
    floor_at_concurrency = step_floor(request, params, request.concurrency)
    allreduce = None
    notes = _notes(request, max_conc)
    if n > 1:
        fits_one = make_plan(dataclasses.replace(request, num_gpus=1)).fits
        allreduce = allreduce_cost(request, floor_at_concurrency, fits_one)
        if fits_one and allreduce.share > TP_COMM_SHARE_WARN:
            notes += (
                f"warning: the model fits one {request.gpu.name} and all-reduce would take "
                f"~{allreduce.share:.0%} of a decode step at batch {allreduce.batch}: tensor parallelism "
                f"is unlikely to pay; serve {n} replicas behind the router instead.",
            )
    return CapacityPlan(
        request=request,
        params=params,
        weight_bytes=weight_bytes(params, request.dtype),
        weight_bytes_per_gpu=weights_gpu,
        kv_bytes_per_token=kv_bytes_per_token(shape, kv_elem),
        kv_bytes_per_token_hidden_formula=kv_bytes_per_token_hidden_formula(shape, kv_elem),
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        usable_bytes_per_gpu=usable,
        activation_bytes_per_gpu=activations,
        kv_pool_bytes_per_gpu=kv_pool,
        kv_capacity_tokens=kv_tokens,
        max_concurrency=max_conc,
        max_batch_within_slo=max_batch_within_slo(request, params, max_conc),
        floor_batch1=step_floor(request, params, 1),
        floor_at_concurrency=floor_at_concurrency,
        notes=notes,
        allreduce=allreduce,
    )
