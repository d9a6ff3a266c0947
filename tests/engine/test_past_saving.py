"""Requests past saving under `slo`: a prompt that can no longer make its TTFT deadline yields to one
that can, still finishes within the stated bound under a steady stream of newcomers, and is not
counted ahead of a newcomer by admission; `fcfs` keeps arrival order.

The scheduler runs here without a model, on a fixed step-cost model (a StepTimer fed known steps):
a prompt's prefill is "done" when its tokens are computed, and the request then finishes, so the
step at which that happens is its first token.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import pytest

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.policy import SloPolicy
from tailserve.engine.request import Request, RequestTimings, SamplingParams, SloTarget
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.stats import StepTimer
from tailserve.engine.wait_model import QueueSnapshot, WaitModel

BUDGET = 64  # tokens per step
PER_TOKEN_S = 0.001  # the step-cost model: 1 ms per prompt token, 4 ms per decode-only step


@dataclass
class _Plan:
    num_tokens: int
    num_prefill_tokens: int


def _scheduler(policy: str, ttft_s: float = 10.0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, policy=policy, slo_ttft_s=ttft_s)
    timer = StepTimer(budget_tokens=BUDGET)
    timer.record(_Plan(8, 0), 0.004)
    timer.record(_Plan(BUDGET, BUDGET), BUDGET * PER_TOKEN_S)
    return Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), timer)


def _wait_s(
    scheduler: Scheduler, tokens: int, snapshot: QueueSnapshot, now: float, ttft_s: float | None = None
) -> float:
    """The wait model's prediction for a newcomer, as the engine builds it over this scheduler."""
    model = WaitModel(scheduler.policy, scheduler.timer, scheduler.config.slo_ttft_s)
    return model.estimate_s(tokens, snapshot, now, ttft_s)


class _Run:
    """Adds requests and steps the scheduler, recording the step each prompt finished at."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seq = 0
        self.step = 0
        self.first_token_step: dict[str, int] = {}

    def add(self, name: str, tokens: int, age_s: float = 0.0, ttft_s: float | None = None) -> None:
        slo = SloTarget("test", ttft_s=ttft_s) if ttft_s is not None else None
        ids = [(self.seq * 7 + i) % 1000 + 1 for i in range(tokens)]
        timings = RequestTimings(arrival=time.monotonic() - age_s)
        params = SamplingParams(max_tokens=1)
        self.scheduler.add(Request(name, ids, params, timings, seq_no=self.seq, slo=slo))
        self.seq += 1

    def run_step(self) -> None:
        plan = self.scheduler.step_plan(time.monotonic())
        self.scheduler.postprocess(plan)
        for req, _ in plan.scheduled:
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.first_token_step[req.request_id] = self.step
                self.scheduler.finish(req, "length")
        self.step += 1


def test_late_long_prompt_yields_to_a_newcomer_that_can_make_its_deadline() -> None:
    """Deadline already gone (arrived 100 s ago, 10 s target): the newcomer goes first under slo."""
    steps = {}
    for policy in ("slo", "fcfs"):
        run = _Run(_scheduler(policy))
        run.add("late", 2000, age_s=100.0)
        run.add("new", 200)  # 0.2 s of prefill against a 10 s target: savable
        while run.scheduler.num_unfinished:
            run.run_step()
        steps[policy] = run.first_token_step
    slo, fcfs = steps["slo"], steps["fcfs"]
    reserve = math.ceil(0.25 * BUDGET)
    assert slo["new"] < slo["late"]
    assert slo["new"] <= math.ceil(200 / (BUDGET - reserve))  # it had all but the late one's reserve
    assert fcfs["new"] > fcfs["late"]  # the baseline keeps arrival order
    # The late one kept its reserve meanwhile and had whole steps after: no step ran part-empty.
    assert slo["late"] < math.ceil((2000 + 200) / BUDGET)


def test_predicted_miss_is_past_saving_before_its_deadline_passes() -> None:
    """2000 tokens at 1 ms each cannot meet the request's own 1 s target, though 1 s has not passed."""
    run = _Run(_scheduler("slo"))
    run.add("doomed", 2000, ttft_s=1.0)
    run.add("new", 100, ttft_s=1.0)
    plan = run.scheduler.step_plan(time.monotonic())
    # The newcomer, second in arrival order, gets all but the late one's reserve of 16 tokens.
    assert [(req.request_id, n) for req, n in plan.scheduled] == [("new", BUDGET - 16), ("doomed", 16)]


