"""The statistics the comparison's verdicts rest on: distribution-free percentile intervals (those of
`tailserve bench`, tailserve/bench/intervals.py), binomial proportion intervals, and three-way verdicts from intervals
("met", "missed", or "not enough data" when an interval straddles the bound). Pure arithmetic on
lists of numbers; no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tailserve.bench.intervals import percentile_interval
from tailserve.bench.stats import nearest_rank

CONFIDENCE = 0.95  # two-sided, for every interval the comparison shows

MET, MISSED, NOT_ENOUGH = "MET", "MISSED", "not enough data"


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with its interval; an end is None when the data cannot bound it."""

    value: float | None
    low: float | None
    high: float | None
    count: int

    @property
    def bounded(self) -> bool:
        return self.low is not None and self.high is not None

    def scaled(self, factor: float) -> Interval:
        def s(x: float | None) -> float | None:
            return None if x is None else x * factor

        return Interval(s(self.value), s(self.low), s(self.high), self.count)


def min_count_bounded(q: float, confidence: float = CONFIDENCE) -> int:
    """The fewest values whose q-quantile interval has an equal-tailed upper end (for P99 at 95%: 368):
    below that, `tailserve bench` closes the interval at the maximum, the weakest upper end there is.
    The harness sizes its points and windows to this count."""
    # The upper tail has a rank of its own once P(B <= n - 1) = 1 - q^n >= 1 - tail, i.e. q^n <= tail.
    return math.ceil(math.log((1.0 - confidence) / 2.0) / math.log(q))


def quantile_interval(values: Sequence[float], q: float, confidence: float = CONFIDENCE) -> Interval:
    """The nearest-rank q-quantile (0 < q < 1) with its distribution-free interval, computed by
    `tailserve bench`'s own code, so the harness and the bench can never disagree."""
    if not values:
        return Interval(None, None, None, 0)
    ordered = sorted(values)
    low, high = percentile_interval(ordered, 100.0 * q, confidence)
    return Interval(nearest_rank(ordered, 100.0 * q), low, high, len(ordered))


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """A proportion with its Wilson score interval."""
    if n == 0:
        return Interval(None, None, None, 0)
    z = _z(confidence)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), n)


def _z(confidence: float) -> float:
    """The standard normal quantile at (1 + confidence) / 2, by bisection on erf."""
    target, lo, hi = (1.0 + confidence) / 2.0, 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < target else (lo, mid)
    return (lo + hi) / 2


def at_most(interval: Interval, bound: float) -> str:
    """Is the quantity <= bound? MET when the whole interval is, MISSED when none of it is."""
    if interval.high is not None and interval.high <= bound:
        return MET
    if interval.low is not None and interval.low > bound:
        return MISSED
    return NOT_ENOUGH


def at_least(interval: Interval, bound: float) -> str:
    """Is the quantity >= bound? MET when the whole interval is, MISSED when none of it is."""
    if interval.low is not None and interval.low >= bound:
        return MET
    if interval.high is not None and interval.high < bound:
        return MISSED
    return NOT_ENOUGH


def compare(a: Interval, b: Interval) -> str:
    """ "lower", "higher" (a against b) when the intervals are apart, else NOT_ENOUGH."""
    if a.high is not None and b.low is not None and a.high < b.low:
        return "lower"
    if a.low is not None and b.high is not None and a.low > b.high:
        return "higher"
    return NOT_ENOUGH
