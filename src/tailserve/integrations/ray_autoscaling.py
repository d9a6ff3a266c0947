"""A Ray Serve autoscaling policy on the engines' own queues: replicas are added when requests wait
in the engines (admitted, no sequence slot yet), not when Ray's count of ongoing requests passes a
target it cannot relate to an engine's capacity. Reads the custom metrics each engine replica
reports (EngineReplica.record_autoscaling_stats); Ray applies min/max bounds and delays after it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ray.serve.config import AutoscalingContext

# The custom metrics an engine replica reports, each averaged by Ray over `look_back_period_s`.
WAITING = "engine_waiting"  # requests admitted and waiting for a sequence slot (or KV blocks)
RUNNING = "engine_running"  # requests holding a sequence slot
SLOTS = "engine_slots"  # the replica's max_num_seqs
POLICY_PATH = "tailserve.integrations.ray_autoscaling:QueueDepthPolicy"


def desired_replicas(
    current: int, waiting: float, running: float, per_replica: float, target_waiting: float
) -> int:
    """Replicas for the engines' totals over `current` replicas of `per_replica` sequence slots.
    Requests waiting beyond `target_waiting` per replica: enough more replicas to seat them. Nothing
    waiting and the running requests fit in one replica fewer at half occupancy: one fewer. Else
    as is."""
    if current < 1 or per_replica <= 0:
        return current
    if waiting > target_waiting * current:
        return current + math.ceil(waiting / per_replica)
    if waiting == 0 and current > 1 and running <= 0.5 * per_replica * (current - 1):
        return current - 1
    return current


class QueueDepthPolicy:
    """Ray's custom-policy callable (`AutoscalingPolicy(policy_function=POLICY_PATH,
    policy_kwargs={"target_waiting": 1.0})`): `desired_replicas` over the replicas' reports."""

    def __init__(self, target_waiting: float = 1.0) -> None:
        self._target_waiting = float(target_waiting)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        if not metrics.get(SLOTS):  # no replica has reported yet
            return ctx.target_num_replicas, {}
        waiting, running, slots = (sum(metrics.get(name, {}).values()) for name in (WAITING, RUNNING, SLOTS))
        per_replica = slots / len(metrics[SLOTS])
        current = ctx.current_num_replicas
        return desired_replicas(current, waiting, running, per_replica, self._target_waiting), {}
