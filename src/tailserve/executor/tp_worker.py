"""A tensor-parallel worker process (ranks 1..N-1): build this rank's shard, then run rank 0's plans.

It never schedules, samples or serves HTTP: it runs each step's forward as rank 0 sent it, joining
the step's collectives. It ignores SIGINT / SIGTERM (rank 0 drains and then stops it) and exits
when rank 0 says stop or its plan pipe closes (rank 0 is gone).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from tailserve.config import CacheConfig, ModelConfig
from tailserve.executor import parallel
from tailserve.executor.build import BuiltModel, build_rank, cpu_threads, load_for, resolve_device
from tailserve.executor.runner import ModelRunner, chunks_from_plan
from tailserve.model.sharding import check_shardable
from tailserve.weights.loader import read_arch

log = logging.getLogger(__name__)


def main(
    rank: int,
    size: int,
    port: int,
    plan_pipe: Connection,
    loaded: Any,
    mc: ModelConfig,
    cc: CacheConfig,
    weight_format: str,
) -> None:
    """Process entry point (spawned by `parallel.start_group`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{rank}/{size} %(levelname)s %(name)s: %(message)s"
    )
    runner = build_worker_runner(mc, cc, weight_format, rank, port, on_loaded=loaded.set).runner
    try:
        serve(runner, plan_pipe)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    finally:
        if runner.tp is not None:
            runner.tp.close()


def serve(runner: ModelRunner, plan_pipe: Connection) -> None:
    """Run every plan rank 0 sends until it says stop or goes away."""
    while True:
        try:
            message = plan_pipe.recv()
        except EOFError:
            log.info("rank 0 closed the plan pipe; exiting")
            return
        kind = message[0]
        if kind == "stop":
            return
        chunks = chunks_from_plan(message[1])
        if kind == "step":
            runner.execute_eager(chunks)
        else:
            runner.logits_for(chunks)


def build_worker_runner(
    mc: ModelConfig,
    cc: CacheConfig,
    weight_format: str,
    rank: int,
    port: int,
    on_loaded: Callable[[], None] | None = None,
) -> BuiltModel:
    """A tensor-parallel worker's runner over its shard: load, join rank 0's group, build."""
    size = mc.tensor_parallel_size
    device = resolve_device(mc.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(mc))
    arch = read_arch(mc.model)
    tp = parallel.TensorParallel(rank, arch, check_shardable(arch, size, weight_format), device)
    loaded = load_for(mc, weight_format, device, tp.keep)
    if on_loaded is not None:
        on_loaded()  # rank 0 watches the workers until every one has loaded, then joins
    tp.join(port)
    return build_rank(mc, cc, loaded, weight_format, device, tp)
