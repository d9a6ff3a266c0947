"""oneDNN's prompt-row kernels: created for every row count before serving, not during it.

The bf16 prompt rows run through torch's oneDNN inner product over weights packed once
(Linear.pack_for_cpu). oneDNN compiles a kernel per exact shape and keeps it in a process-wide LRU
cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, 1024 unless set), ~0.6 MiB each on Zen 4. A
server's steps have every prompt-row count from 2 to the step budget, so its memory grew for half an
hour as a varied load reached new counts: +490 MiB of glibc heap in use over a 15-minute soak, with
Python's own allocations flat (benchmarks/memprobe, issue 15). `warm_prompt_rows` creates them all
at start-up, where the KV pool's memory is taken too. This module never changes a kernel's result.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tailserve.model.linear import Linear

log = logging.getLogger(__name__)

CAPACITY_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
DEFAULT_CAPACITY = 1024  # oneDNN's own default
MAX_WARM_ROWS = 512  # past this a budget's kernels would take GiBs: larger row counts compile on first use
CACHE_HEADROOM = 256  # entries left for everything else that runs through oneDNN (reorders, other GEMMs)
ENTRIES_PER_KERNEL = 2  # a bf16 inner product runs on a nested matmul primitive, cached beside it


def cache_entries_for(budget_tokens: int, shapes: int = 4) -> int:
    """Primitive-cache entries that hold `shapes` weight shapes' prompt-row kernels for every row
    count of a step budget (4: a decoder layer's qkv, o, gate_up and down), plus headroom."""
    return ENTRIES_PER_KERNEL * shapes * (min(budget_tokens, MAX_WARM_ROWS) - 1) + CACHE_HEADROOM


def reserve_cache(entries: int) -> int:
    """Ask oneDNN for a primitive cache of at least `entries`; returns the capacity in force as far as
    this process can tell. oneDNN reads the variable when it creates its first primitive, so this
    only counts before that (an engine calls it before building its model); a value already in the
    environment, set by the user or by an earlier engine, is left alone."""
    current = os.environ.get(CAPACITY_ENV)
    if current is None:
        capacity = max(entries, DEFAULT_CAPACITY)
        os.environ[CAPACITY_ENV] = str(capacity)
        return capacity
    try:
        return int(current)
    except ValueError:
        return DEFAULT_CAPACITY


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
    fits = (capacity - CACHE_HEADROOM) // (ENTRIES_PER_KERNEL * len(by_shape)) + 1
    max_rows = min(budget_tokens, MAX_WARM_ROWS, fits)
    if max_rows < min(budget_tokens, MAX_WARM_ROWS):
        log.warning(
            "oneDNN's primitive cache (%s=%d) holds prompt-row kernels up to %d rows of a %d-token step "
            "budget; larger steps compile theirs on first use and memory grows while serving",
            CAPACITY_ENV, capacity, max_rows, budget_tokens,
        )  # fmt: skip
    start = time.perf_counter()
    for linear in by_shape.values():
        x = torch.zeros(max_rows, linear.in_features, dtype=linear.activation_dtype)
        for rows in range(2, max_rows + 1):
            linear.prefill_matmul(x[:rows])
    return WarmResult(len(by_shape), max_rows, time.perf_counter() - start)
