"""What the comparison sends and how much of it: the two workloads, the request counts that give a
P99 an interval (and the durations they take at a rate), the capacity search's next probe, and the
rate points each server gets within its time budget. Pure: no servers, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from compare.stats import min_count_bounded

P99 = 0.99


@dataclasses.dataclass(frozen=True)
class Workload:
    """One `tailserve bench` workload: its length specs, turns and shared system prompt."""

    name: str
    title: str
    input_len: str
    output_len: str
    longest_tokens: int  # the longest prompt it sends (the TTFT target is set from its idle TTFT)
    turns: int = 1
    think_time_s: float = 0.0
    shared_prefix_tokens: int = 0
    prefix_caching: bool = False  # servers run with their prefix cache on for this workload
    calibration_input_len: str = ""  # the lengths calibrated (default: input_len)
    typical: tuple[int, int] = (300, 72)  # a typical request's prompt and output tokens (search start)

    @property
    def calibration_len(self) -> str:
        return self.calibration_input_len or self.input_len

    def bench_args(self) -> list[str]:
        args = ["--input-len", self.input_len, "--output-len", self.output_len]
        if self.turns > 1:
            args += ["--turns", str(self.turns), "--think-time", f"{self.think_time_s:g}"]
        if self.shared_prefix_tokens:
            args += [
                "--shared-prefix-tokens",
                str(self.shared_prefix_tokens),
                "--shared-prefix-fraction",
                "1",
            ]
        return args

    def arrival_rate(self, request_rate: float) -> float:
        """The bench's --rate (conversations/s) that offers `request_rate` requests/s."""
        return request_rate / self.turns


