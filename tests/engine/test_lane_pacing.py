"""The prefill lane paced by the streams' TPOT targets (--pace-lane): a prompt chunk goes on the lane
only where every decoding stream has room under its target for the slower steps beside it, the
decodes take all threads meanwhile, and a prompt whose TTFT deadline needs the lane gets it anyway.

The scheduler runs here without a model, its timers fed known steps: a lane chunk of 256 tokens
takes 135 ms, a decode step 10 ms on all threads and 20 ms beside the lane (so a chunk costs each
stream 135 x (1 - 10 / 20) = 67.5 ms against decoding on all threads).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.request import Request, RequestStatus, RequestTimings, SamplingParams
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.stats import StepTimer

NOW = 100.0
TPOT_S = 0.03


@dataclass
class _Plan:
    num_tokens: int
    num_prefill_tokens: int


def _scheduler(
    pace: bool = True, budget: int = 2048, lane_chunk: int | None = None, all_threads: bool = True
) -> Scheduler:
    """A lane chunk of `lane_chunk` tokens (default: `budget`, the step budget)."""
    config = SchedulerConfig(
        slo_ttft_s=2.0,
        slo_tpot_s=TPOT_S,
        pace_lane=pace,
        late_prompts_all_threads=all_threads,
        max_num_batched_tokens=budget,
        lane_chunk_tokens=lane_chunk or budget,
    )
    scheduler = Scheduler(config, KVCacheManager(2000, 16, enable_prefix_caching=False), StepTimer())
    scheduler.lane = True
    scheduler.lane_timer.record(_Plan(0, 0), 0.0)  # no fixed part: a chunk is its tokens
    scheduler.lane_timer.record(_Plan(256, 256), 0.135)
    for rows in (1, 2, 3):
        for context in (500, 1500, 3000):
            scheduler.decode_timer.record(rows, context, 0.010, beside_lane=False)
            scheduler.decode_timer.record(rows, context, 0.020, beside_lane=True)
    return scheduler


def _stream(scheduler: Scheduler, gaps_done: int, seconds_so_far: float, gaps_left: int) -> Request:
    """A decoding stream `seconds_so_far` after its first token, `gaps_done` gaps streamed and
    `gaps_left` expected (its max_tokens, with ignore_eos)."""
    params = SamplingParams(max_tokens=gaps_done + 1 + gaps_left, ignore_eos=True)
    req = Request("s", list(range(1, 101)), params, RequestTimings(arrival=0.0), seq_no=0)
    scheduler.add(req)
    scheduler.postprocess(scheduler.step_plan(0.0))  # its prompt, in one step
    req.token_ids += [7] * (gaps_done + 1)
    req.num_computed_tokens = len(req.token_ids) - 1
    req.timings.first_token = NOW - seconds_so_far
    assert req.status is RequestStatus.RUNNING and req.is_decoding
    return req


def _prompt(scheduler: Scheduler, arrival: float, tokens: int = 1000) -> None:
    params = SamplingParams(max_tokens=8)
    scheduler.add(Request("p", list(range(1, tokens + 1)), params, RequestTimings(arrival=arrival), seq_no=1))


def _lane_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens the step at NOW gives the lane."""
    return scheduler.step_plan(NOW, lane=True).num_prefill_tokens


def _lane_tokens_beside(gap_s: float, gaps_left: int, pace: bool = True) -> int:
    """Prompt tokens the lane gets at NOW beside one stream of 99 gaps at `gap_s` each so far and
    `gaps_left` to go, a 1,000-token prompt just arrived."""
    scheduler = _scheduler(pace)
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * gap_s, gaps_left=gaps_left)
    _prompt(scheduler, arrival=NOW)
    return _lane_tokens(scheduler)


