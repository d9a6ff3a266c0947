"""Percentile intervals from binomial order statistics: exact binomial math (checked against scipy),
coverage by simulation, the sample sizes below which an end does not exist, and overlap verdicts."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from tailserve.bench.intervals import (
    binom_cdf,
    intervals_overlap,
    min_count_for_upper_bound,
    order_stat_ranks,
    percentile_interval,
)


@pytest.mark.parametrize(("n", "p"), [(10, 0.5), (300, 0.99), (1000, 0.9), (50_000, 0.99), (7, 0.05)])
def test_binomial_cdf_matches_scipy(n: int, p: float) -> None:
    ks = sorted({0, 1, n // 3, n // 2, int(n * p) - 1, int(n * p), n - 2, n - 1, n})
    for k in ks:
        assert binom_cdf(k, n, p) == pytest.approx(sps.binom.cdf(k, n, p), abs=1e-9)


def coverage(n: int, q: float, lo: int | None, hi: int | None) -> float:
    """Exact coverage of [x_(lo), x_(hi)] for the q-th percentile, from scipy."""
    p = q / 100
    upper = sps.binom.cdf(hi - 1, n, p) if hi is not None else 1.0
    lower = sps.binom.cdf(lo - 1, n, p) if lo is not None else 0.0
    return float(upper - lower)


@pytest.mark.parametrize(
    ("n", "q"), [(20, 50.0), (40, 90.0), (100, 50.0), (368, 99.0), (1000, 95.0), (10**5, 99.0)]
)
def test_interval_is_equal_tailed_as_scipy_gives_it(n: int, q: float) -> None:
    lo, hi = order_stat_ranks(n, q, 0.95)
    assert lo is not None and hi is not None
    assert coverage(n, q, lo, hi) >= 0.95
    # Each tail holds at most 2.5%: l = binom.ppf(0.025), u = binom.ppf(0.975) + 1.
    assert (lo, hi) == (int(sps.binom.ppf(0.025, n, q / 100)), int(sps.binom.ppf(0.975, n, q / 100)) + 1)


def test_a_thin_upper_tail_is_closed_by_the_maximum() -> None:
    # 300 values: no rank above the P99 leaves only 2.5% in the upper tail; the maximum closes the
    # interval and the lower end takes the rest of the 5%.
    lo, hi = order_stat_ranks(300, 99.0)
    assert hi == 300 and lo is not None and coverage(300, 99.0, lo, hi) >= 0.95
    assert order_stat_ranks(367, 99.0)[1] == 367 and order_stat_ranks(368, 99.0)[1] == 368
    assert order_stat_ranks(1000, 99.0)[1] == 997  # plenty of values: below the maximum


def test_p99_upper_end_exists_only_from_299_values_at_95() -> None:
    assert min_count_for_upper_bound(99.0, 0.95) == 299
    assert min_count_for_upper_bound(95.0, 0.95) == 59
    assert min_count_for_upper_bound(50.0, 0.95) == 6
    # 298 values: only a lower bound for P99 ([x_(l), +inf)), and that bound holds at 95%.
    lo, hi = order_stat_ranks(298, 99.0)
    assert hi is None and lo is not None and coverage(298, 99.0, lo, None) >= 0.95
    lo, hi = order_stat_ranks(299, 99.0)
    assert hi == 299 and lo is not None  # from 299 on, the maximum is the upper end
    # 23 requests: their P99 is their maximum, and its interval has no upper end.
    values = sorted(float(v) for v in range(23))
    low, high = percentile_interval(values, 99.0)
    assert high is None and low is not None and low < 22.0


def test_interval_covers_the_true_p99_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(0)
    n, trials = 300, 2000
    true_p99 = -np.log(0.01)  # exponential(1)
    samples = np.sort(rng.exponential(1.0, size=(trials, n)), axis=1)
    lo, hi = order_stat_ranks(n, 99.0)
    assert lo is not None and hi is not None
    covered = (samples[:, lo - 1] <= true_p99) & (true_p99 <= samples[:, hi - 1])
    exact = coverage(n, 99.0, lo, hi)
    assert 0.95 <= exact < 0.96
    assert 0.935 <= covered.mean() <= 0.97
    # The same through the function the bench calls, on one sample.
    assert percentile_interval(list(samples[0]), 99.0) == (samples[0, lo - 1], samples[0, hi - 1])


def test_intervals_for_a_million_values_are_cheap_and_tight() -> None:
    lo, hi = order_stat_ranks(1_000_000, 50.0)
    assert lo is not None and hi is not None and 0 < hi - lo < 3000
    assert coverage(1_000_000, 50.0, lo, hi) >= 0.95


def test_overlap_verdicts() -> None:
    assert intervals_overlap((1.0, 2.0), (1.5, 3.0)) is True
    assert intervals_overlap((1.0, 2.0), (2.5, 3.0)) is False
    assert intervals_overlap((2.5, None), (1.0, 2.0)) is False  # a known end can still settle it
    assert intervals_overlap((1.0, None), (1.5, 3.0)) is None
    assert intervals_overlap((None, None), (1.0, 2.0)) is None
