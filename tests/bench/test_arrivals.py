"""Arrival processes: the drawn schedules have the distribution and rate they claim."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from tailserve.bench.arrivals import ArrivalSpec, schedule_offsets
from tailserve.bench.errors import BenchConfigError


def gaps_of(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


def test_poisson_schedule_is_exponential_at_the_rate() -> None:
    rate = 50.0
    offsets = schedule_offsets(ArrivalSpec("poisson", rate), np.random.default_rng(1), 20000, None)
    assert offsets[0] == 0.0 and len(offsets) == 20000
    gaps = gaps_of(offsets)
    assert (gaps >= 0).all()
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    assert len(offsets) / offsets[-1] == pytest.approx(rate, rel=0.03)


def test_gamma_burstiness_sets_the_spread() -> None:
    rate, shape = 20.0, 0.25
    offsets = schedule_offsets(
        ArrivalSpec("gamma", rate, burstiness=shape), np.random.default_rng(2), 20000, None
    )
    gaps = gaps_of(offsets)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Gamma with shape k has coefficient of variation 1/sqrt(k): 2.0 here (Poisson: 1.0).
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)
    assert stats.kstest(gaps, "gamma", args=(shape, 0, 1 / (rate * shape))).pvalue > 0.01


def test_constant_rate_and_duration_mode() -> None:
    offsets = schedule_offsets(ArrivalSpec("constant", 4.0), np.random.default_rng(0), None, 10.0)
    assert offsets == pytest.approx([i * 0.25 for i in range(40)])


def test_ramp_rate_rises_linearly() -> None:
    spec = ArrivalSpec("ramp", rate_per_s=10.0, ramp_to_per_s=50.0, ramp_duration_s=1000.0)
    offsets = np.asarray(schedule_offsets(spec, np.random.default_rng(3), None, 1000.0))
    # Expected count in [a, b] is the integral of the rate; check the first and last fifths.
    first = (offsets < 200).sum()
    last = (offsets >= 800).sum()
    assert first == pytest.approx(200 * 14.0, rel=0.06)  # mean rate 14/s over 0-200 s
    assert last == pytest.approx(200 * 46.0, rel=0.04)  # mean rate 46/s over 800-1000 s
    assert len(offsets) == pytest.approx(30000, rel=0.03)


def test_bad_arrival_specs_are_refused() -> None:
    with pytest.raises(BenchConfigError):
        ArrivalSpec("poisson", 0.0)
    with pytest.raises(BenchConfigError):
        ArrivalSpec("ramp", 1.0)
    with pytest.raises(BenchConfigError):
        ArrivalSpec("weekly", 1.0)
