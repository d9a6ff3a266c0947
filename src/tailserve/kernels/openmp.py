"""The OpenMP runtime that torch (and the fused CPU kernels, bound to the same copy) run their threads on.

libgomp gives every thread that opens a parallel region its own pool of workers, and between
regions a worker spins before it sleeps, but only briefly once the process holds more libgomp
threads than it has CPUs: then every region waits for its workers to be woken from a futex. A
model loaded on one thread leaves that thread's pool behind; when the steps then run on another
thread (the server's engine thread) with a pool of its own, the two pools together cross that
line on a small machine. On 2 cores a 375-token prompt took 104 ms on the loading thread and 168
ms on a new one, torch's prompt attention 2.5x as long (retired benchmarks/openmp_pools.py;
docs/notes/tail-under-slo.md).
`release_pool` lets the calling thread's workers exit; a later parallel region on that thread
starts a new pool, so it is always safe, only useless while the thread keeps computing.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_kind: free the threads themselves, not only their state


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None (another OpenMP runtime, or none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        if Path(path).name.startswith("libgomp") and ".so" in path:
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle, no second copy
            except OSError:
                return None
            if not hasattr(lib, "omp_pause_resource_all"):
                return None  # libgomp older than OpenMP 5.0
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_pool() -> bool:
    """Let the calling thread's OpenMP workers exit (libgomp's omp_pause_resource_all).

    Call it on the thread that loaded the model before another thread runs the steps. Returns
    whether a pool could be released (False without libgomp, or inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    released = int(lib.omp_pause_resource_all(OMP_PAUSE_HARD)) == 0
    log.debug("OpenMP pool of this thread %s", "released" if released else "not released")
    return released
