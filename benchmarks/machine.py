"""Where a benchmark ran, as it records it beside its numbers: the machine in one line and the
tailserve commit. Standard library only.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import platform
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine_line() -> str:
    """Host, CPU count and model, memory, OS, e.g. `vm: 2 x AMD EPYC, 24 GiB, Linux-6.18...`."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {os.cpu_count()} x {cpu}, {mem_gib:.0f} GiB, {platform.platform()}"


def git_commit() -> str:
    """The checkout's short commit hash ('?' outside git)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "?"


def cpu_times() -> tuple[int, ...]:
    """The machine's cumulative CPU time counters (/proc/stat `cpu`: user nice system idle iowait
    irq softirq steal), in clock ticks; empty where /proc is absent."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return ()
    return tuple(int(x) for x in first[1:9]) if first and first[0] == "cpu" else ()


def cpu_shares(before: Sequence[int], after: Sequence[int]) -> dict[str, float] | None:
    """Shares of all CPU time between two `cpu_times()`: busy (user + nice + system + irq + softirq),
    idle (idle + iowait) and steal, the time the hypervisor gave this VM's CPUs to someone else.
    Steal slows every server alike only if it is spread evenly; in bursts it makes tails. None
    when either reading is missing."""
    if len(before) < 8 or len(after) < 8:
        return None
    d = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(d)
    if total <= 0:
        return None
    busy = d[0] + d[1] + d[2] + d[5] + d[6]
    return {"busy": busy / total, "idle": (d[3] + d[4]) / total, "steal": d[7] / total}


class CpuLog:
    """Appends the machine's CPU counters once a second to `path` (`<unix time> cpu <counters>`, the
    format of `echo "$(date +%s.%N) $(head -1 /proc/stat)"`) on a daemon thread, while in use. A
    run's P99 is set by its slowest 1% of requests, and on a VM a burst of steal of a few seconds is
    enough to make them: the log lets a report ask what the machine did while they waited."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s = path, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self.path.open("a") as f:
            while not self._stop.is_set():
                if counters := cpu_times():
                    f.write(f"{time.time():.3f} cpu {' '.join(map(str, counters))}\n")
                    f.flush()
                self._stop.wait(self.every_s)


def read_cpu_log(path: Path) -> list[tuple[float, tuple[int, ...]]]:
    """(unix time, the eight counters) of every whole line of a CpuLog file, in time order."""
    samples = []
    with contextlib.suppress(OSError), path.open() as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 10 and parts[1] == "cpu":
                with contextlib.suppress(ValueError):
                    samples.append((float(parts[0]), tuple(int(x) for x in parts[2:10])))
    samples.sort()
    return samples


def steal_between(samples: Sequence[tuple[float, tuple[int, ...]]], t0: float, t1: float) -> float | None:
    """The steal share of CPU time from the last sample at or before t0 to the first at or after t1
    (None when the log does not cover the span)."""
    times = [t for t, _ in samples]
    i, j = bisect.bisect_right(times, t0) - 1, bisect.bisect_left(times, t1)
    if i < 0 or j >= len(samples) or j <= i:
        return None
    shares = cpu_shares(samples[i][1], samples[j][1])
    return None if shares is None else shares["steal"]
