"""`bench capacity`: the highest Poisson request rate whose run still meets every SLO.

Ramp (multiply the rate until a run fails), then bisect between the last pass and the first fail
until the bracket is within `tolerance`. Each probe is a full, independent run; the search itself is
pure and takes the probe as a callback, so it is tested without a server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from tailserve.bench.errors import BenchConfigError

# When the start rate already fails, try this many lower rates (each / growth) before giving up.
_MAX_DOWN_STEPS = 3


@dataclass(frozen=True)
class CapacitySearch:
    """Search bounds: start at `start_rate`, multiply by `growth` up to `max_rate`, then bisect. The
    bounds have no default here: `bench capacity`'s --rate-start and --rate-max state them."""

    start_rate: float
    max_rate: float
    growth: float = 2.0
    tolerance: float = 0.05
    max_bisections: int = 6

    def __post_init__(self) -> None:
        if not (0 < self.start_rate <= self.max_rate) or self.growth <= 1.0 or not 0 < self.tolerance < 1:
            raise BenchConfigError(
                "capacity search needs 0 < start <= max rate, growth > 1, 0 < tolerance < 1"
            )


@dataclass(frozen=True)
class CapacityPoint:
    """One probe run at one offered rate."""

    rate_per_s: float
    achieved_rate_per_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p99_s: float | None
    goodput_per_s: float | None
    error_rate: float | None
    passed: bool
    client_bottleneck: bool
    status: str
    ttft_p99_ci: tuple[float | None, float | None] = (None, None)
    tpot_p99_ci: tuple[float | None, float | None] = (None, None)
    e2e_p99_ci: tuple[float | None, float | None] = (None, None)
    passed_upper: bool = False
    latency_count: int | None = None  # requests with a TTFT: what the P99 and its interval rest on


def point_from_result(rate: float, result: dict[str, Any], conservative: bool = False) -> CapacityPoint:
    """Read a probe's result document into a curve point. `passed_upper`: every latency SLO is met by
    its P99 interval's upper end (false when an interval has none); `conservative` makes that the pass."""
    metrics = result["metrics"]
    client = result.get("client") or {}
    measured = result["counts"]["measured"]

    def p99(key: str) -> float | None:
        summary = metrics.get(key)
        return summary["p99"] if summary else None

    def ci(key: str) -> tuple[float | None, float | None]:
        bounds = (metrics.get(key) or {}).get("p99_ci") or (None, None)
        return bounds[0], bounds[1]

    passed = bool(result["slo"]["all_pass"]) and result["status"] == "complete"
    upper = passed and all(
        v.get("passed_upper") is True for v in result["slo"]["verdicts"] if "passed_upper" in v
    )

    return CapacityPoint(
        rate_per_s=rate,
        achieved_rate_per_s=client.get("achieved_rate_per_s"),
        ttft_p99_s=p99("ttft_s"),
        tpot_p99_s=p99("tpot_s"),
        e2e_p99_s=p99("e2e_s"),
        goodput_per_s=result["slo"]["goodput_per_s"],
        error_rate=result["counts"]["failed"] / measured if measured else None,
        passed=upper if conservative else passed,
        client_bottleneck=_client_limits(result, client, upper if conservative else passed, conservative),
        status=result["status"],
        ttft_p99_ci=ci("ttft_s"),
        tpot_p99_ci=ci("tpot_s"),
        e2e_p99_ci=ci("e2e_s"),
        passed_upper=upper,
        latency_count=(metrics.get("ttft_s") or {}).get("count"),
    )


async def find_capacity(
    search: CapacitySearch, probe: Callable[[float], Awaitable[CapacityPoint]]
) -> tuple[float | None, list[CapacityPoint], str | None]:
    """Return (highest passing rate or None, every probe in order, why the search stopped early or None)."""
    points: list[CapacityPoint] = []

    async def run(rate: float) -> CapacityPoint:
        point = await probe(rate)
        points.append(point)
        return point

    passed_at: float | None = None
    failed_at: float | None = None
    rate = search.start_rate
    # Ramp up while passing (or down, a few steps, while even the start rate fails).
    for _ in range(64):
        point = await run(rate)
        if point.status != "complete":
            return passed_at, points, f"probe at {rate:g} req/s {point.status}"
        if point.client_bottleneck and passed_at is None:
            return None, points, f"the client could not keep up at {rate:g} req/s, before any rate passed"
        if point.passed and not point.client_bottleneck:
            passed_at = rate
            if failed_at is not None:
                break
            if rate >= search.max_rate:
                return passed_at, points, f"still passing at --rate-max {search.max_rate:g} req/s"
            rate = min(rate * search.growth, search.max_rate)
        else:
            failed_at = rate
            if passed_at is not None:
                break
            if len(points) > _MAX_DOWN_STEPS:
                return None, points, f"even {rate:g} req/s misses the SLOs"
            rate /= search.growth
    assert passed_at is not None and failed_at is not None
    lo, hi = passed_at, failed_at
    for _ in range(search.max_bisections):
        if hi - lo <= search.tolerance * hi:
            break
        mid = (lo + hi) / 2
        point = await run(mid)
        if point.status != "complete":
            return lo, points, f"probe at {mid:g} req/s {point.status}"
        if point.passed and not point.client_bottleneck:
            lo = mid
        else:
            hi = mid
    return lo, points, _client_note(points)


def _client_note(points: list[CapacityPoint]) -> str | None:
    """A probe where the client could not keep up counts as a fail (its figures may be the client's):
    the bisection goes on below it, and the answer is a lower bound the note states."""
    limited = [p.rate_per_s for p in points if p.client_bottleneck]
    if not limited:
        return None
    return (
        f"the client could not keep up at {min(limited):g} req/s (counted as a fail there and above); "
        "the result is a lower bound"
    )


def _client_limits(result: dict[str, Any], client: dict[str, Any], passed: bool, conservative: bool) -> bool:
    """Whether the client may have set this probe's verdict. Late sends always may (the server saw
    less load). A late event loop only adds to the latencies measured, by at most its P99 lag: a pass
    stands, and so does a fail whose every missed latency target is missed by more than the lag (on
    a 2-core box a saturated server starves the client's loop: its lag must not end the search)."""
    if not client.get("bottleneck"):
        return False
    if client.get("late_sends", True):
        return True  # older documents have no `late_sends`: as before, the client may have
    if passed:
        return False
    lag = client.get("loop_lag_p99_s") or 0.0
    for verdict in result["slo"]["verdicts"]:
        if verdict["name"] == "error_rate":
            continue
        if conservative:
            bounds = verdict.get("observed_ci") or (None, None)
            observed, met = bounds[1], verdict.get("passed_upper") is True
        else:
            observed, met = verdict.get("observed"), bool(verdict.get("passed"))
        if not met and (observed is None or observed - lag <= verdict["threshold"]):
            return True
    return False


def capacity_section(
    best: float | None,
    points: list[CapacityPoint],
    note: str | None,
    slo_lines: dict[str, float],
    conservative: bool = False,
) -> dict[str, Any]:
    """The `capacity` object of a result document."""
    return {
        "max_rate_per_s": best,
        "points": [asdict(p) for p in points],
        "stopped_early": note,
        "slo_lines": slo_lines,
        "definition": "p99 interval upper ends within the SLOs" if conservative else "p99 within the SLOs",
    }
