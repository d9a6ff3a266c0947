"""Builds a ready ModelRunner on rank 0 from the model and cache configs and the weight format the
quality gate chose; under tensor parallelism it starts the workers first and joins them.

The engine receives the result and makes none of these choices. It never schedules, and the KV pool
is allocated exactly once (executor/build.py).
"""

from __future__ import annotations

import logging

import torch

from tailserve.config import CacheConfig, ModelConfig
from tailserve.errors import ConfigError
from tailserve.executor import parallel, tp_worker
from tailserve.executor.build import BuiltModel, build_rank, load_for, use_device
from tailserve.model.sharding import check_shardable
from tailserve.weights.loader import LoadedModel, read_arch

log = logging.getLogger(__name__)


def build_runner(
    mc: ModelConfig, cc: CacheConfig, weight_format: str, loaded: LoadedModel | None = None
) -> BuiltModel:
    """Load (unless `loaded` is given: tests reuse weights), build the model in `weight_format` (the
    quality gate's choice), size and allocate the pool; under TP start the workers and join them."""
    device = use_device(mc)
    size = mc.tensor_parallel_size
    if size == 1:
        if loaded is None:
            loaded = load_for(mc, weight_format, device)
        return build_rank(mc, cc, loaded, weight_format, device, None)
    if device.type == "cuda":  # rank r on GPU r (NCCL wants each rank's device set before the group)
        if torch.cuda.device_count() < size:
            raise ConfigError(
                f"--tensor-parallel-size {size} needs {size} CUDA devices, this host shows "
                f"{torch.cuda.device_count()}"
            )
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    arch = loaded.arch if loaded else read_arch(mc.model)
    split = check_shardable(arch, size, weight_format)  # refused before any worker starts
    log.info("%s", split.describe())
    tp = parallel.start_workers(arch, split, device, tp_worker.main, (mc, cc, weight_format))
    try:
        if loaded is None:  # each rank loads only its shard, all at once
            loaded = load_for(mc, weight_format, device, tp.keep)
        parallel.join_workers(tp)
        return build_rank(mc, cc, loaded, weight_format, device, tp)
    except BaseException:
        tp.close()
        raise
