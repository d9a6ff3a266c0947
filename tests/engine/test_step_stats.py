"""Step metrics: kinds, histograms, the busy window, and what a real engine records over its steps."""

from __future__ import annotations

import time

import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
from tailserve.engine.stats import (
    LATENCY_BUCKETS_S,
    STEP_KINDS,
    BusyWindow,
    StepStats,
    step_kind,
)


def test_step_kind_from_the_plan_shape() -> None:
    assert step_kind(num_decodes=3, num_entries=3) == "decode_only"
    assert step_kind(num_decodes=0, num_entries=2) == "prefill_only"
    assert step_kind(num_decodes=2, num_entries=3) == "mixed"


def test_busy_ratio_is_busy_time_over_the_window() -> None:
    window = BusyWindow(now=1000.0)
    window.add(1000.0, 1000.5)
    window.add(1000.8, 1001.3)  # spans a second boundary: 0.2 s + 0.3 s
    window.add(1001.5, 1001.7)
    assert window.snapshot().ratio(1002.0) == pytest.approx(1.2 / 2.0)
    # Nothing since: the ratio decays as idle time joins the window, and empties after a minute.
    assert window.snapshot().ratio(1030.0) == pytest.approx(1.2 / 30.0)
    assert window.snapshot().ratio(1062.5) == 0.0


def test_busy_ratio_forgets_what_left_the_window_and_stays_within_0_and_1() -> None:
    window = BusyWindow(now=0.0)
    t = 0.0
    while t < 30.0:  # back-to-back 10 ms steps for 30 s
        window.add(t, t + 0.01)
        t += 0.01
    assert window.snapshot().ratio(30.0) == pytest.approx(1.0)
    assert window.snapshot().ratio(30.0) <= 1.0
    # At 75.5 s the window starts at 15 s: 15 busy seconds out of 60.5.
    assert window.snapshot().ratio(75.5) == pytest.approx(15.0 / 60.5)
    window.add(100.0, 100.25)  # a step after a long idle spell zeroes the skipped bins
    assert window.snapshot().ratio(101.0) == pytest.approx(0.25 / 60.0)  # the window is [41 s, 101 s]


def test_step_histograms_count_each_step_once_under_its_kind() -> None:
    stats = StepStats(now=0.0)
    # Durations taken as end - start, as the engine does; starting at 0 keeps them exact in binary.
    stats.record("decode_only", 4, 0.0, 0.002)
    stats.record("decode_only", 4, 0.0, 0.003)
    stats.record("mixed", 260, 0.0, 0.05)
    snap = stats.snapshot(graph_steps=2, eager_steps=1)
    by_kind = dict(zip(STEP_KINDS, snap.duration_s, strict=True))
    assert by_kind["decode_only"].count == 2 and by_kind["mixed"].count == 1
    assert by_kind["prefill_only"].count == 0
    assert by_kind["decode_only"].sum == pytest.approx(0.005)
    # 2 ms and 3 ms land in the buckets whose upper bounds are the first >= each value.
    cumulative = dict(zip(LATENCY_BUCKETS_S, by_kind["decode_only"].cumulative(), strict=False))
    assert cumulative[0.0015] == 0 and cumulative[0.002] == 1 and cumulative[0.003] == 2
    tokens = dict(zip(STEP_KINDS, snap.tokens, strict=True))
    assert tokens["decode_only"].sum == 8 and tokens["mixed"].sum == 260
    # All three started at 0, so they overlap: busy time counts each moment once.
    assert snap.busy_s_total == pytest.approx(0.05)
    later = stats.snapshot(graph_steps=5, eager_steps=1)
    since = later.minus(snap)
    assert since.graph_steps == 3 and since.eager_steps == 0
    assert all(h.count == 0 for h in since.duration_s) and since.busy_s_total == 0.0


def test_busy_time_counts_a_lane_chunk_beside_decode_steps_once() -> None:
    """A prefill-lane chunk runs beside decode steps and is recorded after them: the busy time is
    the union of the steps (what a dashboard's busy ratio means), its own histogram its whole length."""
    stats = StepStats(now=0.0)
    stats.record("decode_only", 2, 0.0, 0.5)
    stats.record("decode_only", 2, 0.5, 1.0)
    stats.record("prefill_only", 256, 0.25, 1.5)  # the lane's chunk; the loop waited for its end
    snap = stats.snapshot(graph_steps=0, eager_steps=3)
    assert snap.busy_s_total == pytest.approx(1.5)
    assert snap.busy.ratio(1.5) == pytest.approx(1.0)
    by_kind = dict(zip(STEP_KINDS, snap.duration_s, strict=True))
    assert by_kind["prefill_only"].sum == pytest.approx(1.25)


def test_an_engine_records_every_step_it_runs_by_kind() -> None:
    """Two requests, a 32-token budget: prompt chunks, then a mixed step, then decodes. The snapshot
    agrees with the plans the scheduler made, step by step."""
    config = EngineConfig(
        model=ModelConfig(model="dummy:tiny", device="cpu"),
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, policy="fcfs"),
    )
    engine = LLMEngine(config)
    started = time.monotonic()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("long", list(range(5, 60)), params)  # 55 prompt tokens: two chunks
    engine.add_request("short", list(range(100, 120)), params)  # shares no prefix with "long"
    kinds = dict.fromkeys(STEP_KINDS, 0)
    tokens = dict.fromkeys(STEP_KINDS, 0)
    while engine.has_unfinished():
        engine.step()
        plan = engine.last_plan
        assert plan is not None and plan.scheduled
        kind = step_kind(plan.num_decodes, len(plan.scheduled))
        kinds[kind] += 1
        tokens[kind] += plan.num_tokens
    elapsed = time.monotonic() - started
    snap = engine.stats().steps
    assert {k: h.count for k, h in zip(STEP_KINDS, snap.duration_s, strict=True)} == kinds
    assert {k: h.sum for k, h in zip(STEP_KINDS, snap.tokens, strict=True)} == tokens
    assert kinds["prefill_only"] >= 1 and kinds["mixed"] >= 1 and kinds["decode_only"] >= 1
    assert sum(tokens.values()) == 55 + 20 + 2 * (6 - 1)  # every prompt token once, then the decodes
    assert sum(kinds.values()) == engine.stats().steps_total
    assert 0 < snap.busy_s_total <= elapsed
    assert snap.busy_s_total == pytest.approx(sum(h.sum for h in snap.duration_s))
    assert 0 < snap.busy.ratio(time.monotonic()) <= 1
    assert snap.eager_steps == sum(kinds.values()) and snap.graph_steps == 0  # CPU: no CUDA graphs
