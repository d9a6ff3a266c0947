"""Scheduling policies: in what order prompts are prefilled, how much prefill a step may carry, and
which running request gives its blocks back when the pool runs dry.

- `fcfs`: arrival order; prefill takes whatever budget the decodes leave; the newest request is preempted.
- `slo` (default): each request's TTFT deadline is arrival + its own target (SloTarget, else
  --slo-ttft). Requests whose slack is nearly gone go first (earliest deadline first); the others go
  by remaining prompt x TTFT target, smallest first (shortest first when targets are equal), so a
  short question is not stuck behind a long document and a tight target goes before a loose one.
  Slack shrinks as a request waits, so every request becomes urgent in time. A request that can no
  longer make its deadline (its predicted prefill ends past it) is *past saving*: it yields to the
  savable ones but keeps `past_saving_share` of every step's prefill budget, and the next free
  sequence slot while it waits for one, so its lateness is bounded. While decodes run, prefill per step is capped so the predicted step time keeps every
  stream's TPOT (an average over its whole output) under its target: a stream whose tokens so far
  and whose expected remaining tokens, at the step time seen now, leave room under its target
  lends that room to prefill, up to 2x the target for one step. The cap never drops below
  `prefill_floor` of the step budget, so prefill always progresses. The preemption victim is a
  request still in prefill (no token streamed yet) with the least work done, else the decode with
  the fewest tokens to recompute.

The prefill order is stated once, as `SchedulePolicy.rank` of a `PrefillItem`: the scheduler sorts
its prompts by it (`order_prefills`) and the wait model (engine/wait_model.py) ranks a newcomer
against the queue by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request, tpot_target_s, ttft_target_s
from tailserve.engine.stats import StepTimer, prompt_pairs


class PrefillItem(NamedTuple):
    """A prompt as the prefill order sees it: one the scheduler holds, or a newcomer being priced."""

    tokens: int  # prompt tokens left to compute (a waiting prompt's cached prefix costs nothing)
    deadline: float  # its TTFT deadline: arrival + its target
    ttft_s: float  # its TTFT target
    seq_no: int  # arrival order
    resumed: bool = False  # it streamed before a preemption: its TTFT is history
    start: int = 0  # tokens before the work left (computed or cached): the context its first token attends


class PrefillRank(NamedTuple):
    """A prompt's place in the prefill order, smallest first: savable work, then work past saving."""

    past_saving: bool
    tier: int
    key: float
    seq_no: int


class PrefillOrder(NamedTuple):
    """Prompts in the order they get budget: savable ones, then those past saving (with a reserve)."""

    savable: list[Request]
    past_saving: list[Request]


class SchedulePolicy(Protocol):
    name: str

    def rank(self, item: PrefillItem, now: float) -> PrefillRank: ...

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int: ...

    def steady_cap(self, decodes: Sequence[Request], budget: int) -> int: ...

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int: ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request: ...


def prefill_item(req: Request, slo_ttft_s: float) -> PrefillItem:
    """A queued or prefilling request as the order sees it (`slo_ttft_s`: the target of one without its own)."""
    ttft_s = ttft_target_s(req.slo, slo_ttft_s)
    resumed = req.timings.first_token is not None
    work = req.prompt_work_tokens
    start = max(len(req.token_ids) - work, 0)
    return PrefillItem(work, req.timings.arrival + ttft_s, ttft_s, req.seq_no, resumed, start)


def order_prefills(
    policy: SchedulePolicy, candidates: Sequence[Request], now: float, slo_ttft_s: float
) -> PrefillOrder:
    """The prompts by the policy's rank: the savable ones, then those past saving."""
    ranked = sorted(
        ((policy.rank(prefill_item(r, slo_ttft_s), now), r) for r in candidates), key=lambda kr: kr[0]
    )
    return PrefillOrder([r for k, r in ranked if not k.past_saving], [r for k, r in ranked if k.past_saving])


class FcfsPolicy:
    """First come, first served: the baseline."""

    name = "fcfs"

    def rank(self, item: PrefillItem, now: float) -> PrefillRank:
        return PrefillRank(False, 0, 0.0, item.seq_no)  # arrival order only: no request is set aside

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int:
        return budget

    def steady_cap(self, decodes: Sequence[Request], budget: int) -> int:
        return budget

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int:
        return 0

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: r.seq_no)


