"""Memory probe for a `tailserve serve` process, loaded by Python's `site` hook (issue 15's soak RSS).

Put this folder on PYTHONPATH and set TS_MEMPROBE=FILE.jsonl: a `tailserve serve` started with
that environment appends one JSON line every TS_MEMPROBE_EVERY seconds (default 30) with its RSS,
glibc's heap figures (mallinfo2: bytes in use, bytes free but kept, bytes mmapped) and, when
TS_MEMPROBE_FRAMES > 0, tracemalloc's count of Python allocations. TS_MEMPROBE_SNAP="300,900"
saves a tracemalloc snapshot at those seconds (FILE.snap-300 ...) for `benchmarks/server_memory.py`
to diff; TS_MEMPROBE_TRIM_AT=SECONDS calls malloc_trim(0) once then and records RSS before and
after, which measures how much of the growth is freed memory the allocator kept. Every other
process (the bench client, the harness) ignores it. Diagnostic only: nothing in tailserve imports it.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import tracemalloc


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )  # fmt: skip
    ]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _heap(libc: ctypes.CDLL) -> dict[str, int]:
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {
        "heap_total": info.arena,  # bytes the arenas got from the OS (brk and arena mmaps)
        "heap_in_use": info.uordblks,
        "heap_free_kept": info.fordblks,
        "mmapped": info.hblkhd,  # large chunks mmapped one by one (returned on free)
        "mmapped_chunks": info.hblks,
    }


def _probe(path: str, every_s: float, snaps: list[float], trim_at: float | None) -> None:
    libc = ctypes.CDLL("libc.so.6")
    t0 = time.monotonic()
    pending = sorted(snaps)
    trimmed = trim_at is None
    with open(path, "a", buffering=1) as out:
        while True:
            t = time.monotonic() - t0
            row: dict[str, object] = {"t": round(t, 1), "rss": _rss_bytes(), **_heap(libc)}
            row["threads"] = threading.active_count()
            if tracemalloc.is_tracing():
                row["py_traced"], row["py_peak"] = tracemalloc.get_traced_memory()
            while pending and t >= pending[0]:
                at = pending.pop(0)
                if tracemalloc.is_tracing():
                    tracemalloc.take_snapshot().dump(f"{path}.snap-{at:g}")
                    row["snapshot"] = at
            if not trimmed and t >= (trim_at or 0):
                trimmed = True
                before = _rss_bytes()
                libc.malloc_trim(0)
                row["trim"] = {"rss_before": before, "rss_after": _rss_bytes(), "heap_after": _heap(libc)}
            out.write(json.dumps(row) + "\n")
            time.sleep(every_s)


def _start() -> None:
    path = os.environ.get("TS_MEMPROBE")
    if not path or len(sys.argv) < 2 or sys.argv[1] != "serve":
        return
    frames = int(os.environ.get("TS_MEMPROBE_FRAMES", "0"))
    if frames > 0:
        tracemalloc.start(frames)
    snaps = [float(s) for s in os.environ.get("TS_MEMPROBE_SNAP", "").split(",") if s]
    trim = os.environ.get("TS_MEMPROBE_TRIM_AT")
    every = float(os.environ.get("TS_MEMPROBE_EVERY", "30"))
    args = (path, every, snaps, float(trim) if trim else None)
    threading.Thread(target=_probe, args=args, name="memprobe", daemon=True).start()


_start()
