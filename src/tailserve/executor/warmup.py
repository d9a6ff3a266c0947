"""Hardware warm-up around a runner, so the engine knows no oneDNN or OpenMP: oneDNN's primitive cache
sized before the build, every prompt-row kernel created before serving, and the loading thread's
OpenMP workers given up before the steps move to the engine thread (tailserve.kernels.onednn and
.openmp say why). Never changes a result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tailserve.executor.runner import ModelRunner
from tailserve.kernels import onednn, openmp
from tailserve.model.linear import Linear

log = logging.getLogger(__name__)


def reserve_kernel_cache(budget_tokens: int) -> int:
    """Before the first oneDNN primitive of a build: room for every prompt-row kernel of a step
    budget (`warm_runner`). Returns the cache capacity in force."""
    return onednn.reserve_cache(onednn.cache_entries_for(budget_tokens))


def release_loading_thread() -> None:
    """Let the calling thread's OpenMP workers exit (it loaded the model; the steps run elsewhere)."""
    openmp.release_pool()


def warm_runner(runner: ModelRunner, budget_tokens: int, capacity: int) -> WarmResult:
    """Create the prompt-row kernels of every row count `budget_tokens` allows, so serving compiles
    none and its memory does not grow with the prompt lengths it meets. Call it on the thread that
    runs the steps; no-op under tensor parallelism (the workers hold their own shards) and where
    nothing runs through oneDNN."""
    if runner.tp is not None:
        return WarmResult(0, 0, 0.0)
    # oneDNN keys a kernel by its thread count, which it reads from this thread's OpenMP setting:
    # the core count until torch's first parallel op here sets torch's own, so set it first.
    torch.set_num_threads(runner.num_threads or torch.get_num_threads())
    done = warm_prompt_rows(runner.model.prompt_linears(), budget_tokens, capacity)
    if done.shapes:
        log.info(
            "created oneDNN's prompt-row kernels for %d weight shapes x 2..%d rows in %.1f s",
            done.shapes, done.max_rows, done.seconds,
        )  # fmt: skip
    return done


@dataclass(frozen=True)
class WarmResult:
    shapes: int  # distinct packed weight shapes
    max_rows: int  # row counts 2..max_rows of each were created
    seconds: float


@torch.inference_mode()
def warm_prompt_rows(linears: Iterable[Linear], budget_tokens: int, capacity: int) -> WarmResult:
    """Run every packed weight shape among `linears` once at each prompt-row count a step of
    `budget_tokens` can have (one row runs as two: Linear.prefill_matmul), so oneDNN has created
    its kernel for each before a request arrives. Stops short where the cache could not keep them."""
    by_shape: dict[tuple[int, int, bool], Linear] = {}
    for linear in linears:
        if linear.onednn is not None:
            by_shape.setdefault((linear.in_features, linear.out_features, linear.bias is not None), linear)
    if not by_shape:
        return WarmResult(0, 0, 0.0)
    fits = (capacity - onednn.CACHE_HEADROOM) // (onednn.ENTRIES_PER_KERNEL * len(by_shape)) + 1
    max_rows = min(budget_tokens, onednn.MAX_WARM_ROWS, fits)
    if max_rows < min(budget_tokens, onednn.MAX_WARM_ROWS):
        log.warning(
            "oneDNN's primitive cache (%s=%d) holds prompt-row kernels up to %d rows of a %d-token step "
            "budget; larger steps compile theirs on first use and memory grows while serving",
            onednn.CAPACITY_ENV, capacity, max_rows, budget_tokens,
        )  # fmt: skip
    start = time.perf_counter()
    for linear in by_shape.values():
        x = torch.zeros(max_rows, linear.in_features, dtype=linear.activation_dtype)
        for rows in range(2, max_rows + 1):
            linear.prefill_matmul(x[:rows])
    return WarmResult(len(by_shape), max_rows, time.perf_counter() - start)
