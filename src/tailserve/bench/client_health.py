"""Did the load generator keep up with its own schedule: send rate, CPU, client-side queueing and
event-loop lag, judged once a run ends (docs/BENCH.md "Is the client the bottleneck?").

Reads the run's records; sends nothing. A client that fell behind makes the figures its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.bench.records import RequestRecord
from tailserve.bench.stats import nearest_rank

# Client health thresholds (docs/BENCH.md "Is the client the bottleneck?").
RATE_SHORTFALL = 0.05
CPU_SATURATED = 0.90
# Sends late by this much on a tenth of requests is a client that cannot keep up; on only a few
# it is a hiccup (a busy machine) worth a note but not a verdict.
CLIENT_QUEUE_LIMIT_S = 0.05
# The event loop waking this late (p99) delays every chunk it reads by as much: TTFT, ITL and E2E
# then measure the client. A few milliseconds are worth a note; this much is a verdict.
LOOP_LAG_LIMIT_S = 0.010
LOOP_LAG_NOTE_S = 0.002


@dataclass(frozen=True)
class ClientHealth:
    """Whether the client kept up with the schedule; `bottleneck` says the numbers are the client's."""

    target_rate_per_s: float | None
    scheduled_rate_per_s: float | None
    achieved_rate_per_s: float | None
    cpu_util: float
    loop_lag_p99_s: float | None
    client_queue_p99_s: float | None
    bottleneck: bool
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    # Loop lag at p50/p95/p99: how much of each measured latency percentile could be client delay.
    client_delay_s: dict[str, float] = field(default_factory=dict)
    # The sends fell behind (rate short, CPU saturated, requests queued on the client): the server saw
    # less load than scheduled. False where the only reason is the loop's lag, which only adds to the
    # latencies measured (a pass stands; a fail stands where it is wider than the lag).
    late_sends: bool = False


def client_health(
    records: list[RequestRecord], loop_lags: list[float], cpu_util: float, target_rate_per_s: float | None
) -> ClientHealth:
    """Did the client keep up: send rate, CPU, client-side queueing and event-loop lag."""
    first_turns = [r for r in records if r.scheduled_s is not None and r.error_kind != "cancelled"]
    scheduled_rate = _rate([r.scheduled_s or 0.0 for r in first_turns])
    achieved_rate = _rate([r.sent_s for r in first_turns])
    lags = sorted(loop_lags)
    queues = sorted(r.client_queue_s for r in first_turns)
    delay = {f"p{p:g}": nearest_rank(lags, p) for p in (50.0, 95.0, 99.0)} if lags else {}
    lag_p99 = delay.get("p99")
    queue_p90 = nearest_rank(queues, 90.0) if queues else None
    queue_p99 = nearest_rank(queues, 99.0) if queues else None
    reasons, notes = [], []
    if scheduled_rate and achieved_rate is not None and achieved_rate < (1 - RATE_SHORTFALL) * scheduled_rate:
        reasons.append(
            f"achieved {achieved_rate:.2f} req/s, more than {RATE_SHORTFALL:.0%} short of the "
            f"scheduled {scheduled_rate:.2f} req/s"
        )
    if cpu_util >= CPU_SATURATED:
        reasons.append(f"client CPU saturated ({cpu_util:.0%} of one core)")
    if queue_p90 is not None and queue_p90 > CLIENT_QUEUE_LIMIT_S:
        reasons.append(f"requests waited on the client: p90 {queue_p90 * 1000:.0f} ms past their due time")
    elif queue_p99 is not None and queue_p99 > CLIENT_QUEUE_LIMIT_S:
        notes.append(
            f"a few sends were late (client queueing p99 {queue_p99 * 1000:.0f} ms): a busy machine?"
        )
    late_sends = bool(reasons)
    if lag_p99 is not None and lag_p99 > LOOP_LAG_NOTE_S:
        shown = " / ".join(f"{v * 1000:.1f}" for v in delay.values())
        line = (
            f"the client's event loop woke up late (p50/p95/p99 {shown} ms): up to that much of the "
            "p50/p95/p99 of TTFT, ITL and E2E could be client delay"
        )
        (reasons if lag_p99 > LOOP_LAG_LIMIT_S else notes).append(line)
    return ClientHealth(
        target_rate_per_s,
        scheduled_rate,
        achieved_rate,
        cpu_util,
        lag_p99,
        queue_p99,
        bool(reasons),
        reasons,
        notes,
        delay,
        late_sends,
    )


def _rate(times: list[float]) -> float | None:
    """Events per second between the first and the last of `times` (None for fewer than 2)."""
    if len(times) < 2:
        return None
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else None
