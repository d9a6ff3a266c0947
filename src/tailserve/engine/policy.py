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
  lends that room to prefill, up to 4x the target for one step. The cap never drops below
  `prefill_floor` of the step budget, so prefill always progresses. The preemption victim is a
  request still in prefill (no token streamed yet) with the least work done, else the decode with
  the fewest tokens to recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request, tpot_target_s, ttft_target_s
from tailserve.engine.stats import StepTimer

Pending = tuple[int, float, float]  # a queued prompt: (tokens left, TTFT deadline, TTFT target)


class PrefillOrder(NamedTuple):
    """Prompts in the order they get budget: savable ones, then those past saving (with a reserve)."""

    savable: list[Request]
    past_saving: list[Request]


class SchedulePolicy(Protocol):
    name: str

    def order_prefills(self, candidates: Sequence[Request], now: float) -> PrefillOrder: ...

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int: ...

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int: ...

    def past_saving(self, remaining_tokens: int, deadline: float, now: float) -> bool: ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request: ...

    def tokens_ahead(
        self, pending: Sequence[Pending], new_tokens: int, new_ttft_s: float, now: float
    ) -> int: ...

    def newcomer_tokens_per_step(self, pending: Sequence[Pending], cap: int, now: float) -> int: ...


class FcfsPolicy:
    """First come, first served: the baseline."""

    name = "fcfs"

    def order_prefills(self, candidates: Sequence[Request], now: float) -> PrefillOrder:
        return PrefillOrder(sorted(candidates, key=lambda r: r.seq_no), [])

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int:
        return budget

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int:
        return 0

    def past_saving(self, remaining_tokens: int, deadline: float, now: float) -> bool:
        return False  # arrival order only: no request is set aside

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: r.seq_no)

    def tokens_ahead(self, pending: Sequence[Pending], new_tokens: int, new_ttft_s: float, now: float) -> int:
        """Every queued prompt token is ahead of a newcomer."""
        return sum(tokens for tokens, _, _ in pending)

    def newcomer_tokens_per_step(self, pending: Sequence[Pending], cap: int, now: float) -> int:
        return cap


class SloPolicy:
    """TTFT-deadline-aware ordering with an adaptive prefill cap (see the module docstring)."""

    name = "slo"
    MAX_ITL_FACTOR = 4.0

    def __init__(
        self,
        config: SchedulerConfig,
        timer: StepTimer,
        block_size: int,
        tokens_left: Callable[[Request], int] | None = None,
    ) -> None:
        self.config = config
        self.timer = timer
        self.min_chunk = block_size
        # Output tokens a running request is expected to produce still (default: up to max_tokens).
        self.tokens_left = tokens_left or (lambda r: max(r.params.max_tokens - r.num_output_tokens, 1))

    def _prefill_s(self, tokens: int) -> float:
        return self.timer.estimate_s(tokens, 0)  # at the full budget a step

    def _slack_s(self, remaining_tokens: int, deadline: float, now: float) -> float:
        return deadline - now - self._prefill_s(remaining_tokens)

    def _urgent(self, remaining_tokens: int, deadline: float, ttft_s: float, now: float) -> bool:
        # Urgent once the slack left beyond its own prefill time is under --urgent-slack x the target.
        return self._slack_s(remaining_tokens, deadline, now) < self.config.urgent_slack * ttft_s

    def past_saving(self, remaining_tokens: int, deadline: float, now: float) -> bool:
        """Its prefill, even at the full budget from now on, is predicted to end after its deadline."""
        return self._slack_s(remaining_tokens, deadline, now) < 0

    def order_prefills(self, candidates: Sequence[Request], now: float) -> PrefillOrder:
        savable: list[tuple[tuple[int, float, int], Request]] = []
        late: list[tuple[tuple[int, float, int], Request]] = []
        for r in candidates:
            ttft_s = ttft_target_s(r.params, self.config.slo_ttft_s)
            deadline = r.timings.arrival + ttft_s
            remaining = r.prompt_work_tokens  # a waiting prompt's cached prefix costs nothing
            if r.timings.first_token is not None:
                # Resumed after a preemption: it streams already, so its TTFT is history and what
                # matters is getting its stream going again, first.
                savable.append(((0, deadline, r.seq_no), r))
            elif self.past_saving(remaining, deadline, now):
                late.append(((0, deadline, r.seq_no), r))  # most overdue first: bounded lateness
            elif self._urgent(remaining, deadline, ttft_s, now):
                savable.append(((0, deadline, r.seq_no), r))
            else:
                # Smith's rule with weight 1 / target: the least prompt x target first minimises the
                # sum of TTFT / target; with equal targets it is shortest first.
                savable.append(((1, remaining * ttft_s, r.seq_no), r))
        savable.sort(key=lambda kr: kr[0])
        late.sort(key=lambda kr: kr[0])
        return PrefillOrder([r for _, r in savable], [r for _, r in late])

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
        decode_step_s, per_token = self.timer.coefficients()
        if per_token <= 0:
            return budget  # no timing yet
        room = (self.step_budget_s(decodes, now) - decode_step_s) / per_token
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
            tpot = tpot_target_s(r.params, self.config.slo_tpot_s)
            gaps_after = self.tokens_left(r) - 1  # this step yields one token; these come after it
            future_s = min(recent_s, tpot)
            done_gaps = r.num_output_tokens - 1
            room = tpot * (done_gaps + 1 + gaps_after) - (now - r.timings.first_token) - gaps_after * future_s
            budgets.append(min(max(room, tpot), self.MAX_ITL_FACTOR * tpot))
        return min(budgets, default=self.config.slo_tpot_s)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return min(
            candidates, key=lambda r: (r.timings.first_token is not None, r.num_computed_tokens, -r.seq_no)
        )

    def tokens_ahead(self, pending: Sequence[Pending], new_tokens: int, new_ttft_s: float, now: float) -> int:
        """Queued tokens that would be prefilled before a newcomer: urgent ones and those with a smaller
        prompt x target. Work past saving is not ahead: it only keeps its reserve
        (`newcomer_tokens_per_step`)."""
        return sum(
            tokens
            for tokens, deadline, ttft_s in pending
            if not self.past_saving(tokens, deadline, now)
            and (tokens * ttft_s <= new_tokens * new_ttft_s or self._urgent(tokens, deadline, ttft_s, now))
        )

    def newcomer_tokens_per_step(self, pending: Sequence[Pending], cap: int, now: float) -> int:
        """Prefill tokens per step left to savable work: the cap, less the reserve while work past saving waits."""
        if any(self.past_saving(tokens, deadline, now) for tokens, deadline, _ in pending):
            if cap < 2 * self.min_chunk:  # one chunk a step, every other step the newcomers'
                return max(cap // 2, 1)
            return max(cap - self.past_saving_reserve(cap), 1)
        return cap


def make_policy(
    config: SchedulerConfig,
    timer: StepTimer,
    block_size: int,
    tokens_left: Callable[[Request], int] | None = None,
) -> SchedulePolicy:
    if config.policy == "slo":
        return SloPolicy(config, timer, block_size, tokens_left)
    return FcfsPolicy()