class SloPolicy:
    """TTFT-deadline-aware ordering with an adaptive prefill cap (see the module docstring)."""

    name = "slo"
    # One step (a gap every running stream sees) takes at most this many TPOT targets. 2, not 4
    # (until issue 40): on the scripted engine at 3 req/s of 256-in / 32-out prompts under a 30 ms
    # target, P99 ITL 58 ms instead of 108, TPOT unchanged, mean TTFT +4% (docs/notes/tail-under-slo.md).
    MAX_ITL_FACTOR = 2.0

    def __init__(
        self,
        config: SchedulerConfig,
        timer: StepTimer,
        block_size: int,
        tokens_left: Callable[[Request], int] | None = None,
        prompt_timer: Callable[[], StepTimer] | None = None,
    ) -> None:
        self.config = config
        self.timer = timer
        self.min_chunk = block_size
        # Output tokens a running request is expected to produce still (default: up to max_tokens).
        self.tokens_left = tokens_left or (lambda r: max(r.params.max_tokens - r.num_output_tokens, 1))
        # What prices a prompt's own prefill in `rank`: the timer of wherever prompts run now (the
        # prefill lane's chunks, on half the threads, while streams decode; default: the steps').
        self.prompt_timer = prompt_timer or (lambda: timer)

    def _prefill_s(self, tokens: int, start: int) -> float:
        return self.prompt_timer().estimate_s(
            tokens, 0, pairs=prompt_pairs(tokens, start)
        )  # at the full budget a step

    def _slack_s(self, item: PrefillItem, now: float) -> float:
        return item.deadline - now - self._prefill_s(item.tokens, item.start)

    def rank(self, item: PrefillItem, now: float) -> PrefillRank:
        tokens, deadline, ttft_s, seq_no, resumed, _ = item
        if resumed:
            # Resumed after a preemption: it streams already, so its TTFT is history and what
            # matters is getting its stream going again, first.
            return PrefillRank(False, 0, deadline, seq_no)
        slack_s = self._slack_s(item, now)
        if slack_s < 0:
            # Past saving: its prefill, even at the full budget from now on, is predicted to end
            # after its deadline. Most overdue first: bounded lateness.
            return PrefillRank(True, 0, deadline, seq_no)
        if slack_s < self.config.urgent_slack * ttft_s:  # urgent: little slack beyond its own prefill
            return PrefillRank(False, 0, deadline, seq_no)
        # Smith's rule with weight 1 / target: the least prompt x target first minimises the sum of
        # TTFT / target; with equal targets it is shortest first.
        return PrefillRank(False, 1, tokens * ttft_s, seq_no)

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int:
        """Prefill tokens of step `step_no` kept for requests past saving (when any wait).

        A share of every step, not a promotion after some extra wait: the late request's remaining
        prefill then ends within ceil(remaining / reserve) steps however many newcomers arrive, and
        the savable ones never meet a late prompt that suddenly takes a whole step (a cliff that
        admission could not predict). Savable work keeps at least one chunk. A step with room for a
        single chunk (a tight --prefill-floor under TPOT pressure) goes to the late on odd steps and
        to the savable on even ones: both keep moving, and the late one's bound doubles."""
        if left < 2 * self.min_chunk:
            return left if step_no % 2 else 0
        reserve = max(self.min_chunk, math.ceil(self.config.past_saving_share * left))
        return min(reserve, left - self.min_chunk)

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int:
        if not decodes:
            return budget  # no stream to protect
        return self._cap_for(self.step_budget_s(decodes, now), budget)

    def steady_cap(self, decodes: Sequence[Request], budget: int) -> int:
        """The cap once the streams' banked room is spent: a step as long as the tightest TPOT
        target among `decodes` (--slo-tpot where none decode: the first prompt done becomes a
        stream). What prompt work beside streams gets step after step, for the wait model: the cap
        of the step running now lends room that a few long steps use up (served on the Zen 3 kind,
        256-token prompts priced at it ran up to 1.6x their price beside decodes)."""
        tpot = min(
            (tpot_target_s(r.slo, self.config.slo_tpot_s) for r in decodes), default=self.config.slo_tpot_s
        )
        return self._cap_for(tpot, budget)

    def _cap_for(self, step_s: float, budget: int) -> int:
        """Prompt tokens a step of at most `step_s` seconds carries beside its decodes, at least the floor."""
        decode_step_s, per_token = self.timer.coefficients()
        if per_token <= 0:
            return budget  # no timing yet
        room = (step_s - decode_step_s - self.timer.prompt_step_s()) / per_token
        # Prefill always keeps a share of the budget: when decodes alone already miss the TPOT
        # target, starving prompts would not save the streams and would wreck TTFT.
        floor = max(self.min_chunk, int(budget * self.config.prefill_floor))
        return min(budget, max(floor, int(room)))

    def step_budget_s(self, decodes: Sequence[Request], now: float) -> float:
        """How long this step may take without pushing any stream's TPOT over its target.

        TPOT is the mean gap over a stream's whole output, so one long step only has to fit in what
        the stream's other gaps leave: its target times all its gaps, less the time taken so far,
        less its expected remaining gaps priced at the step time seen now (capped at the target:
        priced at the target, the room is just the time banked so far). A stream expected to end
        soon (few gaps left) lends little. The room is re-read every step, so a stream that lent it
        gets tighter caps after. One step takes at least the target and at most MAX_ITL_FACTOR x
        the target: no single gap becomes a stall.
        """
        recent_s = self.timer.recent_step_s()
        budgets = []
        for r in decodes:
            if not r.timings.first_token:
                continue
            tpot = tpot_target_s(r.slo, self.config.slo_tpot_s)
            future_s = min(recent_s, tpot)
            # This step yields one token; the stream's other gaps left come after it.
            room = stream_room_s(r, tpot, now, self.tokens_left(r), future_s) + future_s
            budgets.append(min(max(room, tpot), self.MAX_ITL_FACTOR * tpot))
        return min(budgets, default=self.config.slo_tpot_s)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return min(
            candidates, key=lambda r: (r.timings.first_token is not None, r.num_computed_tokens, -r.seq_no)
        )


def stream_room_s(r: Request, tpot_s: float, now: float, gaps_left: int, gap_s: float) -> float:
    """What a decoding stream's TPOT target leaves after its `gaps_left` gaps still to come at
    `gap_s` each: the target times all its gaps, less the time since its first token and those
    gaps. Negative: the stream misses its target even at that pace."""
    assert r.timings.first_token is not None
    gaps_done = r.num_output_tokens - 1
    return tpot_s * (gaps_done + gaps_left) - (now - r.timings.first_token) - gaps_left * gap_s


def make_policy(
    config: SchedulerConfig,
    timer: StepTimer,
    block_size: int,
    tokens_left: Callable[[Request], int] | None = None,
    prompt_timer: Callable[[], StepTimer] | None = None,
) -> SchedulePolicy:
    if config.policy == "slo":
        return SloPolicy(config, timer, block_size, tokens_left, prompt_timer)
    return FcfsPolicy()