def test_past_saving_prompt_finishes_within_its_bound_under_a_steady_stream() -> None:
    """Newcomers arrive faster than the budget every step; the late prompt still gets its reserve."""
    scheduler = _scheduler("slo")
    policy = scheduler.policy
    assert isinstance(policy, SloPolicy)
    bound_steps = math.ceil(2000 / policy.past_saving_reserve(BUDGET))
    run = _Run(scheduler)
    run.add("late", 2000, age_s=100.0)
    for step in range(bound_steps + 50):
        for i in range(3):  # 3 x 32 prompt tokens a step against a 64-token budget
            run.add(f"s{step}-{i}", 32, ttft_s=1000.0)
        run.run_step()
        if "late" in run.first_token_step:
            break
    assert run.first_token_step.get("late", math.inf) <= bound_steps
    served = [name for name, at in run.first_token_step.items() if name != "late"]
    assert len(served) >= run.first_token_step["late"]  # newcomers kept flowing beside it
    assert scheduler.num_unfinished > 0  # the stream was still backlogged when the late one finished


def test_admission_does_not_count_work_past_saving_ahead_of_a_newcomer() -> None:
    """The wait estimate of a savable newcomer ignores a late prompt (slo), counts it (fcfs), and
    still counts work that is urgent but savable."""
    waits = {}
    for policy in ("slo", "fcfs"):
        scheduler = _scheduler(policy, ttft_s=2.0)
        run = _Run(scheduler)
        run.add("late", 3000, age_s=100.0)
        now = time.monotonic()
        waits[policy] = _wait_s(scheduler, 100, scheduler.queue_snapshot(now), now)
    assert waits["slo"] < 2.0 < waits["fcfs"]  # 3000 tokens = 3 s of prefill ahead under fcfs
    scheduler = _scheduler("slo", ttft_s=2.0)
    run = _Run(scheduler)
    run.add("urgent", 1200, age_s=0.5)  # 1.2 s of prefill, 1.5 s left: savable, and urgent
    now = time.monotonic()
    wait = _wait_s(scheduler, 100, scheduler.queue_snapshot(now), now)
    assert wait >= 1.2
    # A newcomer with its own looser target is admitted against that target, not --slo-ttft.
    assert _wait_s(scheduler, 100, scheduler.queue_snapshot(now), now, ttft_s=30.0) >= 1.2


def test_batch_backlog_is_not_ahead_of_an_interactive_newcomer() -> None:
    """Queued batch prompts (loose targets) do not count against a newcomer with a tight target, so
    it is admitted; under fcfs the same backlog is ahead of it and breaks its 2 s target."""
    waits = {}
    for policy in ("slo", "fcfs"):
        scheduler = _scheduler(policy, ttft_s=2.0)
        run = _Run(scheduler)
        for i in range(3):
            run.add(f"batch{i}", 1000, ttft_s=300.0)
        now = time.monotonic()
        waits[policy] = _wait_s(scheduler, 100, scheduler.queue_snapshot(now), now, ttft_s=2.0)
    assert waits["slo"] < 2.0 < waits["fcfs"]


def test_under_a_batch_backlog_a_batch_newcomer_is_refused_an_interactive_one_admitted() -> None:
    """12 queued batch prompts of 2000 tokens (20 s targets, none urgent yet): another such batch
    prompt would wait for all of them (24 s > 20 s: a 429), an interactive one (2 s) for none."""
    scheduler = _scheduler("slo", ttft_s=2.0)
    run = _Run(scheduler)
    for i in range(12):
        run.add(f"batch{i}", 2000, ttft_s=20.0)
    now = time.monotonic()
    snapshot = scheduler.queue_snapshot(now)
    assert _wait_s(scheduler, 2000, snapshot, now, ttft_s=20.0) > 20.0
    assert _wait_s(scheduler, 200, snapshot, now, ttft_s=2.0) < 2.0