# Rooms under the 30 ms target (Scheduler._lane_waits): 30 ms x all gaps - the time so far - the
# gaps left at the all-threads step (10 ms).
def test_the_lane_waits_while_a_stream_has_no_room_for_a_chunk() -> None:
    assert _lane_tokens_beside(0.020, 50) > 0  # 50 to go: room 4.47 - 1.98 - 0.5 = 1.99 s

    # 99 gaps at 31.5 ms, 10 to go: room 3.27 - 3.1185 - 0.1 = 51.5 ms; its 10 steps beside the
    # chunk (it ends before the chunk does) would cost it 10 x 20 ms x (1 - 10 / 20) = 100 ms.
    tight = _scheduler()
    _stream(tight, gaps_done=99, seconds_so_far=99 * 0.0315, gaps_left=10)
    _prompt(tight, arrival=NOW)
    plan = tight.step_plan(NOW, lane=True)
    assert plan.num_prefill_tokens == 0 and plan.num_decodes == 1  # the decode runs on all threads

    assert _lane_tokens_beside(0.0315, 10, pace=False) > 0  # --no-pace-lane: whatever the room


def test_a_stream_about_to_end_is_charged_only_its_own_steps_beside_the_chunk() -> None:
    # 99 gaps at 29.9 ms, 1 to go: room 3.0 - 2.96 - 0.01 = 30 ms. The whole chunk (0.53 s) would
    # cost a stream beside it all along 264 ms, but this one takes one step beside it: 10 ms.
    assert _lane_tokens_beside(0.0299, 1) > 0
    # With 4 gaps to go its room is 30 + 3 x 20 = 90 ms and its loss 4 x 10 = 40 ms: the lane goes.
    assert _lane_tokens_beside(0.0299, 4) > 0


def test_a_stream_that_misses_anyway_does_not_hold_the_lane_back() -> None:
    assert _lane_tokens_beside(0.035, 1) > 0  # 99 gaps at 35 ms: over its target whatever runs


def test_a_prompt_whose_ttft_deadline_needs_the_lane_gets_it() -> None:
    scheduler = _scheduler()
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * 0.0315, gaps_left=10)  # no room, as above
    # 1,000 tokens take 0.53 s on the lane; arrived 1.4 s ago against a 2 s target, after one more
    # chunk's wait it would end past its deadline.
    _prompt(scheduler, arrival=NOW - 1.4)
    assert _lane_tokens(scheduler) > 0


def test_a_prompt_the_lane_cannot_finish_by_its_deadline_yields_to_one_it_can() -> None:
    # The steps on all threads take a 256-token chunk in 70 ms, the lane in 135 ms. Prompt A (1,000
    # tokens, 0.5 s to its deadline) ends in time at the steps' price (0.27 s) but not at the lane's
    # (0.53 s), where its chunks go while a stream decodes: it is past saving and yields to B (200
    # tokens, due in 2 s), which the lane takes first; A keeps the rest of the chunk. So it goes
    # where late prompts stay on the lane (--no-late-prompts-all-threads); else see below.
    scheduler = _scheduler(budget=512, all_threads=False)
    scheduler.timer.record(_Plan(0, 0), 0.0)
    scheduler.timer.record(_Plan(256, 256), 0.070)
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * 0.020, gaps_left=50)  # room for the lane
    late, fresh = (
        Request(
            name, list(range(1, n + 1)), SamplingParams(max_tokens=8), RequestTimings(arrival=t), seq_no=k
        )
        for name, n, t, k in (("a", 1000, NOW - 1.5, 1), ("b", 200, NOW, 2))
    )
    scheduler.add(late)
    scheduler.add(fresh)
    chunks = {req.request_id: n for req, n in scheduler.step_plan(NOW, lane=True).scheduled[1:]}
    assert chunks == {"b": 200, "a": 312}


def test_a_prompt_all_threads_can_save_keeps_its_place_and_goes_there() -> None:
    # The same two prompts where a late prompt may run on all threads: A is not past saving (all
    # threads end it in 0.27 s, in time), so it goes first by its deadline, on all threads, and B
    # waits for the next step.
    scheduler = _scheduler(budget=1024, lane_chunk=512)
    scheduler.timer.record(_Plan(0, 0), 0.0)
    scheduler.timer.record(_Plan(256, 256), 0.070)
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * 0.020, gaps_left=50)
    for name, n, t, k in (("a", 1000, NOW - 1.5, 1), ("b", 200, NOW, 2)):
        params = SamplingParams(max_tokens=8)
        scheduler.add(Request(name, list(range(1, n + 1)), params, RequestTimings(arrival=t), seq_no=k))
    plan = scheduler.step_plan(NOW, lane=True)
    assert plan.all_threads
    assert [(req.request_id, n) for req, n in plan.scheduled[1:]] == [("a", 512)]


