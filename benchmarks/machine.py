"""Where a benchmark ran, as it records it beside its numbers: the machine in one line and the
tailserve commit. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
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
