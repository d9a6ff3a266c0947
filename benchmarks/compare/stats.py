"""The statistics the comparison's verdicts rest on: distribution-free percentile intervals from
binomial order statistics, binomial proportion intervals, and three-way verdicts from intervals
("met", "missed", or "not enough data" when an interval straddles the bound). Pure arithmetic on
lists of numbers; no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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


def _binom_cdfs(n: int, p: float) -> list[float]:
    """[P(B <= k) for k in 0..n], B ~ Binomial(n, p), each term in log space (n in the thousands is fine)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    total, cdfs = 0.0, []
    for i in range(n + 1):
        log_pmf = (
            math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        )
        total += math.exp(log_pmf)
        cdfs.append(min(total, 1.0))
    return cdfs


def order_stat_ranks(n: int, q: float, confidence: float = CONFIDENCE) -> tuple[int | None, int | None]:
    """1-based ranks (l, u) of the sorted sample with P(x(l) <= quantile_q <= x(u)) >= confidence,
    each tail holding at most (1 - confidence) / 2; None where no rank of n values reaches it
    (the quantile is then unbounded on that side: too few values that far out)."""
    tail = (1.0 - confidence) / 2.0
    cdf = _binom_cdfs(n, q)
    # x(u) < quantile only if at least u values fall below it: P = 1 - P(B <= u - 1), B ~ Bin(n, q).
    upper = next((u for u in range(1, n + 1) if cdf[u - 1] >= 1.0 - tail), None)
    # x(l) > quantile only if fewer than l values fall at or below it: P = P(B <= l - 1).
    lower = next((lo for lo in range(n, 0, -1) if cdf[lo - 1] <= tail), None)
    return lower, upper


def min_count_bounded(q: float, confidence: float = CONFIDENCE) -> int:
    """The fewest values whose q-quantile interval has an upper end (for P99 at 95%: 368)."""
    # The upper end exists once P(B <= n - 1) = 1 - q^n >= 1 - tail, i.e. q^n <= tail.
    return math.ceil(math.log((1.0 - confidence) / 2.0) / math.log(q))


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile as `tailserve bench` reports it: rank ceil(q * n) of the sorted values."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def quantile_interval(values: Sequence[float], q: float, confidence: float = CONFIDENCE) -> Interval:
    """The nearest-rank q-quantile with its distribution-free interval."""
    n = len(values)
    if n == 0:
        return Interval(None, None, None, 0)
    ordered = sorted(values)
    lower, upper = order_stat_ranks(n, q, confidence)
    return Interval(
        nearest_rank(ordered, q),
        ordered[lower - 1] if lower else None,
        ordered[upper - 1] if upper else None,
        n,
    )


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
