"""`tailserve bench` as a subprocess: one invocation, its exit code and its result JSON.

Every benchmark drives load through the project's own generator (never an ad-hoc client), so all
of them measure TTFT/TPOT the same way. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import cpu_shares, cpu_times
from proc import stop_process_group

ROOT = Path(__file__).resolve().parents[1]
TAILSERVE = ROOT / ".venv" / "bin" / "tailserve"


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One finished `tailserve bench` invocation."""

    exit_code: int  # 0 ok, 3 an SLO failed (--fail-on-slo), 130 interrupted
    wall_s: float
    json_path: Path
    log_path: Path
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    interrupted: bool = False  # stopped at its deadline (it still writes what it measured)
    cpu: dict[str, float] | None = None  # busy / idle / steal shares of the machine's CPU time during it

    def result(self) -> dict[str, Any] | None:
        """The result document, or None when the run wrote none."""
        return load_json(self.json_path)


def load_json(path: str | Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data


def suffixed(prefix: Path, extension: str) -> Path:
    """PREFIX + extension (Path.with_suffix would eat the `.5` of `rate-0.5`)."""
    return prefix.with_name(prefix.name + extension)


def raise_priority() -> None:
    """The load generator outranks everything else on a shared box, so a starved client is not
    mistaken for a slow server (it uses ~1% of a core). Needs root; ignored otherwise."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -5)


def run_bench(
    args: Sequence[str],
    out_prefix: Path,
    action: str = "run",
    deadline_s: float | None = None,
    tailserve: Sequence[str] = (str(TAILSERVE),),
) -> BenchRun:
    """`tailserve bench ACTION ARGS --out OUT_PREFIX`; its console output goes to OUT_PREFIX.txt.
    `tailserve` is the command that runs the CLI (default: this checkout's .venv/bin/tailserve).

    Past `deadline_s` the bench gets SIGINT (it cancels what is in flight and still writes its
    result); Ctrl-C of the bench itself is passed up as KeyboardInterrupt."""
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*tailserve, "bench", action, *args, "--out", str(out_prefix), "--no-progress"]
    log_path = suffixed(out_prefix, ".txt")
    load_before = os.getloadavg()
    times_before = cpu_times()
    start = time.monotonic()
    interrupted = False
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=raise_priority,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            interrupted = True
            stop_process_group(proc, grace_s=30, sig=signal.SIGINT)
        except KeyboardInterrupt:
            stop_process_group(proc, grace_s=30, sig=signal.SIGINT)
            raise
    if proc.returncode == 130 and not interrupted:
        raise KeyboardInterrupt
    return BenchRun(
        exit_code=proc.returncode,
        wall_s=time.monotonic() - start,
        json_path=suffixed(out_prefix, ".json"),
        log_path=log_path,
        load_before=load_before,
        load_after=os.getloadavg(),
        interrupted=interrupted,
        cpu=cpu_shares(times_before, cpu_times()),
    )
