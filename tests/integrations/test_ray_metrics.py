"""The engine's /metrics page (as prometheus_client writes it) as Ray metrics: the mirrored values
are the page's, and a histogram with the page's bounds gains exactly what each of the page's
buckets gained since the last export."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from tailserve.integrations.ray_metrics import bucket_points, read_page  # noqa: E402

PAGE = """# TYPE tailserve_requests_running gauge
tailserve_requests_running 3.0
# TYPE tailserve_requests_waiting gauge
tailserve_requests_waiting 1.0
# TYPE tailserve_requests_rejected_total counter
tailserve_requests_rejected_total{reason="slo"} 2.0
tailserve_requests_rejected_created{reason="slo"} 1.7e+09
# TYPE tailserve_time_to_first_token_seconds histogram
tailserve_time_to_first_token_seconds_bucket{le="0.1"} 4.0
tailserve_time_to_first_token_seconds_bucket{le="0.5"} 6.0
tailserve_time_to_first_token_seconds_bucket{le="+Inf"} 7.0
tailserve_time_to_first_token_seconds_count 7.0
tailserve_time_to_first_token_seconds_sum 3.2
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
"""


def test_the_page_values_are_read() -> None:
    page = read_page(PAGE)
    assert page.gauges == {"tailserve_requests_running": 3.0, "tailserve_requests_waiting": 1.0}
    assert page.counters == {("tailserve_requests_rejected", "slo"): 2.0}
    assert page.buckets["tailserve_time_to_first_token_seconds"] == [
        (0.1, 4.0),
        (0.5, 6.0),
        (float("inf"), 7.0),
    ]


def test_observations_land_in_the_buckets_that_grew() -> None:
    rows = read_page(PAGE).buckets["tailserve_time_to_first_token_seconds"]
    assert bucket_points(rows, {}) == [(0.05, 4), (0.3, 2), (1.0, 1)]
    before = {0.1: 3.0, 0.5: 5.0, float("inf"): 7.0}  # one more under 0.1 since: nothing else moved
    assert bucket_points(rows, before) == [(0.05, 1)]
