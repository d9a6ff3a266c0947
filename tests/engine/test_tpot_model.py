"""The TPOT price: streams played forward by a step price, holds that keep streams within their
target, the scheduler keeping a held prompt waiting, and the decode steps' fit."""

from __future__ import annotations

import pytest

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.request import Request, RequestTimings, SamplingParams
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.stats import DecodeFit, DecodeTimer, StepTimer
from tailserve.engine.tpot_model import Stream, finish_times, price


def step_s(rows: int, context: int, busy: bool) -> float:
    """10 ms a step, 20 ms while prompt work runs; rows and context cost nothing."""
    return 0.02 if busy else 0.01


def test_a_stream_alone_ends_after_its_gaps():
    ends, firsts = finish_times([Stream(0.03, 10, 100, 5, 0.0)], [], 1.0, step_s)
    assert ends == [pytest.approx(1.1)] and firsts == []


def test_prompt_work_slows_the_streams_until_it_ends_and_then_streams_itself():
    stream = Stream(0.03, 10, 100, 0, 1.0)
    prompt = Stream(0.03, 4, 500)
    ends, firsts = finish_times([stream], [(0.05, prompt)], 1.0, step_s)
    # 3 steps of 20 ms (the prompt ends during the third), then 7 of 10 ms.
    assert firsts == [pytest.approx(1.05)]
    assert ends[0] == pytest.approx(1.0 + 3 * 0.02 + 7 * 0.01)
    assert ends[1] == pytest.approx(1.0 + 3 * 0.02 + 4 * 0.01)  # its gaps start with the streams' next step


def test_the_price_names_the_stream_the_newcomer_pushes_over_its_target():
    # A stream that has run 20 gaps at 25 ms (0.5 s) and has 10 left: at 10 ms a step it averages
    # 20 ms; a newcomer's 0.4 s prompt runs through all 10 of them, at 20 ms: it averages 23.3 ms.
    running = Stream(0.022, 10, 100, 20, 0.0)
    newcomer = Stream(0.05, 8, 300)
    p = price([running], [], (0, 0.4, newcomer), 0.5, step_s)
    (other,) = p.others
    assert other.without_s == pytest.approx((0.5 + 0.1) / 30)
    assert other.with_s == pytest.approx((0.5 + 0.2) / 30)
    assert other.without_s <= other.target_s < other.with_s
    # The newcomer streams from 0.9 s, after the stream ended (0.7 s): alone.
    assert p.own_s == pytest.approx(0.01) and p.own_alone_s == pytest.approx(0.01)
    assert p.first_end_s == pytest.approx(0.1)


def test_a_queued_prompt_behind_the_newcomer_starts_later():
    queued = Stream(0.03, 4, 200)
    newcomer = Stream(0.03, 4, 200)
    p = price([], [(0.1, queued)], (0, 0.3, newcomer), 0.0, step_s)
    (other,) = p.others
    # Without the newcomer it streams alone at 10 ms. Behind it, its first token comes at 0.4 s, after
    # the newcomer's 4 gaps (at 20 ms, beside its prompt): the same TPOT, a later TTFT (the TTFT
    # side's concern); the newcomer pays for the prompt behind it.
    assert other.without_s == pytest.approx(0.01) and other.with_s == pytest.approx(0.01)
    assert p.own_s == pytest.approx(0.02)


def test_the_decode_fit_recovers_rows_and_context_prices():
    fit = DecodeFit()
    for i in range(200):
        rows, context = 1 + i % 7, 500 + (i * 337) % 9000
        fit.record(rows, context, 0.010 + 0.001 * rows + 0.002 * context / 1000)
    assert fit.estimate_s(4, 6000) == pytest.approx(0.010 + 0.004 + 0.012, rel=1e-6)


def test_the_decode_fit_falls_back_where_steps_do_not_determine_the_rows_term():
    fit = DecodeFit()
    for i in range(50):  # always one row: only the context varies
        context = 500 + 40 * i
        fit.record(1, context, 0.012 + 0.003 * context / 1000)
    assert fit.estimate_s(1, 2000) == pytest.approx(0.018, rel=1e-3)


def test_decode_steps_beside_the_lane_are_priced_apart():
    timer = DecodeTimer()
    assert timer.estimate_s(1, 100, beside_lane=True) is None
    timer.record(1, 100, 0.010, beside_lane=False)
    assert timer.estimate_s(1, 100, beside_lane=True) == pytest.approx(0.010)  # all threads' until known
    timer.record(1, 100, 0.016, beside_lane=True)
    assert timer.estimate_s(1, 100, beside_lane=True) == pytest.approx(0.016)
    assert timer.estimate_s(1, 100, beside_lane=False) == pytest.approx(0.010)


def test_a_newcomer_that_would_push_a_stream_over_is_held_until_that_stream_ends():
    # The stream of the price test above: the newcomer's prompt at once pushes it to 23.3 ms
    # against 22 ms. Held until it ends (0.1 s from now), the prompt runs alone: no one misses,
    # and the newcomer's first token comes at 0.1 + 0.4 s.
    running = Stream(0.022, 10, 100, 20, 0.0)
    newcomer = Stream(0.05, 8, 300)
    p = price([running], [], (0, 0.4, newcomer), 0.5, step_s, ttft_budget_s=1.0)
    assert p.hold_s == pytest.approx(0.1)
    assert p.keeps_promises()
    assert p.own_first_s == pytest.approx(0.5)
    (other,) = p.others
    assert other.with_s == pytest.approx(other.without_s)
    # A TTFT budget the hold would break: the price at once, which admission refuses.
    at_once = price([running], [], (0, 0.4, newcomer), 0.5, step_s, ttft_budget_s=0.45)
    assert at_once.hold_s == 0 and not at_once.keeps_promises()
    assert at_once.own_first_s == pytest.approx(0.4)


def test_a_held_prompt_lets_the_prompt_behind_it_run_first():
    held = Stream(0.03, 4, 200, start_at=0.5)
    behind = Stream(0.03, 4, 200)
    ends, firsts = finish_times([], [(0.2, held), (0.1, behind)], 0.0, step_s)
    # `behind` runs at once (0.0-0.1 s) and streams alone at 10 ms until 0.14 s; `held` starts at
    # its time, 0.5 s, and streams from 0.7 s.
    assert firsts == [pytest.approx(0.7), pytest.approx(0.1)]
    assert ends[1] == pytest.approx(0.14)
    assert ends[0] == pytest.approx(0.74)


def test_the_scheduler_keeps_a_held_prompt_waiting_until_its_time():
    scheduler = Scheduler(
        SchedulerConfig(), KVCacheManager(200, 16, enable_prefix_caching=False), StepTimer()
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    held = Request(
        "held", list(range(1, 65)), params, RequestTimings(arrival=10.0), seq_no=0, not_before=11.0
    )
    scheduler.add(held)
    assert scheduler.held_s(10.0) == pytest.approx(1.0)
    assert scheduler.step_plan(10.0).scheduled == []
    # Its stream, as the next newcomer's price sees it, starts at its time.
    assert scheduler.queue_snapshot(10.0).pending_streams[0].start_at == 11.0
    free = Request("free", list(range(1, 33)), params, RequestTimings(arrival=10.5), seq_no=1)
    scheduler.add(free)
    assert [r.request_id for r, _ in scheduler.step_plan(10.5).scheduled] == ["free"]  # it goes first
    assert "held" in [r.request_id for r, _ in scheduler.step_plan(11.0).scheduled]
    assert scheduler.held_s(11.0) == 0.0