def scaled_workloads(scale: float = 1.0) -> dict[str, Workload]:
    """The two workloads with every length (prompts, shared prefix, new tokens per turn, outputs'
    upper end) multiplied by `scale`: the issue's shapes at 1; smaller on a slow box, where each
    request then costs less, so a point of 368 requests takes minutes instead of an hour. Outputs
    keep their lower end of 16 tokens."""
    if not 0.05 <= scale <= 4:
        raise ValueError(f"length scale {scale:g} outside 0.05-4")

    def n(tokens: int) -> int:
        return max(1, round(tokens * scale))

    out_max = max(17, n(128))
    mark = "" if scale == 1 else f" (lengths x{scale:g})"
    # 5% of prompts near 1500 tokens (+-5%, so at most ~1650); outputs 16-128 tokens.
    longtail = Workload(
        "longtail",
        f"long-tail chat{mark}: Poisson arrivals, prompts lognormal around {n(200)} tokens with 5% near "
        f"{n(1500)}, outputs 16-{out_max}",
        f"longtail:{n(200)},{n(1500)},0.05,0.5",
        f"uniform:16,{out_max}",
        longest_tokens=n(1650),
        typical=(n(300), (16 + out_max) // 2),
    )
    # A 400-token system prompt on every conversation, 3 turns of 64-256 new tokens each (the
    # history is resent, so the third turn's prompt is at most 400 + 3 x 256 + 2 x 128 = 1424).
    prefix, new_min, new_max = n(400), n(64), n(256)
    multiturn = Workload(
        "multiturn",
        f"shared-system-prompt multi-turn chat{mark}: {prefix}-token system prompt, 3 turns of "
        f"{new_min}-{new_max} new tokens (history resent), 1 s think time, outputs 16-{out_max}, "
        "conversations arrive Poisson",
        f"uniform:{prefix + new_min},{prefix + new_max}",
        f"uniform:16,{out_max}",
        longest_tokens=prefix + 3 * new_max + 2 * out_max,
        turns=3,
        think_time_s=1.0,
        shared_prefix_tokens=prefix,
        prefix_caching=True,
        typical=(n(300), (16 + out_max) // 2),
        # the first turn's lengths up to the third turn's longest
        calibration_input_len=f"uniform:{new_min},{prefix + 3 * new_max + 2 * out_max}",
    )
    return {w.name: w for w in (longtail, multiturn)}


WORKLOADS = scaled_workloads()
LONGTAIL, MULTITURN = WORKLOADS["longtail"], WORKLOADS["multiturn"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Measured requests per run, and the search's shape."""

    point_requests: int  # every rate point
    probe_requests: int  # every capacity probe
    warmup_requests: int  # sent first at each rate and excluded
    calibration_requests: int  # per calibration prompt length
    growth: float = 2.0
    tolerance: float = 0.15  # the search stops when the pass / fail bracket is this close
    max_probes: int = 7
    budget_s: float = 3 * 3600.0  # per server and workload: the rate points that fit, in order
    conservative: bool = True  # probes judged by the P99s' upper ends (quick runs: the points)
    # The first probe's rate per server key ("*": every server); unset: from one stream's service rate.
    rate_start: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if min(self.point_requests, self.probe_requests) < 1 or self.warmup_requests < 0:
            raise ValueError("request counts must be positive")
        if not (self.growth > 1 and self.tolerance > 0):
            raise ValueError("the search needs growth > 1 and tolerance > 0")
        if self.rate_start and min(self.rate_start.values()) <= 0:
            raise ValueError("a start rate must be positive")

    def start_for(self, key: str) -> float | None:
        """The first probe's rate given for server `key` (or for every server), else None."""
        starts = self.rate_start or {}
        return starts.get(key, starts.get("*"))


def parse_rate_start(text: str) -> dict[str, float]:
    """`--rate-start`: one rate for every server ("3.5"), or per server ("ts-slo=5.5,vllm=3.5"),
    or both ("3,vllm=3.5": 3 for the servers not named)."""
    starts: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        key, _, value = part.rpartition("=")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"not a rate: {part!r} (give RATE or SERVER=RATE)") from None
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"a start rate must be a positive number: {part!r}")
        if (key or "*") in starts:
            raise ValueError(f"given twice: {key or 'the default rate'}")
        starts[key or "*"] = rate
    return starts


def full_sizes(min_point: int = 300, min_probe: int = 200) -> Sizes:
    """The issue's minimums, raised to the count whose P99 interval has an upper end (368 at 95%):
    with fewer, the conservative capacity (upper ends within the SLO) could never pass."""
    bounded = min_count_bounded(P99)
    return Sizes(max(min_point, bounded), max(min_probe, bounded), 20, 3)


QUICK = Sizes(12, 10, 2, 1, growth=2.0, tolerance=0.5, max_probes=3, budget_s=240.0, conservative=False)


def expected_s(requests: int, rate: float, drain_s: float = 0.0) -> float:
    """Seconds a run of `requests` at `rate` req/s takes: sending, then the last one's service."""
    return requests / rate + drain_s


def next_probe(
    probes: Sequence[tuple[float, bool]],
    start: float,
    growth: float,
    tolerance: float,
    max_probes: int,
    rate_max: float,
) -> float | None:
    """The next rate the capacity search probes, given the probes so far (rate, passed), or None
    when it is done: ramp up by `growth` from `start` until a probe fails (down by it, at most 3
    times, while they fail from the start), then bisect the pass / fail bracket to `tolerance`."""
    if not probes:
        return start
    if len(probes) >= max_probes:
        return None
    passed = [r for r, ok in probes if ok]
    failed = [r for r, ok in probes if not ok]
    if not passed:
        return None if len(failed) > 3 else min(failed) / growth
    best = max(passed)
    above = [r for r in failed if r > best]
    if not above:
        return None if best >= rate_max else min(best * growth, rate_max)
    lowest_fail = min(above)
    if (lowest_fail - best) / best <= tolerance:
        return None
    return round((best + lowest_fail) / 2, 4)


def capacity_bracket(probes: Sequence[tuple[float, bool]]) -> tuple[float, float | None]:
    """(highest passing rate, lowest failing rate above it): the capacity lies in between; (0, ...)
    when nothing passed, (best, None) when nothing above it failed."""
    passed = [r for r, ok in probes if ok]
    best = max(passed, default=0.0)
    above = [r for r, ok in probes if not ok and r > best]
    return best, min(above, default=None)


@dataclasses.dataclass(frozen=True)
class RatePoint:
    """One measured rate: its name (the same for every server), the req/s, why it is there."""

    name: str
    rate: float
    why: str


# Multiples of the server's own capacity, in the order they are kept when time is short.
OWN_POINTS = (
    ("at-0.8x", 0.8, "80% of capacity"),
    ("over-2x", 2.0, "overload"),
    ("over-1.5x", 1.5, "overload"),
)
EXTRA_POINTS = (("at-0.5x", 0.5, "half of capacity"),)


def rate_points(
    capacity: float, reference_rate: float | None, sizes: Sizes, drain_s: float, spent_s: float
) -> tuple[list[RatePoint], list[tuple[RatePoint, float]]]:
    """The rate points one server runs after its capacity search (`spent_s` already used of its
    budget), and the ones left out with the seconds they would have taken. 80% of capacity is always
    run; then 2x and 1.5x (overload), the shared reference rate (80% of tailserve (slo)'s capacity),
    half of capacity, each while the budget holds."""
    candidates = [RatePoint(n, round(f * capacity, 4), w) for n, f, w in OWN_POINTS] if capacity > 0 else []
    if reference_rate:
        candidates.append(RatePoint("reference", reference_rate, "80% of tailserve (slo)'s capacity"))
    if capacity > 0:
        candidates += [RatePoint(n, round(f * capacity, 4), w) for n, f, w in EXTRA_POINTS]
    unique: list[RatePoint] = []
    for point in candidates:  # the reference rate of tailserve (slo) itself is its 80% point
        if all(abs(point.rate - other.rate) > 1e-9 for other in unique):
            unique.append(point)
    kept: list[RatePoint] = []
    dropped: list[tuple[RatePoint, float]] = []
    for point in unique:
        cost = expected_s(sizes.point_requests + sizes.warmup_requests, point.rate, drain_s)
        if not kept or spent_s + cost <= sizes.budget_s:
            kept.append(point)
            spent_s += cost
        else:
            dropped.append((point, cost))
    return kept, dropped


def search_start(idle_e2e_s: float) -> float:
    """The first probe: twice what one stream at a time could serve (continuous batching serves
    several; starting lower costs the most, since a probe's duration is its requests / its rate)."""
    return max(0.01, round(2.0 / idle_e2e_s, 3)) if idle_e2e_s > 0 and math.isfinite(idle_e2e_s) else 0.1
