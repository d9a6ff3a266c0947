"""Poisson arrivals as actually sent to a server: the right distribution, the right rate, no drift."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from tests.bench.conftest import FakeServerProcess, run_bench

RATE = 50.0


def test_sent_poisson_arrivals_fit_and_reach_the_rate(fake_server: FakeServerProcess) -> None:
    fake_server.script([{"ttft_s": 0.005, "itl_s": 0.002, "tokens": 2}])
    # Seed 0 fixes the drawn schedule, so what varies between runs is only the client's timing.
    result, records = run_bench(
        [
            "--base-url", fake_server.url, "--arrival", "poisson", "--rate", str(RATE), "-n", "400",
            "--warmup", "0", "--input-len", "fixed:16", "--output-len", "fixed:2", "--no-progress", "--seed", "0",
        ]
    )  # fmt: skip
    assert result["counts"]["ok"] == 400
    client = result["client"]
    # The client's own work is light whatever else runs on the machine ...
    assert client["cpu_util"] < 0.5
    # ... but when other processes starve it of CPU, its event loop wakes late (measured by a probe
    # independent of the send path), due sends bunch up and no timing claim can be checked.
    lag = client["loop_lag_p99_s"] or 0.0
    if client["bottleneck"] or lag > 0.01:
        pytest.skip(
            f"machine oversubscribed: client event loop lag p99 {lag * 1e3:.0f} ms; {client['reasons']}"
        )
    sent = np.sort([r.sent_s for r in records])
    gaps = np.diff(sent)
    assert stats.kstest(gaps, "expon", args=(0, 1 / RATE)).pvalue > 0.01
    achieved = (len(sent) - 1) / (sent[-1] - sent[0])
    assert achieved == pytest.approx(RATE, rel=0.05)
    assert result["client"]["achieved_rate_per_s"] == pytest.approx(achieved)
    # Absolute clock: lateness does not accumulate along the run.
    lateness = [r.client_queue_s for r in sorted(records, key=lambda r: r.index)]
    assert np.median(lateness) < 0.005
    assert np.median(lateness[-50:]) < 0.005
    assert result["metrics"]["client_queue_s"]["count"] == 400
