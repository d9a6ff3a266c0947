"""The wait model reads the planner's rule rather than a copy of it: the prompt tokens it counts ahead
of a newcomer are those of the queued prompts the scheduler's order puts before that newcomer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.policy import (
    FcfsPolicy,
    PrefillItem,
    SchedulePolicy,
    SloPolicy,
    order_prefills,
    prefill_item,
)
from tailserve.engine.request import Request, RequestTimings, SamplingParams, SloTarget
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.stats import DecodeTimer, StepTimer, prompt_pairs
from tailserve.engine.tpot_model import Stream
from tailserve.engine.wait_model import NEWCOMER_SEQ_NO, QueueSnapshot, WaitModel, tokens_ahead, unseen_item

NOW = 1000.0
SLO_TTFT_S = 0.55


@dataclass
class _Plan:
    num_tokens: int
    num_prefill_tokens: int


@dataclass
class _PairsPlan:
    num_tokens: int
    num_prefill_tokens: int
    prompt_pairs: int


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


def test_prompts_beside_decoding_streams_are_priced_at_the_lane_s_speed_an_idle_step_at_the_engine_s() -> (
    None
):
    """With a prefill lane, prompt chunks that run while streams decode get half the threads: a
    newcomer's prefill is priced by the lane's own timer (fed only its chunks). On an idle engine the
    first prompt in line goes in one step on every thread, priced by the steps' timer, and whatever
    is behind it goes to the lane once that prompt decodes. (One timer for both, measured in process,
    priced lane chunks 16-25% short and steps with no decode 28% long.) A chunked prompt's last
    chunk is priced full: the prompts behind it fill its room."""
    steps, lane = StepTimer(budget_tokens=256), StepTimer(budget_tokens=256)
    steps.record(_Plan(8, 0), 0.010)  # a decode step
    steps.record(_Plan(2048, 2048), 0.010 + 2048 * 0.0002)  # an idle step: 0.2 ms a prompt token
    lane.record(_Plan(256, 256), 256 * 0.0004)  # a lane chunk: 0.4 ms a prompt token
    policy = SloPolicy(SchedulerConfig(slo_ttft_s=5.0), steps, block_size=16)
    model = WaitModel(policy, steps, 5.0, lane)
    busy = QueueSnapshot(pending=[], num_running=3, prefill_cap=256, lane=True)
    assert model.estimate_s(1000, busy, NOW) == pytest.approx(4 * 256 * 0.0004)  # 4 chunks, the last full
    idle = QueueSnapshot(pending=[], num_running=0, prefill_cap=256, idle_step_tokens=2048, lane=True)
    assert model.estimate_s(1000, idle, NOW) == pytest.approx(0.010 + 1000 * 0.0002)  # one step alone
    queued = dataclasses.replace(idle, pending=[PrefillItem(1500, NOW + 1.0, 5.0, 0)])  # due first
    assert model.estimate_s(1000, queued, NOW) == pytest.approx(0.010 + 1500 * 0.0002 + 4 * 256 * 0.0004)
    # Without a lane the chunks go in the steps, beside the decodes, at the steps' price: 253 tokens
    # a step beside 3 decode rows.
    plain = WaitModel(policy, steps, 5.0)
    assert plain.estimate_s(1000, busy, NOW) == pytest.approx(4 * 0.010 + 4 * 253 * 0.0002)


def test_prompts_beside_streams_are_priced_at_the_cap_the_streams_keep_after_their_banked_room() -> None:
    """Without a lane, prompt chunks share the steps with the decodes, capped by the streams' TPOT
    room; a stream that has been fast lends banked room, which a few long steps spend, and the
    steps after carry what a step of its TPOT target leaves (`steady_cap`). A newcomer beside
    streams, and one behind a prompt that becomes a stream before its own turn (on an idle engine),
    is priced at that steady cap, not at the cap of the step running now: on the Zen 3 kind,
    256-token prompts priced at the step's cap ran up to 1.6x their price. (Steps: 10 ms a decode
    step, 60 ms more with prompt tokens, 0.5 ms a prompt token; TPOT target 100 ms: a steady step
    carries 60 tokens, the floor 64.)"""
    steps = StepTimer(budget_tokens=256)
    steps.record(_Plan(2, 0), 0.010)
    for tokens, start in ((256, 0), (64, 0), (64, 64), (256, 0), (128, 128), (64, 192)):
        pairs = prompt_pairs(tokens, start)
        steps.record(_PairsPlan(tokens, tokens, pairs), 0.010 + 0.060 + 0.0005 * tokens + 1e-7 * pairs)
    assert steps.prompt_step_s() == pytest.approx(0.060)
    config = SchedulerConfig(slo_ttft_s=5.0, slo_tpot_s=0.100, prefill_lane=False)
    policy = SloPolicy(config, steps, block_size=16)
    steady = policy.steady_cap([], 256)
    assert steady == 64  # (100 - 10 - 60) / 0.5 = 60 tokens, under the floor of a quarter of 256
    scheduler = Scheduler(config, KVCacheManager(200, 16, enable_prefix_caching=False), steps)
    assert scheduler.queue_snapshot(NOW).steady_cap == steady
    model = WaitModel(policy, steps, 5.0)
    stream = Stream(0.100, 20, 300)
    busy = QueueSnapshot(pending=[], num_running=1, prefill_cap=200, steady_cap=steady, streams=(stream,))
    prompt_s = 256 * 0.0005 + 1e-7 * prompt_pairs(256, 0)
    assert model.estimate_s(256, busy, NOW) == pytest.approx(4 * 0.070 + prompt_s)
    banked = dataclasses.replace(busy, steady_cap=0)  # priced at the step's cap alone: two steps,
    fill_s = (2 * 200 - 256) * 0.0005  # the second filled by the prompts behind
    assert model.estimate_s(256, banked, NOW) == pytest.approx(2 * 0.070 + prompt_s + fill_s)
    # On an idle engine, the prompt ahead takes one long step, then decodes beside the newcomer's.
    ahead = PrefillItem(256, NOW + 5.0, 5.0, 0)
    idle = QueueSnapshot(
        pending=[ahead], num_running=1, prefill_cap=256, steady_cap=steady, idle_step_tokens=2048
    )
    assert model.estimate_s(256, idle, NOW) == pytest.approx(0.070 + 4 * 0.070 + 2 * prompt_s)
    alone = dataclasses.replace(idle, pending=[], num_running=0)  # nothing ahead: one step of its own
    assert model.estimate_s(256, alone, NOW) == pytest.approx(0.070 + prompt_s)
    laned = Scheduler(
        dataclasses.replace(config, prefill_lane=True),
        KVCacheManager(200, 16, enable_prefix_caching=False),
        steps,
    )
    laned.lane = True
    assert laned.queue_snapshot(NOW).steady_cap == 0  # lane chunks are not capped by the streams


def _fixed_cost_steps() -> StepTimer:
    """Steps of 10 ms a decode step, 60 ms more with prompt tokens, 0.5 ms a prompt token and 0.1 us
    a query-key pair, learned from prompt steps of several sizes."""
    steps = StepTimer(budget_tokens=256)
    steps.record(_Plan(2, 0), 0.010)
    for tokens, start in ((256, 0), (64, 0), (64, 64), (256, 0), (128, 128), (64, 192)):
        pairs = prompt_pairs(tokens, start)
        steps.record(_PairsPlan(tokens, tokens, pairs), 0.010 + 0.060 + 0.0005 * tokens + 1e-7 * pairs)
    return steps


def test_a_newcomer_priced_while_a_step_runs_waits_for_what_is_left_of_it() -> None:
    """The engine publishes its queue as each step begins, and admission prices newcomers against
    it until the next. One arriving while the prompt ahead of it runs its one long step (an idle
    engine) waits for the rest of that step, not all of it: quoted the whole, newcomers were ~0.25 s
    over on average on the Zen 3 kind (256-token prompts at 0.44 req/s), where most 429s were such
    quotes. One the planner puts before that prompt (an earlier deadline) still waits the step out,
    then goes beside the stream the prompt became; no admission could start it sooner."""
    steps = _fixed_cost_steps()
    config = SchedulerConfig(slo_ttft_s=5.0, slo_tpot_s=0.100, prefill_lane=False)
    scheduler = Scheduler(config, KVCacheManager(400, 16, enable_prefix_caching=False), steps)
    scheduler.idle_budget = 2048
    model = WaitModel(scheduler.policy, steps, 5.0)
    assert scheduler.queue_snapshot(NOW).step_began is None  # nothing to run: no step follows
    scheduler.add(_request("long", 1024, 0.0, 0))
    snapshot = scheduler.queue_snapshot(NOW)
    assert snapshot.step_began == NOW and snapshot.idle_step_tokens == 2048
    long_step_s = 0.070 + 1024 * 0.0005 + 1e-7 * prompt_pairs(1024, 0)
    first = model.estimate(2000, snapshot, NOW)  # a longer one goes behind it
    assert first.queued
    later = model.estimate(2000, snapshot, NOW + 0.3)
    assert later.ttft_s == pytest.approx(first.ttft_s - 0.3) and later.alone_s == first.alone_s
    overdue = model.estimate(2000, snapshot, NOW + 1.0)  # the step runs long: no more than it is done
    assert overdue.ttft_s == pytest.approx(first.ttft_s - long_step_s)
    # One with a 1 s target goes first in the order, but the step running now is the long
    # prompt's: the rest of it, then its own 100 tokens in two steps of the steady cap (64) beside
    # the stream, the second filled by what is behind.
    assert snapshot.steady_cap == 64
    short = model.estimate(100, snapshot, NOW + 0.3, ttft_s=1.0)
    beside_s = 2 * 0.070 + 128 * 0.0005 + 1e-7 * prompt_pairs(100, 0)
    assert short.ttft_s == pytest.approx(long_step_s - 0.3 + beside_s)
    assert not short.queued  # nothing it could be refused for: it starts as soon as any could
    # Handed over after the snapshot, a request is not in the step running now.
    unseen = dataclasses.replace(snapshot, pending=[unseen_item(1024, NOW, 5.0)])
    assert model.estimate(2000, unseen, NOW + 0.3).ttft_s > later.ttft_s


def test_the_lane_s_idle_gap_before_each_chunk_is_part_of_a_prompt_s_price() -> None:
    """A lane chunk that ends starts the next one only with the next step, after the decode step it
    ended beside (measured in process on the chat-scaled arrivals: 18 ms median a chunk of ~135 ms).
    A prompt on the lane is priced its chunks' compute and a gap before each."""
    steps, lane = StepTimer(budget_tokens=256), StepTimer(budget_tokens=256)
    steps.record(_Plan(8, 0), 0.010)
    lane.record(_Plan(256, 256), 256 * 0.0004)
    policy = SloPolicy(SchedulerConfig(slo_ttft_s=5.0), steps, block_size=16)
    model = WaitModel(policy, steps, 5.0, lane)
    busy = QueueSnapshot(pending=[], num_running=3, prefill_cap=256, lane=True)
    chunks_s = 4 * 256 * 0.0004  # 4 chunks, the last filled by the prompts behind
    assert model.estimate_s(1000, busy, NOW) == pytest.approx(chunks_s)
    lane.record_gap(0.020)
    assert model.estimate_s(1000, busy, NOW) == pytest.approx(chunks_s + 4 * 0.020)
    idle = QueueSnapshot(pending=[], num_running=0, prefill_cap=256, idle_step_tokens=2048, lane=True)
    assert model.estimate_s(1000, idle, NOW) == pytest.approx(0.010)  # one step on all threads: no lane gap


