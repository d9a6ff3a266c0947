"""A replica's live load: the gauges read from its /metrics, folded into one comparable score.

Between two reads the router corrects the snapshot with its own in-flight count, so a burst of
requests placed in the same interval does not all land on the replica that looked idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.router.config import LoadWeights

WAITING = "tailserve_requests_waiting"
RUNNING = "tailserve_requests_running"
KV_USAGE = "tailserve_kv_cache_usage_ratio"
PREFIX_HIT_RATE = "tailserve_prefix_cache_hit_rate"
LOAD_GAUGES = (WAITING, RUNNING, KV_USAGE, PREFIX_HIT_RATE)


@dataclass(frozen=True)
class LoadSnapshot:
    """One read of a replica's /metrics, with the router's in-flight count at that moment."""

    waiting: float
    running: float
    kv_usage: float
    prefix_hit_rate: float
    in_flight_at_read: int
    read_at_s: float  # monotonic clock


def parse_gauges(text: str, names: tuple[str, ...] = LOAD_GAUGES) -> dict[str, float]:
    """Sum of each named metric's samples in Prometheus text format (labels ignored)."""
    wanted = set(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        name = head.partition("{")[0]
        if name not in wanted:
            continue
        if "{" in head and "}" not in head:  # a label value with a space: the value follows the brace
            _, _, rest = line.partition("} ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def snapshot_from_metrics(text: str, in_flight: int, now_s: float) -> LoadSnapshot | None:
    """A snapshot from /metrics text; None when the replica exposes none of the load gauges."""
    gauges = parse_gauges(text)
    if WAITING not in gauges and RUNNING not in gauges:
        return None
    return LoadSnapshot(
        waiting=gauges.get(WAITING, 0.0),
        running=gauges.get(RUNNING, 0.0),
        kv_usage=gauges.get(KV_USAGE, 0.0),
        prefix_hit_rate=gauges.get(PREFIX_HIT_RATE, 0.0),
        in_flight_at_read=in_flight,
        read_at_s=now_s,
    )


def load_score(snapshot: LoadSnapshot | None, in_flight: int, weights: LoadWeights) -> float:
    """Estimated load in requests: the last read plus what the router sent (or saw finish) since.

    Without a (fresh) snapshot the router's own in-flight count is all it knows.
    """
    if snapshot is None:
        return float(in_flight)
    drift = in_flight - snapshot.in_flight_at_read
    score = (
        weights.waiting_weight * snapshot.waiting
        + weights.running_weight * snapshot.running
        + drift
        + weights.kv_weight * snapshot.kv_usage
    )
    # What this router itself has in flight there is a floor: those requests are surely on it.
    return max(score, float(in_flight))
