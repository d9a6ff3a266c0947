"""oneDNN's prompt-row kernels: created for every row count before serving, not during it.

The bf16 prompt rows run through torch's oneDNN inner product over weights packed once
(Linear.pack_for_cpu). oneDNN compiles a kernel per exact shape and keeps it in a process-wide LRU
cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY entries, 1024 unless set), ~0.6 MiB each on Zen 4. A
server's steps have every prompt-row count from 2 to the step budget, so its memory grew for half an
hour as a varied load reached new counts: +490 MiB of glibc heap in use over a 15-minute soak, with
Python's own allocations flat (benchmarks/memprobe, issue 15). executor/warmup.py creates them all
at start-up (executor/warmup.py), where the KV pool's memory is taken too. This module sizes
oneDNN's cache; it never changes a kernel's result.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

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


@functools.cache
def bf16_packs() -> bool:
    """Whether torch's oneDNN can pack and run bf16 weights here (Linear.pack_for_cpu). Its bf16
    reorder needs AVX-512 BW, VL and DQ or AVX-NE-CONVERT: an AVX2-only CPU (AMD Zen 3 seen) has
    neither and raises on the first reorder, so there bf16 prompt rows stay on F.linear."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else True
