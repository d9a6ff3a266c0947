"""The wait model reads the planner's rule rather than a copy of it: the prompt tokens it counts ahead
of a newcomer are those of the queued prompts the scheduler's order puts before that newcomer."""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.config import SchedulerConfig
from tailserve.engine.policy import FcfsPolicy, SchedulePolicy, SloPolicy, order_prefills, prefill_item
from tailserve.engine.request import Request, RequestTimings, SamplingParams, SloTarget
from tailserve.engine.stats import StepTimer
from tailserve.engine.wait_model import NEWCOMER_SEQ_NO, tokens_ahead

NOW = 1000.0
SLO_TTFT_S = 0.55


@dataclass
class _Plan:
    num_tokens: int
    num_prefill_tokens: int


def _request(name: str, tokens: int, age_s: float, seq_no: int, ttft_s: float | None = None) -> Request:
    slo = SloTarget("test", ttft_s=ttft_s) if ttft_s is not None else None
    params = SamplingParams(max_tokens=16)
    return Request(name, [5] * tokens, params, RequestTimings(arrival=NOW - age_s), seq_no=seq_no, slo=slo)


def test_tokens_ahead_of_a_newcomer_are_those_the_planner_orders_before_it() -> None:
    timer = StepTimer(budget_tokens=256)
    timer.record(_Plan(8, 0), 0.010)
    timer.record(_Plan(256, 248), 0.010 + 248 * 0.0003)
    resumed = _request("resumed", 300, 2.0, 0)
    resumed.timings.first_token = NOW - 1.0  # streamed before a preemption: it goes first
    queued = [
        resumed,
        _request("late", 900, 5.0, 1),  # its deadline is gone: past saving
        _request("urgent", 375, 0.4, 2),
        _request("batch", 1200, 0.0, 3, ttft_s=30.0),
        _request("short", 30, 0.0, 4),
        _request("loose", 200, 0.1, 5, ttft_s=5.0),
    ]
    policies: list[SchedulePolicy] = [
        SloPolicy(
            SchedulerConfig(policy="slo", slo_ttft_s=SLO_TTFT_S, urgent_slack=0.25), timer, block_size=16
        ),
        SloPolicy(
            SchedulerConfig(policy="slo", slo_ttft_s=SLO_TTFT_S, urgent_slack=1.0), timer, block_size=16
        ),
        FcfsPolicy(),
    ]
    seen = set()
    for policy in policies:
        # Short and long newcomers, tight and loose targets; the last one is past saving itself.
        for tokens, ttft_s in ((40, 0.55), (250, 0.55), (100, 5.0), (20, 0.1), (3000, 1.0)):
            newcomer = _request("new", tokens, 0.0, 99, ttft_s=ttft_s)
            order = order_prefills(policy, [*queued, newcomer], NOW, SLO_TTFT_S)
            # A late newcomer comes after every savable prompt and the late ones ordered before it.
            line = [*order.savable, *order.past_saving]
            before = line[: [r.request_id for r in line].index("new")]
            item = prefill_item(newcomer, SLO_TTFT_S)._replace(seq_no=NEWCOMER_SEQ_NO)
            pending = [prefill_item(r, SLO_TTFT_S) for r in queued]
            ahead = tokens_ahead(policy, pending, item, NOW)
            assert ahead == sum(r.prompt_work_tokens for r in before), (policy.name, tokens, ttft_s)
            seen.add(ahead)
    assert len(seen) > 4  # the cases differ: the rule is exercised, not one answer repeated
