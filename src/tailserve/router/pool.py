"""The replicas' state: health (with thresholds), in-flight counts and the last load snapshot.

Health changes happen here only, whether from a periodic /ready check or from a failure the
proxy saw on a live request (a refused connection or garbage takes a replica out at once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tailserve.router.config import RouterConfig
from tailserve.router.load import LoadSnapshot, load_score
from tailserve.router.metrics import RouterMetrics
from tailserve.router.policies import Candidate

log = logging.getLogger("tailserve.router")


@dataclass
class Replica:
    """One upstream server as the router sees it."""

    url: str
    index: int = 0  # position in the configured list: what clients see instead of the internal URL
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    in_flight: int = 0
    snapshot: LoadSnapshot | None = None
    last_change_reason: str = "not checked yet"

    @property
    def label(self) -> str:
        """The replica's name in metric labels: its index, since /metrics is open and URLs are internal."""
        return str(self.index)


class ReplicaPool:
    """All replicas of one router; the only place their health and counters change."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.replicas = [Replica(url, index) for index, url in enumerate(config.replicas)]
        self._by_url = {r.url: r for r in self.replicas}
        for replica in self.replicas:
            metrics.replica_healthy.labels(replica.label).set(0)
            metrics.in_flight.labels(replica.label).set(0)

    def get(self, url: str) -> Replica:
        """The replica with this URL."""
        return self._by_url[url]

    def healthy(self) -> list[Replica]:
        """Replicas currently receiving traffic, in configured order."""
        return [r for r in self.replicas if r.healthy]

    def candidates(self, exclude: set[str]) -> list[Candidate]:
        """Healthy replicas not in `exclude`, each with its current load score."""
        now_s = time.monotonic()
        stale_after_s = max(5 * self._config.load_interval_s, 2 * self._config.health_interval_s)
        out = []
        for r in self.healthy():
            if r.url in exclude:
                continue
            snapshot = r.snapshot
            if snapshot is not None and now_s - snapshot.read_at_s > stale_after_s:
                snapshot = None
            out.append(Candidate(r.url, load_score(snapshot, r.in_flight, self._config.load_weights)))
        return out

    def set_initial(self, replica: Replica, ready: bool) -> None:
        """The first check at startup decides directly, without thresholds."""
        replica.consecutive_successes = 1 if ready else 0
        replica.consecutive_failures = 0 if ready else 1
        self._set_healthy(replica, ready, "initial check")

    def record_check(self, replica: Replica, ready: bool, detail: str = "") -> None:
        """Fold one /ready result in; flips health only after the configured run of results."""
        if ready:
            replica.consecutive_successes += 1
            replica.consecutive_failures = 0
            if not replica.healthy and replica.consecutive_successes >= self._config.healthy_threshold:
                self._set_healthy(replica, True, "ready again")
        else:
            replica.consecutive_failures += 1
            replica.consecutive_successes = 0
            if replica.healthy and replica.consecutive_failures >= self._config.unhealthy_threshold:
                self._set_healthy(replica, False, detail or "failed /ready checks")

    def take_out(self, replica: Replica, reason: str) -> None:
        """Remove a replica now (it refused a connection or sent garbage); checks put it back."""
        replica.consecutive_successes = 0
        replica.consecutive_failures = max(replica.consecutive_failures, self._config.unhealthy_threshold)
        if replica.healthy:
            self._set_healthy(replica, False, reason)

    def acquire(self, replica: Replica) -> None:
        """Count a request the router is about to send to `replica`."""
        replica.in_flight += 1
        self._metrics.in_flight.labels(replica.label).set(replica.in_flight)

    def release(self, replica: Replica) -> None:
        """The request sent to `replica` is over (finished, failed or abandoned)."""
        replica.in_flight = max(0, replica.in_flight - 1)
        self._metrics.in_flight.labels(replica.label).set(replica.in_flight)

    def _set_healthy(self, replica: Replica, healthy: bool, reason: str) -> None:
        if replica.healthy != healthy:
            log.warning("replica %s %s (%s)", replica.url, "back in" if healthy else "taken out", reason)
        replica.healthy = healthy
        replica.last_change_reason = reason
        self._metrics.replica_healthy.labels(replica.label).set(1 if healthy else 0)
