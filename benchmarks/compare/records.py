"""What a comparison run is made of and what it records: the SLO, the load plan, one record per
`tailserve bench` invocation and one outcome per server, all plain dataclasses saved as JSON
(summary.json), so `--render` can rebuild the report from disk.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loadgen import load_json

EQUAL_THROUGHPUT = 0.10  # two runs have "equal throughput" when output tok/s differ by at most this
REFERENCE = "ts-slo"  # ratios and the reference rate are relative to this server
ALL_SERVERS = ("ts-slo", "ts-fcfs", "vllm", "llamacpp", "llamacpp-1t", "hf-cb", "hf")  # the order they run in


@dataclasses.dataclass(frozen=True)
class Slo:
    """The CPU-scaled SLO every run is judged by (P99 targets, as `tailserve bench` computes them)."""

    ttft_s: float = 8.0
    tpot_ms: float = 150.0
    error_rate: float = 0.01


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much load, for how long: the full run or the quick smoke run."""

    rates: tuple[float, ...]
    duration_s: float
    warmup_s: float
    timeout_s: float
    probe_s: float
    probe_warmup_s: float
    tolerance: float
    rate_max: float
    reference_fraction: float
    reference_s: float  # the reference run sends `reference_requests`, for at most this long
    reference_requests: int
    calibration_requests: int


FULL = Plan((0.2, 0.5, 1.2), 25.0, 0.0, 40.0, 25.0, 0.0, 0.25, 3.2, 0.8, 100.0, 16, 1)
QUICK = Plan((0.4,), 15.0, 0.0, 30.0, 12.0, 0.0, 0.6, 0.8, 0.8, 15.0, 4, 1)


@dataclasses.dataclass
class RunRecord:
    """One `tailserve bench` invocation and where its result went."""

    kind: str  # warmup | calibration | rate | capacity | reference
    rate: float | None
    json_path: str
    exit_code: int
    wall_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]


@dataclasses.dataclass
class ServerOutcome:
    """Everything measured on one server (or why it could not be)."""

    key: str
    label: str
    command: str
    env: dict[str, str]
    notes: str
    extra_body: dict[str, Any]
    bench_args: list[str]
    startup_s: float | None = None
    error: str | None = None
    runs: list[RunRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class BenchContext:
    """What every bench invocation shares."""

    out_dir: Path
    seed: int
    slo: Slo
    plan: Plan


def run_of(outcome: ServerOutcome, kind: str, rate: float | None = None) -> dict[str, Any] | None:
    """The result document of the outcome's first run of `kind` (at `rate`, when given)."""
    for run in outcome.runs:
        if run.kind == kind and (rate is None or run.rate == rate):
            return load_json(run.json_path)
    return None


def capacity_of(outcome: ServerOutcome) -> float | None:
    """The highest rate the capacity search found meeting the SLO (0 when none did)."""
    data = run_of(outcome, "capacity")
    if data and data.get("capacity"):
        best = data["capacity"].get("max_rate_per_s")
        return float(best) if best is not None else 0.0
    return None


def in_order(outcomes: list[ServerOutcome]) -> list[ServerOutcome]:
    return sorted(outcomes, key=lambda o: ALL_SERVERS.index(o.key))


def outcome_from_dict(data: dict[str, Any]) -> ServerOutcome:
    return ServerOutcome(**{**data, "runs": [RunRecord(**r) for r in data["runs"]]})
