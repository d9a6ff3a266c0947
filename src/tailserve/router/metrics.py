"""The router's own Prometheus metrics, in a per-app registry (never the global one).

Names are the contract in docs/INTERFACES.md; dashboards and alerts read them. A `replica` label is
the replica's index in --replica order, never its URL: /metrics is open, replica URLs are internal.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# From 5 ms to 10 min: a routed request lasts as long as its whole generation.
DURATION_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass(frozen=True)
class RouterMetrics:
    """Every router metric, registered in `registry`."""

    registry: CollectorRegistry
    requests: Counter
    duration_s: Histogram
    retries: Counter
    replica_healthy: Gauge
    decisions: Counter
    in_flight: Gauge

    @classmethod
    def create(cls) -> RouterMetrics:
        """A fresh registry with every metric in it (two apps in one process do not collide)."""
        registry = CollectorRegistry(auto_describe=True)
        return cls(
            registry=registry,
            requests=Counter(
                "tailserve_router_requests",
                "Attempts forwarded to a replica, by outcome (HTTP status or error kind).",
                ["replica", "status"],
                registry=registry,
            ),
            duration_s=Histogram(
                "tailserve_router_request_duration_seconds",
                "Time from forwarding an attempt to its last byte.",
                ["replica"],
                buckets=DURATION_BUCKETS_S,
                registry=registry,
            ),
            retries=Counter(
                "tailserve_router_retries",
                "Attempts re-sent to another replica after a failure before any byte reached the client.",
                registry=registry,
            ),
            replica_healthy=Gauge(
                "tailserve_router_replica_healthy",
                "1 while the replica receives traffic, 0 while it is taken out.",
                ["replica"],
                registry=registry,
            ),
            decisions=Counter(
                "tailserve_router_decisions",
                "Placement decisions, by policy and the reason for the choice.",
                ["policy", "reason"],
                registry=registry,
            ),
            in_flight=Gauge(
                "tailserve_router_replica_in_flight",
                "Requests this router has outstanding on the replica.",
                ["replica"],
                registry=registry,
            ),
        )

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
