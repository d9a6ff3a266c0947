"""Load scores from replica metrics, health thresholds of the pool, SSE checks, config validation."""

from __future__ import annotations

import asyncio

import pytest

from tailserve.errors import ConfigError
from tailserve.router.config import LoadWeights, RouterConfig
from tailserve.router.load import LoadSnapshot, load_score, parse_gauges, snapshot_from_metrics
from tailserve.router.metrics import RouterMetrics
from tailserve.router.pool import ReplicaPool
from tailserve.router.sse import MalformedStream, check_event, error_events, is_done, sse_events

METRICS_TEXT = """# HELP tailserve_requests_waiting Requests waiting.
# TYPE tailserve_requests_waiting gauge
tailserve_requests_waiting 3.0
tailserve_requests_running{model="m a"} 2.0
tailserve_requests_running{model="b"} 1.0
tailserve_kv_cache_usage_ratio 0.5
tailserve_prefix_cache_hit_rate 0.25
tailserve_requests_waiting_other 99
"""


def test_parse_gauges_sums_labelled_samples() -> None:
    gauges = parse_gauges(METRICS_TEXT)
    assert gauges == {
        "tailserve_requests_waiting": 3.0,
        "tailserve_requests_running": 3.0,
        "tailserve_kv_cache_usage_ratio": 0.5,
        "tailserve_prefix_cache_hit_rate": 0.25,
    }
    assert snapshot_from_metrics("# nothing here\n", 0, 0.0) is None


def test_load_score_weights_and_in_flight_correction() -> None:
    weights = LoadWeights(waiting_weight=2.0, running_weight=1.0, kv_weight=4.0)
    snap = snapshot_from_metrics(METRICS_TEXT, in_flight=2, now_s=0.0)
    assert snap is not None
    assert load_score(snap, 2, weights) == pytest.approx(2 * 3 + 3 + 4 * 0.5)
    # Three more sent since the read: they count before the next read shows them.
    assert load_score(snap, 5, weights) == pytest.approx(11 + 3)
    idle = LoadSnapshot(0, 0, 0, 0, in_flight_at_read=4, read_at_s=0.0)
    assert load_score(idle, 1, weights) == 1.0  # what the router has in flight is a floor
    assert load_score(None, 3, weights) == 3.0


def _pool(**overrides: object) -> ReplicaPool:
    config = RouterConfig(replicas=("http://a", "http://b"), **overrides)  # type: ignore[arg-type]
    return ReplicaPool(config, RouterMetrics.create())


def test_health_thresholds() -> None:
    pool = _pool(unhealthy_threshold=2, healthy_threshold=3)
    a, b = pool.replicas
    pool.set_initial(a, True)
    pool.set_initial(b, False)
    assert pool.healthy() == [a]
    pool.record_check(a, False)
    assert a.healthy  # one failure is not enough
    pool.record_check(a, True)
    pool.record_check(a, False)
    pool.record_check(a, False)
    assert not a.healthy
    for _ in range(2):
        pool.record_check(b, True)
    assert not b.healthy
    pool.record_check(b, True)
    assert b.healthy
    pool.take_out(b, "garbage")
    assert pool.healthy() == [] and pool.candidates(exclude=set()) == []


def test_candidates_carry_loads_and_exclude() -> None:
    pool = _pool()
    a, b = pool.replicas
    pool.set_initial(a, True)
    pool.set_initial(b, True)
    pool.acquire(a)
    pool.acquire(a)
    loads = {c.url: c.load for c in pool.candidates(exclude=set())}
    assert loads == {"http://a": 2.0, "http://b": 0.0}
    assert [c.url for c in pool.candidates(exclude={"http://a"})] == ["http://b"]
    pool.release(a)
    assert a.in_flight == 1


async def _chunks(parts: list[bytes]):  # type: ignore[no-untyped-def]
    for part in parts:
        yield part


def _events(parts: list[bytes]) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [e async for e in sse_events(_chunks(parts))]

    return asyncio.run(collect())


def test_sse_events_reassembles_split_events() -> None:
    parts = [b'data: {"a"', b": 1}\r\n\r\ndata: [DO", b"NE]\n\n"]
    assert _events(parts) == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    with pytest.raises(MalformedStream):
        _events([b'data: {"a": 1}\n\ndata: {"b"'])


def test_check_event() -> None:
    assert check_event(b'data: {"choices": []}\n\n')
    assert check_event(b": keep-alive\n\n")
    assert check_event(b"event: x\ndata: [DONE]\n\n")
    assert not check_event(b"data: {broken\n\n")
    assert not check_event(b"<html>\n\n")
    assert is_done(b"data: [DONE]\n\n")
    end = error_events("boom")
    assert end.startswith(b'data: {"error": {"message": "boom"') and end.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    "overrides",
    [{"replicas": ()}, {"policy": "random"}, {"replicas": ("ftp://x",)}, {"max_attempts": 0}, {"port": 0}],
)
def test_config_rejects_bad_values(overrides: dict[str, object]) -> None:
    values: dict[str, object] = {"replicas": ("http://a",)} | overrides
    with pytest.raises(ConfigError):
        RouterConfig(**values)  # type: ignore[arg-type]


def test_config_normalises_urls() -> None:
    assert RouterConfig(replicas=("http://a:1/",)).replicas == ("http://a:1",)
