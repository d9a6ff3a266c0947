"""The queue-depth autoscaling policy for Ray Serve: replicas follow the requests waiting in the
engines (not Ray's count of ongoing requests), up to seat what waits and down only when the rest
fits in one replica fewer at half occupancy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from tailserve.integrations.ray_autoscaling import (  # noqa: E402
    RUNNING,
    SLOTS,
    WAITING,
    QueueDepthPolicy,
    desired_replicas,
)


@pytest.mark.parametrize(
    ("current", "waiting", "running", "expected"),
    [
        (1, 0, 4, 1),  # full but nothing waits: one replica serves it
        (1, 1, 4, 1),  # one waiting is within the target of 1 per replica
        (1, 2, 4, 2),  # 2 waiting, 4 slots a replica: one more seats them
        (1, 9, 4, 4),  # 9 waiting need 3 more replicas of 4 slots
        (2, 0, 2, 1),  # 2 running fit in one replica at half occupancy
        (2, 0, 3, 2),  # 3 would not
        (2, 0.5, 0, 2),  # something still waits: no scale-down
        (3, 0, 0, 2),  # one step down at a time
    ],
)
def test_desired_replicas(current: int, waiting: float, running: float, expected: int) -> None:
    assert desired_replicas(current, waiting, running, per_replica=4, target_waiting=1.0) == expected


def test_the_policy_reads_the_replicas_reports() -> None:
    policy = QueueDepthPolicy(target_waiting=1)
    reports = {WAITING: {"a": 3.0, "b": 2.0}, RUNNING: {"a": 4.0, "b": 4.0}, SLOTS: {"a": 4.0, "b": 4.0}}
    ctx = SimpleNamespace(aggregated_metrics=reports, current_num_replicas=2, target_num_replicas=2)
    assert policy(ctx) == (4, {})  # type: ignore[arg-type]  # 5 waiting over 4-slot replicas: 2 more
    silent = SimpleNamespace(aggregated_metrics={}, current_num_replicas=1, target_num_replicas=1)
    assert policy(silent) == (1, {})  # type: ignore[arg-type]  # nothing reported yet: keep the target
