"""Distribution-free confidence intervals for percentiles, from binomial order statistics.

For n values of any continuous distribution, the number B of values below the true q-th quantile is
Binomial(n, q/100), so the order statistics (x_(l), x_(u)) bracket it with probability
P(l <= B <= u - 1). No distribution is assumed; ties make the coverage only larger. Pure math, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_CI_LEVEL = 0.95
# The pmf is summed over mean +- this many standard deviations (plus a margin); outside, the mass
# is far below double precision, which keeps ITL intervals over 10^5-10^6 tokens cheap.
_WINDOW_SIGMAS = 12.0
_WINDOW_MARGIN = 30


def binom_pmf(k: int, n: int, p: float) -> float:
    """P(B = k) for B ~ Binomial(n, p), in log space (no overflow for large n)."""
    if k < 0 or k > n:
        return 0.0
    if p <= 0.0 or p >= 1.0:
        return float(k == (0 if p <= 0.0 else n))
    log_pmf = (
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    return math.exp(log_pmf)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(B <= k) for B ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    lo, hi = _window(n, p)
    if k < lo:
        return 0.0
    return min(1.0, math.fsum(binom_pmf(j, n, p) for j in range(lo, min(k, hi) + 1)))


def _window(n: int, p: float) -> tuple[int, int]:
    sd = math.sqrt(n * p * (1.0 - p))
    half = int(_WINDOW_SIGMAS * sd) + _WINDOW_MARGIN
    mean = int(n * p)
    return max(0, mean - half), min(n, mean + half)


def order_stat_ranks(n: int, q: float, level: float = DEFAULT_CI_LEVEL) -> tuple[int | None, int | None]:
    """1-based ranks (l, u) of the order-statistic interval covering the q-th percentile at `level`.

    Equal-tailed: l is the largest rank with P(B <= l - 1) <= alpha/2 and u the smallest with
    P(B >= u) <= alpha/2, B ~ Binomial(n, q/100), so the coverage P(l <= B <= u - 1) >= level.
    When one tail cannot be had (too few values: e.g. P99 of fewer than 368 at 95%), that end is the
    extreme value (rank 1 or n) and the other end takes the rest of alpha. When no finite pair reaches
    the level, the one-sided bound: (l, None) meaning [x_(l), +inf) with P(B >= l) >= level, or
    (None, u) meaning (-inf, x_(u)] with P(B <= u - 1) >= level, or (None, None).
    """
    if n < 1 or not 0.0 < q < 100.0 or not 0.0 < level < 1.0:
        raise ValueError(f"need n >= 1, 0 < q < 100, 0 < level < 1 (got {n}, {q}, {level})")
    p = q / 100.0
    lo, hi = _window(n, p)
    # cdf[j] = P(B <= j) for j in [lo - 1, hi]; below the window it is 0, above it 1.
    cdf: dict[int, float] = {lo - 1: 0.0}
    running = 0.0
    for j in range(lo, hi + 1):
        running += binom_pmf(j, n, p)
        cdf[j] = min(1.0, running)

    def below(j: int) -> float:  # P(B <= j)
        if j < lo:
            return 0.0
        return 1.0 if j > hi else cdf[j]

    half = (1.0 - level) / 2.0
    # Ranks outside the window behave like its edges (below() is flat there), so searching it suffices.
    ranks = range(max(1, lo), min(n, hi + 2) + 1)
    lower = next((k for k in reversed(ranks) if below(k - 1) <= half), None)
    upper = next((k for k in ranks if 1.0 - below(k - 1) <= half), None)
    if lower is not None and upper is not None:
        return lower, upper
    if upper is None and lower is not None:  # the upper tail is too thin: the maximum closes it
        lower = next((k for k in reversed(ranks) if below(n - 1) - below(k - 1) >= level), None)
        if lower is not None:
            return lower, n
    if lower is None and upper is not None:  # the lower tail is too thin: the minimum closes it
        upper = next((k for k in ranks if below(k - 1) - below(0) >= level), None)
        if upper is not None:
            return 1, upper
    if n > 1 and below(n - 1) - below(0) >= level:
        return 1, n
    one_sided_lower = next((k for k in reversed(ranks) if 1.0 - below(k - 1) >= level), None)
    if one_sided_lower is not None:
        return one_sided_lower, None
    return None, next((k for k in ranks if below(k - 1) >= level), None)


def percentile_interval(
    sorted_values: Sequence[float], q: float, level: float = DEFAULT_CI_LEVEL
) -> tuple[float | None, float | None]:
    """The [lo, hi] values of `order_stat_ranks` on already-sorted data; None for a missing end."""
    if not sorted_values:
        return None, None
    lo_rank, hi_rank = order_stat_ranks(len(sorted_values), q, level)
    lo = None if lo_rank is None else float(sorted_values[lo_rank - 1])
    hi = None if hi_rank is None else float(sorted_values[hi_rank - 1])
    return lo, hi


def min_count_for_upper_bound(q: float, level: float = DEFAULT_CI_LEVEL) -> int:
    """Smallest n for which the q-th percentile has a finite upper end (1 - p^n - (1-p)^n >= level)."""
    p = q / 100.0
    n = 1
    while 1.0 - p**n - (1.0 - p) ** n < level:
        n += 1
    return n


def intervals_overlap(
    a: tuple[float | None, float | None], b: tuple[float | None, float | None]
) -> bool | None:
    """True / False when the intervals' known ends settle it, None when an unbounded end leaves it open."""
    a_lo, a_hi = a
    b_lo, b_hi = b
    if a_hi is not None and b_lo is not None and a_hi < b_lo:
        return False
    if b_hi is not None and a_lo is not None and b_hi < a_lo:
        return False
    if None in (a_lo, a_hi, b_lo, b_hi):
        return None
    return True
