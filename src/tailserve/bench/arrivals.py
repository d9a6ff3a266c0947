"""Arrival processes: when each request is due, as offsets (seconds) from the start of the run.

Offsets are absolute (the runner sleeps until `start + offset`, never `previous + gap`), so a late
send never shifts the ones after it. Closed-loop runs have no schedule: `concurrency` workers
send back to back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tailserve.bench.errors import BenchConfigError

OPEN_LOOP_KINDS = ("poisson", "gamma", "constant", "ramp")
ARRIVAL_KINDS = (*OPEN_LOOP_KINDS, "closed", "trace")
_BATCH = 4096


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive.

    `burstiness` is the gamma shape (1 = Poisson, < 1 burstier, > 1 smoother; vLLM's convention).
    `ramp` goes linearly from `rate_per_s` to `ramp_to_per_s` over `ramp_duration_s` (None: over
    the whole run) as a non-homogeneous Poisson process, then holds `ramp_to_per_s`.
    """

    kind: str = "poisson"
    rate_per_s: float = 1.0
    burstiness: float = 1.0
    ramp_to_per_s: float | None = None
    ramp_duration_s: float | None = None
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise BenchConfigError(f"unknown arrival process {self.kind!r}; use one of {ARRIVAL_KINDS}")
        if self.kind in OPEN_LOOP_KINDS and not (self.rate_per_s > 0 or self.kind == "ramp"):
            raise BenchConfigError(f"{self.kind} arrivals need a rate > 0 (got {self.rate_per_s})")
        if self.kind == "gamma" and not self.burstiness > 0:
            raise BenchConfigError("gamma burstiness must be > 0")
        if self.kind == "ramp" and (self.ramp_to_per_s is None or self.ramp_to_per_s <= 0):
            raise BenchConfigError("ramp arrivals need --ramp-to RATE > 0")
        if self.kind == "closed" and self.concurrency < 1:
            raise BenchConfigError("closed-loop concurrency must be >= 1")

    @property
    def open_loop(self) -> bool:
        """True when requests are sent on a schedule rather than as previous ones finish."""
        return self.kind != "closed"

    def describe(self) -> str:
        """One line for the summary."""
        if self.kind == "closed":
            return f"closed loop, concurrency {self.concurrency}"
        if self.kind == "gamma":
            return f"gamma {self.rate_per_s:g} req/s, burstiness {self.burstiness:g}"
        if self.kind == "ramp":
            return f"ramp {self.rate_per_s:g} -> {self.ramp_to_per_s:g} req/s"
        if self.kind == "trace":
            return "trace replay"
        return f"{self.kind} {self.rate_per_s:g} req/s"


def schedule_offsets(
    spec: ArrivalSpec,
    rng: np.random.Generator,
    max_requests: int | None,
    duration_s: float | None,
) -> list[float]:
    """Send offsets for an open-loop run: the first at 0, stopping at `max_requests` or `duration_s`."""
    if spec.kind not in OPEN_LOOP_KINDS:
        raise BenchConfigError(f"{spec.kind} arrivals have no precomputed schedule")
    if max_requests is None and duration_s is None:
        raise BenchConfigError("give a number of requests or a duration")
    if spec.kind == "ramp":
        return _ramp_offsets(spec, rng, max_requests, duration_s)
    offsets: list[float] = [0.0]
    while True:
        gaps = _gaps(spec, rng, _BATCH)
        for gap in gaps:
            nxt = offsets[-1] + float(gap)
            if max_requests is not None and len(offsets) >= max_requests:
                return offsets
            if duration_s is not None and nxt >= duration_s:
                return offsets
            offsets.append(nxt)


def _gaps(spec: ArrivalSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """Inter-arrival gaps of a homogeneous process."""
    mean_gap = 1.0 / spec.rate_per_s
    if spec.kind == "poisson":
        return rng.exponential(mean_gap, size=n)
    if spec.kind == "gamma":
        return rng.gamma(spec.burstiness, mean_gap / spec.burstiness, size=n)
    return np.full(n, mean_gap)


def _ramp_offsets(
    spec: ArrivalSpec, rng: np.random.Generator, max_requests: int | None, duration_s: float | None
) -> list[float]:
    """Non-homogeneous Poisson with a linear rate ramp, by inverting the cumulative rate."""
    r0, r1 = spec.rate_per_s, float(spec.ramp_to_per_s or 0.0)
    ramp_s = spec.ramp_duration_s or duration_s
    if ramp_s is None:
        # Count mode without a ramp length: stretch the ramp so the expected count is max_requests.
        ramp_s = 2.0 * float(max_requests or 1) / (r0 + r1)
    offsets: list[float] = []
    unit_time = 0.0
    while True:
        for gap in rng.exponential(1.0, size=_BATCH):
            t = _invert_ramp(unit_time, r0, r1, ramp_s)
            if max_requests is not None and len(offsets) >= max_requests:
                return offsets
            if duration_s is not None and t >= duration_s:
                return offsets
            offsets.append(t)
            unit_time += float(gap)


def _invert_ramp(cumulative: float, r0: float, r1: float, ramp_s: float) -> float:
    """Time t where the integral of the ramp rate from 0 to t equals `cumulative`."""
    at_end = (r0 + r1) / 2.0 * ramp_s
    if cumulative >= at_end:
        return ramp_s + (cumulative - at_end) / r1
    a = (r1 - r0) / (2.0 * ramp_s)
    if abs(a) < 1e-12:
        return cumulative / r0
    return (-r0 + math.sqrt(r0 * r0 + 4.0 * a * cumulative)) / (2.0 * a)
