"""Where a benchmark ran, as it records it beside its numbers: the machine in one line and the
tailserve commit. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
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
