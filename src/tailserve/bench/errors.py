"""Typed errors of `tailserve bench`; the CLI maps each to a message and an exit code in one place.

Per-request failures are not exceptions: they are recorded on the request (`RequestRecord.error_kind`).
"""

from __future__ import annotations


class BenchError(Exception):
    """Base of every error the benchmark raises on purpose."""

    exit_code = 1


class BenchConfigError(BenchError):
    """The command line or a preset asks for something impossible (exit 2)."""

    exit_code = 2


class TraceFileError(BenchConfigError):
    """A trace file has lines that cannot be replayed; `problems` lists them with line numbers."""

    def __init__(self, path: str, problems: list[str]) -> None:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        super().__init__(f"trace file {path}: {len(problems)} bad line(s):\n  {shown}{more}")
        self.problems = problems


class TargetError(BenchError):
    """The target server cannot be benchmarked: unreachable, auth refused, model not served (exit 1)."""


class ResultFileError(BenchError):
    """A result JSON cannot be read back (missing, not JSON, wrong schema version)."""

    exit_code = 2