def test_a_one_chunk_step_alternates_between_late_and_savable_work() -> None:
    """When a step has room for one chunk only, neither the late prompt nor the savable ones starve."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, policy="slo", slo_ttft_s=10.0)
    timer = StepTimer(budget_tokens=16)
    timer.record(_Plan(8, 0), 0.004)
    timer.record(_Plan(16, 16), 16 * PER_TOKEN_S)
    run = _Run(Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), timer))
    run.add("late", 64, age_s=100.0)
    for step in range(8):
        run.add(f"s{step}", 16, ttft_s=1000.0)
        run.run_step()
    assert run.first_token_step.get("late", math.inf) <= 7  # 4 chunks, one every other step
    savable = [at for name, at in run.first_token_step.items() if name != "late"]
    assert len(savable) >= 3 and min(savable) < run.first_token_step["late"]  # moving while it waited


def test_a_full_batch_makes_a_newcomer_wait_for_a_slot() -> None:
    """With every sequence slot taken by long decodes, a newcomer with nothing ahead of it in prefill
    still waits for one to end: the estimate says so (and admission can refuse it fast) instead of
    0 s. A slot free again: 0. Finished requests that ended early shorten the expected wait of
    requests that may end early too (not of those that ignore the end token: they make max_tokens)."""
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, policy="slo", slo_ttft_s=2.0, max_num_seqs=2)
    timer = StepTimer(budget_tokens=BUDGET)
    timer.record(_Plan(2, 0), 0.05)  # a 50 ms decode step
    scheduler = Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), timer)
    now = time.monotonic()
    for i, max_tokens in enumerate((100, 60)):
        params = SamplingParams(max_tokens=max_tokens)
        scheduler.add(Request(f"long{i}", [5, 6, 7, 8], params, RequestTimings(arrival=now), seq_no=i))
    plan = scheduler.step_plan(now)  # both prefill in one step, then decode
    scheduler.postprocess(plan)
    for req, _ in plan.scheduled:
        req.token_ids.append(1)  # each has its first output token
    step = 0.05  # the newcomer's own prefill: one step beside the decodes
    wait = _wait_s(scheduler, 10, scheduler.queue_snapshot(now), now)
    assert wait == pytest.approx(59 * 0.05 + step)  # the 60-token one ends first: 59 steps left
    assert wait > config.slo_ttft_s  # admission would answer 429 rather than queue it for 3 s
    for _ in range(3):  # requests have been ending after ~10 tokens: expect these to end sooner too
        scheduler._output_tokens.record(10)
    wait = _wait_s(scheduler, 10, scheduler.queue_snapshot(now), now)
    assert wait == pytest.approx(9 * 0.05 + step)
    for req in scheduler.running:  # fixed lengths: they make max_tokens, whatever others did
        req.params = dataclasses.replace(req.params, ignore_eos=True)
    assert _wait_s(scheduler, 10, scheduler.queue_snapshot(now), now) == pytest.approx(59 * 0.05 + step)
    for req in scheduler.running:
        req.params = dataclasses.replace(req.params, ignore_eos=False)
    for _ in range(30):  # steps now carry prompt chunks and take 150 ms: the running streams slow too
        timer.record(_Plan(40, 38), 0.15)
    wait = _wait_s(scheduler, 10, scheduler.queue_snapshot(now), now)
    assert wait > 9 * 0.14  # the slot frees at the steps' pace now, not at a decode-only step's
    scheduler.finish(scheduler.running[0], "abort")  # a slot is free: only its own prefill
    model = WaitModel(scheduler.policy, scheduler.timer, scheduler.config.slo_ttft_s)
    wait_now = model.estimate(10, scheduler.queue_snapshot(now), now)
    assert not wait_now.queued and wait_now.ttft_s == wait_now.alone_s < 9 * 0.14


def test_a_late_request_takes_the_next_free_slot_under_a_steady_stream() -> None:
    """Both sequence slots are busy with long prompts while a late request waits for one, and short
    savable newcomers keep arriving. The first slot that frees is the late one's: it finishes within
    a step of it, not when the stream ends. The newcomers keep the other slot."""
    config = SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=2, policy="slo", slo_ttft_s=10.0)
    timer = StepTimer(budget_tokens=BUDGET)
    timer.record(_Plan(8, 0), 0.004)
    timer.record(_Plan(BUDGET, BUDGET), BUDGET * PER_TOKEN_S)
    run = _Run(Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), timer))
    for i in range(2):
        run.add(f"busy{i}", 320, ttft_s=1000.0)  # 10 steps of prefill for both, at 32 tokens each
    run.run_step()  # both slots taken
    run.add("late", 16, age_s=100.0)
    for step in range(40):
        run.add(f"s{step}", 16, ttft_s=1000.0)  # a one-chunk newcomer every step
        run.run_step()
    first_free = min(run.first_token_step["busy0"], run.first_token_step["busy1"])
    assert run.first_token_step["late"] <= first_free + 1
    newcomers = [at for name, at in run.first_token_step.items() if name.startswith("s")]
    assert len(newcomers) >= 20  # the stream kept flowing through the other slot


def test_admission_counts_a_late_request_ahead_for_a_slot() -> None:
    """A full batch and a late request waiting for a slot: a newcomer waits for two slots to free
    (the late one's, then its own), so its estimate is above the one without the late request."""
    waits = []
    for with_late in (False, True):
        config = SchedulerConfig(max_num_batched_tokens=BUDGET, policy="slo", slo_ttft_s=2.0, max_num_seqs=2)
        timer = StepTimer(budget_tokens=BUDGET)
        timer.record(_Plan(2, 0), 0.05)
        scheduler = Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), timer)
        now = time.monotonic()
        for i, max_tokens in enumerate((100, 60)):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            scheduler.add(Request(f"long{i}", [5, 6, 7, 8], params, RequestTimings(arrival=now), seq_no=i))
        plan = scheduler.step_plan(now)
        scheduler.postprocess(plan)
        for req, _ in plan.scheduled:
            req.token_ids.append(1)
        if with_late:
            params = SamplingParams(max_tokens=1)
            scheduler.add(Request("late", [9] * 32, params, RequestTimings(arrival=now - 100.0), seq_no=5))
        waits.append(_wait_s(scheduler, 10, scheduler.queue_snapshot(now), now))
    assert waits[0] == pytest.approx(59 * 0.05 + 0.05)  # the 60-token stream ends first
    assert waits[1] == pytest.approx(99 * 0.05 + 0.05)  # the late one takes that slot: the next is in 99
