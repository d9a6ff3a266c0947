"""One rank's runner from the model and cache configs and a weight format: device, threads, context
length, KV pool size, attention backend and CUDA graphs (an explicit switch). Rank 0 builds through
executor/builder.py, workers through executor/tp_worker.py; both end here.

It is the one place these choices are made; the engine only receives the result. It never
schedules, and it allocates the KV pool exactly once.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tailserve.config import CacheConfig, ModelConfig
from tailserve.errors import ConfigError
from tailserve.executor.runner import ModelRunner, kv_bytes_per_token, kv_pool_shape
from tailserve.model.attention import AttentionBackend
from tailserve.model.plans import activation_dtype, build_model, plan_for
from tailserve.weights.arch import ArchConfig
from tailserve.weights.loader import Keep, LoadedModel, load_model
from tailserve.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tailserve.executor.parallel import TensorParallel

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
MAX_DEFAULT_CONTEXT = 8192
_ACTIVATIONS_MIB_CUDA = 1 << 30  # room left on the GPU for activations when sizing the pool


@dataclass
class BuiltModel:
    """A runner over its preallocated KV pool, plus what the engine needs to know about the model."""

    runner: ModelRunner
    arch: ArchConfig
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    kv_bytes_per_token: int
    load_s: float
    weight_format: str  # the concrete format served (auto resolved by the quality gate)


def default_cpu_threads() -> int:
    """One core fewer than the process may use (at least one).

    The spare core runs the HTTP loop, tokenization and everything else: when a parallel op's thread
    is descheduled, the whole op waits for it, and on 2 cores a 0.5 ms matmul was seen to take 16 ms.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when torch sees a device, else CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def use_device(mc: ModelConfig) -> torch.device:
    """The device rank 0 runs on, with the process's torch threads set on CPU (the engine owns them;
    tensor-parallel ranks share the cores). Call it before the quality gate measures anything."""
    device = resolve_device(mc.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(mc))
    return device


def resolve_kv_dtype(kv_cache_dtype: str, activation_dtype: torch.dtype) -> torch.dtype:
    """`auto` keeps the activation dtype; fp32 / bf16 are explicit."""
    return {"auto": activation_dtype, "fp32": torch.float32, "bf16": torch.bfloat16}[kv_cache_dtype]


def cpu_threads(mc: ModelConfig) -> int:
    """Threads each rank's CPU steps run on: `--num-threads`, else the cores shared by the ranks."""
    return mc.num_threads or max(1, default_cpu_threads() // mc.tensor_parallel_size)


def load_for(
    mc: ModelConfig, weight_format: str, device: torch.device, keep: Keep | None = None
) -> LoadedModel:
    dtype = activation_dtype(weight_format, device)
    # A plan that runs the int4 layers from their blocks on both phases needs no dense copy.
    dense_q4 = plan_for(weight_format, device).prefill != "int4"
    return load_model(mc.model, dtype, mc.seed, dense_q4=dense_q4, keep=keep)


def build_rank(
    mc: ModelConfig,
    cc: CacheConfig,
    loaded: LoadedModel,
    weight_format: str,
    device: torch.device,
    tp: TensorParallel | None,
) -> BuiltModel:
    """The model (this rank's shard under TP) and its runner over a KV pool sized the same on every rank."""
    dtype = activation_dtype(weight_format, device)
    arch = loaded.arch
    kv_arch = arch if tp is None else tp.local_arch
    max_model_len = min(
        mc.max_model_len or min(arch.max_position_embeddings, MAX_DEFAULT_CONTEXT),
        arch.max_position_embeddings,
    )
    kv_dtype = resolve_kv_dtype(mc.kv_cache_dtype, dtype)
    per_token = kv_bytes_per_token(kv_arch, kv_dtype)
    num_blocks = _num_blocks(cc, device, per_token)
    if tp is not None:  # rank 0's block tables index every rank's pool: one size for all
        num_blocks = tp.min_over_ranks(num_blocks)
    shape = kv_pool_shape(kv_arch, num_blocks, cc.block_size)
    pool: list[torch.Tensor] = []
    if device.type == "cpu":  # first-touching a GiB of pages takes ~0.6 s: overlap it with the build
        zeroing = threading.Thread(target=lambda: pool.append(torch.zeros(shape, dtype=kv_dtype)))
        zeroing.start()
        model = build_model(loaded, weight_format, device, max_model_len, tp=tp)
        zeroing.join()
    else:
        model = build_model(loaded, weight_format, device, max_model_len, tp=tp)
    runner = ModelRunner(
        model,
        num_blocks,
        cc.block_size,
        device,
        backend=_pick_backend(device),
        kv_dtype=kv_dtype,
        kv_pool=pool[0] if pool else None,
        tp=tp,
        num_threads=cpu_threads(mc) if device.type == "cpu" else None,
    )
    if runner.backend.name == "triton" and not mc.enforce_eager and tp is None:
        _attach_decode_graphs(runner, max_model_len)
    tokens = num_blocks * cc.block_size
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %d bytes/token (%.1f MiB), "
        "max %d concurrent requests at %d tokens of context; weights %s, KV %s; attention backend %s; "
        "decode graphs %s",
        num_blocks,
        cc.block_size,
        tokens,
        per_token,
        tokens * per_token / 2**20,
        tokens // max_model_len,
        max_model_len,
        weight_format,
        str(kv_dtype).removeprefix("torch."),
        runner.backend.name,
        "on" if runner.use_decode_graphs else "off",
    )
    return BuiltModel(
        runner=runner,
        arch=arch,
        tokenizer=loaded.tokenizer,
        model_name=mc.served_model_name or loaded.name,
        max_model_len=max_model_len,
        kv_bytes_per_token=per_token,
        load_s=loaded.load_s,
        weight_format=weight_format,
    )


def _num_blocks(cc: CacheConfig, device: torch.device, per_token: int) -> int:
    """Blocks that fit the KV budget: the configured bytes, or on CUDA what memory utilization leaves."""
    block_bytes = per_token * cc.block_size
    if cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = int(total * cc.gpu_memory_utilization) - used_by_others - _ACTIVATIONS_MIB_CUDA
        log.info(
            "KV budget: %.2f GiB = %.2f GiB x %.2f - %.2f GiB in use - 1 GiB activations",
            budget / 2**30,
            total / 2**30,
            cc.gpu_memory_utilization,
            used_by_others / 2**30,
        )
    else:
        budget = CPU_DEFAULT_KV_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; give it more memory"
        )
    return int(num_blocks)


def _attach_decode_graphs(runner: ModelRunner, max_model_len: int) -> None:
    """CUDA graphs for decode steps at a ladder of batch sizes; the runner stays eager if capture fails."""
    from tailserve.executor.cuda_graphs import DecodeGraphRunner

    try:
        graphs = DecodeGraphRunner(runner, max_context=max_model_len)
        seconds = graphs.capture()
    except Exception:
        log.exception("CUDA graph capture failed; decode steps run eagerly")
        return
    runner.attach_decode_graphs(graphs)
    log.info("captured decode CUDA graphs for batch sizes %s in %.2f s", graphs.batch_sizes, seconds)


def _pick_backend(device: torch.device) -> AttentionBackend | None:
    """The fastest attention backend for the device; None means the portable torch one."""
    if device.type != "cuda":
        return None
    try:
        from tailserve.model.triton_attention import TritonPagedAttention
    except ImportError:
        return None
    backend: AttentionBackend = TritonPagedAttention()
    return backend