def test_a_stream_s_tpot_price_counts_the_prompt_work_still_to_arrive_as_recent_work_did() -> None:
    """Steps outside the known prompts' runs are priced at the decodes' mean rate at the share of
    time the recent arrivals' prompt work keeps the lane busy (served, a stream's TPOT ran 1.25x its
    price with one later arrival in its life and 1.7-1.9x with five; 0.95x with none). A newcomer
    alone on the engine: 10 ms a step with no arrivals; 12.9 ms where recent prompts kept the lane
    busy half the time (half the time at 10 ms a step and half at 18); 18 ms, the step beside the
    lane, where they kept it busy all the time."""
    steps, lane = StepTimer(budget_tokens=256), StepTimer(budget_tokens=512)
    steps.record(_Plan(8, 0), 0.010)
    lane.record(_Plan(256, 256), 256 * 0.001)  # 0.256 s for a 256-token prompt on the lane
    decode = DecodeTimer()
    decode.record(1, 0, 0.010, beside_lane=False)
    decode.record(1, 0, 0.018, beside_lane=True)
    policy = SloPolicy(SchedulerConfig(slo_ttft_s=2.0), steps, block_size=16)
    model = WaitModel(policy, steps, 2.0, lane, decode)
    own = Stream(0.030, 31, 256)

    def own_tpot(recent: tuple[int, ...]) -> float:
        snapshot = QueueSnapshot(
            pending=[], num_running=1, prefill_cap=512, lane=True, recent_prompts=recent, recent_window_s=30.0
        )
        price = model.tpot_price(256, own, snapshot, NOW)
        assert price is not None
        return price.own_s

    assert own_tpot(()) == pytest.approx(0.010, rel=0.01)
    # 59 prompts of 256 tokens in 30 s: 15.1 s of lane work, half the time.
    half = 59 * 0.256 / 30
    assert own_tpot((256,) * 59) == pytest.approx(1 / ((1 - half) / 0.010 + half / 0.018), rel=0.01)
    assert own_tpot((256,) * 200) == pytest.approx(0.018, rel=0.01)  # the lane busy all the time, no more
    assert own_tpot((0,) * 200) == pytest.approx(0.010, rel=0.01)  # cached prompts: no work


def test_the_scheduler_reports_the_prompt_work_admitted_in_the_last_window() -> None:
    """What a newcomer's TPOT price reads: the prompt tokens to compute of the requests added in the
    last ARRIVALS_WINDOW_S seconds, by their arrival."""
    kv = KVCacheManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(SchedulerConfig(), kv)
    window = Scheduler.ARRIVALS_WINDOW_S
    for k, tokens in enumerate((100, 200, 300)):
        scheduler.add(_request(f"r{k}", tokens, age_s=window + 5 - 10 * k, seq_no=k))
    snapshot = scheduler.queue_snapshot(NOW)
    assert snapshot.recent_window_s == window
    assert snapshot.recent_prompts == (200, 300)  # the first arrived more than a window ago
