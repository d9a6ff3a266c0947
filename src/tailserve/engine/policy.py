"""Scheduling policies: in what order prompts are prefilled, how much prefill a step may carry, and
which running request gives its blocks back when the pool runs dry.

- `fcfs`: arrival order; prefill takes whatever budget the decodes leave; the newest request is preempted.
- `slo` (default): each request's TTFT deadline is arrival + target. Requests whose slack is nearly
  gone go first (earliest deadline first); the others go shortest-remaining-prompt first, so a short
  question is not stuck behind a long document. Slack shrinks as a request waits, so every request
  becomes urgent in time: nothing starves. While decodes run, prefill per step is capped so the
  predicted step time keeps every stream's TPOT (an average per token) under target: a stream that
  has run ahead of its target lends that time to prefill, up to 4x the target for one step. The cap
  never drops below a quarter of the step budget, so prefill always progresses. The preemption
  victim is a request still in prefill (no token streamed yet) with the least work done, else the
  decode with the fewest tokens to recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request
from tailserve.engine.stats import StepTimer


class SchedulePolicy(Protocol):
    name: str

    def order_prefills(self, candidates: Sequence[Request], now: float) -> list[Request]: ...

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int: ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request: ...

    def tokens_ahead(self, pending: Sequence[tuple[int, float]], new_tokens: int, now: float) -> int: ...


class FcfsPolicy:
    """First come, first served: the baseline."""

    name = "fcfs"

    def order_prefills(self, candidates: Sequence[Request], now: float) -> list[Request]:
        return sorted(candidates, key=lambda r: r.seq_no)

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int:
        return budget

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: r.seq_no)

    def tokens_ahead(self, pending: Sequence[tuple[int, float]], new_tokens: int, now: float) -> int:
        """Every queued prompt token is ahead of a newcomer."""
        return sum(tokens for tokens, _ in pending)


class SloPolicy:
    """TTFT-deadline-aware ordering with an adaptive prefill cap (see the module docstring)."""

    name = "slo"
    MAX_ITL_FACTOR = 4.0

    def __init__(self, config: SchedulerConfig, timer: StepTimer, block_size: int) -> None:
        self.config = config
        self.timer = timer
        self.min_chunk = block_size

    def _prefill_s(self, tokens: int) -> float:
        _, per_token = self.timer.coefficients()
        return tokens * per_token

    def _urgent(self, remaining_tokens: int, deadline: float, now: float) -> bool:
        # Urgent once the slack left is under a quarter of the target beyond its own prefill time.
        slack = deadline - now - self._prefill_s(remaining_tokens)
        return slack < 0.25 * self.config.slo_ttft_s

    def order_prefills(self, candidates: Sequence[Request], now: float) -> list[Request]:
        def key(r: Request) -> tuple[int, float, int, int]:
            deadline = r.timings.arrival + self.config.slo_ttft_s
            if self._urgent(r.num_uncomputed_tokens, deadline, now):
                return (0, deadline, 0, r.seq_no)
            return (1, 0.0, r.num_uncomputed_tokens, r.seq_no)

        return sorted(candidates, key=key)

    def prefill_cap(self, decodes: Sequence[Request], budget: int, now: float) -> int:
        if not decodes:
            return budget  # no stream to protect
        decode_step_s, per_token = self.timer.coefficients()
        if per_token <= 0:
            return budget  # no timing yet
        room = (self.step_budget_s(decodes, now) - decode_step_s) / per_token
        # Prefill always keeps a quarter of the budget: when decodes alone already miss the TPOT
        # target, starving prompts would not save the streams and would wreck TTFT.
        floor = max(self.min_chunk, budget // 4)
        return min(budget, max(floor, int(room)))

    def step_budget_s(self, decodes: Sequence[Request], now: float) -> float:
        """How long this step may take without pushing any stream's TPOT (its average) over target.

        A stream that got its tokens faster than the target has banked time; the step may spend it,
        up to MAX_ITL_FACTOR x the target so no single gap becomes a visible stall.
        """
        tpot = self.config.slo_tpot_s
        banked = min(
            (
                tpot * r.num_output_tokens - (now - r.timings.first_token)
                for r in decodes
                if r.timings.first_token
            ),
            default=tpot,
        )
        return min(max(banked, tpot), self.MAX_ITL_FACTOR * tpot)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return min(
            candidates, key=lambda r: (r.timings.first_token is not None, r.num_computed_tokens, -r.seq_no)
        )

    def tokens_ahead(self, pending: Sequence[tuple[int, float]], new_tokens: int, now: float) -> int:
        """Queued tokens that would be prefilled before a newcomer of `new_tokens`: urgent ones and shorter ones."""
        return sum(
            tokens
            for tokens, deadline in pending
            if tokens <= new_tokens or self._urgent(tokens, deadline, now)
        )


def make_policy(config: SchedulerConfig, timer: StepTimer, block_size: int) -> SchedulePolicy:
    if config.policy == "slo":
        return SloPolicy(config, timer, block_size)
    return FcfsPolicy()