def test_a_lane_chunk_has_a_budget_of_its_own() -> None:
    # Steps of 256 tokens, lane chunks of 512: the lane takes 512 of a 1,000-token prompt beside a
    # stream with room; the queue admission reads prices the prompts behind in lane chunks too.
    scheduler = _scheduler(budget=256, lane_chunk=512)
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * 0.020, gaps_left=50)
    _prompt(scheduler, arrival=NOW)
    assert scheduler.queue_snapshot(NOW).prefill_cap == 512
    plan = scheduler.step_plan(NOW, lane=True)
    assert plan.num_decodes == 1 and plan.num_prefill_tokens == 512
    # Without the lane (--no-prefill-lane) the same prompt shares the step, within its budget.
    scheduler = _scheduler(budget=256, lane_chunk=512)
    scheduler.lane = False
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * 0.020, gaps_left=50)
    _prompt(scheduler, arrival=NOW)
    assert scheduler.step_plan(NOW).num_prefill_tokens <= 255


def _late_prompt_plan(
    arrival: float, gap_s: float = 0.020, gaps_left: int = 50, all_threads: bool = True
) -> tuple[bool, int]:
    """(whether the step at NOW runs its prompt chunk on all threads, its prompt tokens) for a
    1,000-token prompt that arrived at `arrival` (2 s target), beside one stream of 99 gaps at
    `gap_s` and `gaps_left` to go. The steps on all threads take 256 prompt tokens in 70 ms, the
    lane 135 ms: the whole prompt 0.27 s there, 0.53 s on the lane."""
    scheduler = _scheduler(budget=1024, lane_chunk=512, all_threads=all_threads)
    scheduler.timer.record(_Plan(0, 0), 0.0)
    scheduler.timer.record(_Plan(256, 256), 0.070)
    _stream(scheduler, gaps_done=99, seconds_so_far=99 * gap_s, gaps_left=gaps_left)
    _prompt(scheduler, arrival=arrival)
    plan = scheduler.step_plan(NOW, lane=True)
    return plan.all_threads, plan.num_prefill_tokens


def test_a_prompt_late_on_the_lane_and_not_on_all_threads_runs_on_all_threads() -> None:
    # 0.4 s to its deadline: 0.53 s on the lane misses it, 0.27 s on all threads does not.
    assert _late_prompt_plan(arrival=NOW - 1.6) == (True, 512)
    # 0.6 s to go: the lane's price (0.53 s) makes it, its slow chunks' pace (1.3 x) does not.
    assert _late_prompt_plan(arrival=NOW - 1.4) == (True, 512)
    # 1 s to go: the lane makes it, and it goes there.
    assert _late_prompt_plan(arrival=NOW - 1.0) == (False, 512)
    # 0.2 s to go: past saving on all threads too; the lane keeps it and the stream its steps.
    assert _late_prompt_plan(arrival=NOW - 1.8) == (False, 512)
    # --no-late-prompts-all-threads: the lane, whatever the deadline.
    assert _late_prompt_plan(arrival=NOW - 1.6, all_threads=False) == (False, 512)


def test_a_late_prompt_keeps_the_lane_where_a_stream_has_no_room_for_the_long_step() -> None:
    # The all-threads step of a 512-token chunk takes 0.14 s: 0.13 s more than a decode step (10 ms).
    # 99 gaps at 29.5 ms and 5 to go, priced at the step beside the lane (20 ms): room
    # 30 ms x 104 - 2.92 - 0.1 = 98.5 ms, too little. With 20 to go: 30 x 119 - 2.92 - 0.4 = 0.25 s.
    assert _late_prompt_plan(arrival=NOW - 1.6, gap_s=0.0295, gaps_left=5) == (False, 512)
    assert _late_prompt_plan(arrival=NOW - 1.6, gap_s=0.0295, gaps_left=20) == (True, 512)
