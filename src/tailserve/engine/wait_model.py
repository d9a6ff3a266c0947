"""The wait model: how long a newcomer would wait for its first token, for admission control.

It reads the planner's rules and never restates them: a newcomer goes behind the queued prompts the
policy's `rank` puts ahead of it (the order the scheduler sorts by), at the rate the policy's
past-saving reserve leaves, and then takes its own prefill. It only prices a `QueueSnapshot`: it
never changes a queue or a cache.

A newcomer whose own prefill cannot end within its target even if it started now is past saving
from the start: the planner puts it behind every savable prompt and behind the late ones with
earlier deadlines, so all of those are ahead of it. (Pricing it like a savable newcomer, which
never counts late work ahead, predicted a wait of 0 for a burst of long prompts on a server whose
recent steps had been slow: 60 of 60 admitted, the last waiting 127 s. Issue 40.)
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from tailserve.engine.policy import PrefillItem, PrefillRank
from tailserve.engine.stats import DecodeTimer, StepTimer, prompt_pairs
from tailserve.engine.tpot_model import Stream, TpotPrice, price

NEWCOMER_SEQ_NO = sys.maxsize  # a newcomer arrives after everyone queued: it loses every tie
UNSEEN_SEQ_NO = (
    NEWCOMER_SEQ_NO - 1
)  # handed to the engine, not yet queued: behind the queue, ahead of a newcomer


class PlanRules(Protocol):
    """The planner's rules the wait model reads (a `SchedulePolicy` has them)."""

    def rank(self, item: PrefillItem, now: float) -> PrefillRank: ...

    def past_saving_reserve(self, left: int, step_no: int = 1) -> int: ...


@dataclass(frozen=True)
class QueueSnapshot:
    """Prompt work not yet done, taken between steps: what a wait prediction reads."""

    pending: list[PrefillItem]
    num_running: int
    prefill_cap: int
    # The cap once the streams' banked room is spent (SchedulePolicy.steady_cap; 0: none, as with a
    # lane): what prompts beside streams get after the first steps.
    steady_cap: int = 0
    # Sequence slots: a newcomer also waits for one once the batch is full (max_num_seqs). Of
    # `pending`, `running_prefills` already hold a slot; `slots_free_steps` is, per running request,
    # the decode steps until it is expected to end, ascending; max_num_seqs 0: no slot limit known.
    running_prefills: int = 0
    slots_free_steps: tuple[int, ...] = ()
    max_num_seqs: int = 0
    # Prompt tokens the next step gives the first prompt in line because nothing decodes and nothing
    # is in flight (Scheduler.idle_budget; it goes on so until that prompt is done); 0: not idle, or
    # no longer step than the budget.
    idle_step_tokens: int = 0
    lane: bool = False  # prompt chunks run on the prefill lane while streams decode
    # The TPOT price's view (engine/tpot_model.py): the streams decoding now, and the stream each of
    # `pending` turns into once its prompt is done (a pending item without one gets `default_stream`).
    streams: tuple[Stream, ...] = ()
    pending_streams: tuple[Stream, ...] = ()
    # Prompt tokens to compute of the requests admitted in the last `recent_window_s` seconds: the
    # prompt work that keeps arriving while the streams decode (WaitModel.arrivals_share).
    recent_prompts: tuple[int, ...] = ()
    recent_window_s: float = 0.0
    # When the step that follows the snapshot began (it is taken as the engine starts that step):
    # a newcomer priced later finds it part done. None: no step follows (nothing to run), or the
    # prefill lane computes prompts apart from the steps.
    step_began: float | None = None


def unseen_item(tokens: int, arrival: float, ttft_s: float) -> PrefillItem:
    """A request handed to the engine that no step has queued yet (counted ahead of later newcomers)."""
    return PrefillItem(tokens, arrival + ttft_s, ttft_s, UNSEEN_SEQ_NO)


def work_ahead(
    rules: PlanRules, pending: Sequence[PrefillItem], newcomer: PrefillItem, now: float
) -> list[PrefillItem]:
    """The queued prompts the planner would prefill before `newcomer`: those it ranks ahead. Work
    past saving is never ahead of a savable newcomer: it only keeps its reserve
    (`savable_tokens_per_step`); a newcomer past saving itself has every savable prompt ahead and
    the late ones the rank puts first (earlier deadlines)."""
    mine = rules.rank(newcomer, now)
    return [
        p for p in pending if (r := rules.rank(p, now)) < mine and (mine.past_saving or not r.past_saving)
    ]


def tokens_ahead(rules: PlanRules, pending: Sequence[PrefillItem], newcomer: PrefillItem, now: float) -> int:
    """Queued prompt tokens the planner would prefill before `newcomer` (`work_ahead`)."""
    return sum(p.tokens for p in work_ahead(rules, pending, newcomer, now))


def savable_tokens_per_step(rules: PlanRules, cap: int) -> int:
    """Prefill tokens a step leaves savable work while work past saving waits: the cap less the
    reserve, over two steps (a step with room for one chunk alternates between the two)."""
    return max(sum(cap - rules.past_saving_reserve(cap, step_no) for step_no in (1, 2)) // 2, 1)


class Wait(NamedTuple):
    """A newcomer's predicted time to first token, and what it would be with nothing queued ahead."""

    ttft_s: float  # the work the planner puts ahead of it, then its own prefill
    alone_s: float  # its own prefill at the load running now: the least any admission could promise

    @property
    def queued(self) -> bool:
        """Whether any work is predicted ahead of it (else it starts with the next step)."""
        return self.ttft_s > self.alone_s


class StepNow(NamedTuple):
    """The step the engine runs as a newcomer is priced (`WaitModel._step_now`)."""

    seconds: float  # its predicted length (0: no step runs, or none is known)
    ahead: bool  # it carries prompt work the planner puts ahead of the newcomer
    stream_after: bool  # an idle step that ends a prompt behind the newcomer: it decodes after it


class WaitModel:
    """Predicts a newcomer's time to first token from a queue snapshot and the recent step times."""

    # A newcomer held until a stream ends must get its first token within this share of its TTFT
    # target, by the price: a held prompt starts late and the price's error then has no slack
    # (virtual time, chat-scaled at 0.4 req/s: with the whole target 3 of 5 held requests missed it
    # by up to 20%, with 90% none).
    HOLD_TTFT_SHARE = 0.9

    def __init__(
        self,
        rules: PlanRules,
        timer: StepTimer,
        slo_ttft_s: float,
        lane_timer: StepTimer | None = None,
        decode_timer: DecodeTimer | None = None,
        admission_hold: bool = False,
    ) -> None:
        self.rules = rules
        self.timer = timer  # the engine's steps
        self.slo_ttft_s = slo_ttft_s
        self.lane_timer = lane_timer  # the prefill lane's chunks, on half the threads
        self.decode_timer = decode_timer  # decode steps by rows and context, for the TPOT price
        self.admission_hold = admission_hold  # the TPOT price may hold a newcomer (tpot_model.price)

    def _chunk_timer(self, snapshot: QueueSnapshot) -> tuple[StepTimer, bool]:
        """What prices prompt chunks that run while streams decode: the lane's timer where the engine
        has a lane and it has timed a chunk, else the steps'; and whether it is the lane's."""
        lane = self.lane_timer
        if snapshot.lane and lane is not None and lane.coefficients()[1] > 0:
            return lane, True
        return self.timer, False

    def estimate_s(
        self, num_prompt_tokens: int, snapshot: QueueSnapshot, now: float, ttft_s: float | None = None
    ) -> float:
        """Predicted time to a new request's first token (`estimate(...).ttft_s`)."""
        return self.estimate(num_prompt_tokens, snapshot, now, ttft_s).ttft_s

    def estimate(
        self, num_prompt_tokens: int, snapshot: QueueSnapshot, now: float, ttft_s: float | None = None
    ) -> Wait:
        """Predicted time to a new request's first token: the prefill work the policy puts ahead of it,
        plus its own (zero work, zero time); and its own alone. `ttft_s` is the newcomer's own TTFT
        target (default --slo-ttft)."""
        target = self.slo_ttft_s if ttft_s is None else ttft_s
        pending, rules = snapshot.pending, self.rules
        newcomer = PrefillItem(num_prompt_tokens, now + target, target, NEWCOMER_SEQ_NO)
        before = work_ahead(rules, pending, newcomer, now)
        mine, ranks = rules.rank(newcomer, now), [rules.rank(p, now) for p in pending]
        per_step, idle_step = snapshot.prefill_cap, snapshot.idle_step_tokens
        step_now = self._step_now(snapshot, ranks, mine)
        if step_now.stream_after:  # the prompt in the idle step running now decodes after it
            idle_step = 0
        if snapshot.steady_cap and (snapshot.streams or before or step_now.stream_after):
            # Beside streams (those decoding now, and the prompts ahead once done) the room the
            # streams banked goes in the first long steps; the steps after get the steady cap.
            per_step = min(per_step, snapshot.steady_cap)
        if not mine.past_saving and any(r.past_saving for r in ranks):
            # The late ones keep their reserve, of a longer step too.
            per_step = savable_tokens_per_step(rules, per_step)
            idle_step = savable_tokens_per_step(rules, idle_step) if idle_step else 0
        own_pairs = prompt_pairs(num_prompt_tokens, 0)
        # On an idle engine the first prompt in line goes in steps of the idle budget, with no
        # decode beside them; the others a budget at a time (Scheduler.step_plan). Priced in
        # budget-sized steps, a 2,000-token prompt alone was predicted 8 steps' fixed costs long.
        # Behind the first prompt (it decodes once its prompt is done) they go beside decodes: on the
        # lane, if the engine has one, whose chunks carry no decode row.
        chunks, on_lane = self._chunk_timer(snapshot)
        rows = 0 if on_lane else max(snapshot.num_running, int(step_now.stream_after))
        # Chunked, the newcomer's last step carries whatever prompts are behind it by then, up to the
        # step's room: its first token comes at that step's end (a burst of 600-token prompts in
        # 255-token chunks, each ended in a step shared with the next: 10% over the price).
        if idle_step:
            own_s = self.timer.estimate_s(num_prompt_tokens, 0, idle_step, own_pairs)
        else:
            own_s = chunks.estimate_s(num_prompt_tokens, rows, per_step, own_pairs, full_last_step=True)
        prefill_s = own_s
        if before:
            head_s, rest = 0.0, before
            if idle_step:  # the first of the work ahead takes the idle steps, not the newcomer
                head = min(before, key=lambda p: rules.rank(p, now))
                rest = [p for p in before if p is not head]
                head_pairs = prompt_pairs(head.tokens, head.start)
                head_s = self.timer.estimate_s(head.tokens, 0, idle_step, head_pairs)
            pairs = own_pairs + sum(prompt_pairs(p.tokens, p.start) for p in rest)
            tokens = sum(p.tokens for p in rest) + num_prompt_tokens
            prefill_s = head_s + chunks.estimate_s(tokens, rows, per_step, pairs, full_last_step=True)
        # The step running now began as the snapshot was taken: what it carries ahead of the
        # newcomer is part done; a step of decodes, or of a prompt behind it, the newcomer waits out
        # before its own first step (alone too: no admission could start it sooner).
        alone_s, since_s = own_s, 0.0
        if step_now.seconds > 0:
            assert snapshot.step_began is not None
            since_s = max(now - snapshot.step_began, 0.0)
            if step_now.ahead:
                prefill_s = max(prefill_s - min(since_s, step_now.seconds), own_s)
            else:
                left_s = max(step_now.seconds - since_s, 0.0)
                prefill_s, alone_s = prefill_s + left_s, own_s + left_s
        if snapshot.num_running + len(pending) < snapshot.max_num_seqs:
            return Wait(prefill_s, alone_s)  # room in the batch for everyone queued and the newcomer
        # Ahead of it for a slot: what the policy prefills first, and late requests (the next free
        # slot is theirs). The steps until one frees count from the snapshot.
        queued = sum(1 for r in ranks if r < mine or r.past_saving)
        slot_s = self._slot_wait_s(snapshot, max(queued - snapshot.running_prefills, 0))
        return Wait(max(prefill_s, max(slot_s - since_s, 0.0) + own_s), alone_s)

    def _step_now(self, snapshot: QueueSnapshot, ranks: Sequence[PrefillRank], mine: PrefillRank) -> StepNow:
        """The step the engine runs now, as planned from the snapshot: on an idle engine, the first
        prompt in line for up to the idle budget's tokens; else the decodes and up to the prefill
        cap of the queued prompts, first in line first. Requests handed over since the snapshot are
        not in it. `ranks`: the queued prompts' (`snapshot.pending`); `mine`: the newcomer's."""
        if snapshot.step_began is None:
            return StepNow(0.0, False, False)
        in_line = sorted(
            ((r, p) for r, p in zip(ranks, snapshot.pending, strict=True) if p.seq_no != UNSEEN_SEQ_NO),
            key=lambda rp: rp[0],
        )
        seen = [p for _, p in in_line]
        rows = len(snapshot.streams)
        if not seen:
            return StepNow(self.timer.coefficients()[0] if rows else 0.0, False, False)
        head = seen[0]
        ahead = in_line[0][0] < mine
        idle = snapshot.idle_step_tokens
        if idle:
            tokens = min(head.tokens, idle)
            seconds = self.timer.estimate_s(tokens, 0, idle, prompt_pairs(tokens, head.start))
            return StepNow(seconds, ahead, not ahead and tokens == head.tokens)
        cap, tokens, pairs = max(snapshot.prefill_cap, 1), 0, 0
        for p in seen:
            take = min(p.tokens, cap - tokens)
            tokens, pairs = tokens + take, pairs + prompt_pairs(take, p.start)
            if tokens >= cap:
                break
        return StepNow(self.timer.estimate_s(tokens, rows, cap, pairs), ahead, False)

    def _slot_wait_s(self, snapshot: QueueSnapshot, queued_ahead: int) -> float:
        """Seconds until a sequence slot is free for a newcomer behind `queued_ahead` queued requests:
        0 while the batch has room; else until enough running requests end, at the recent step time."""
        steps = snapshot.slots_free_steps
        need = snapshot.num_running + queued_ahead + 1 - snapshot.max_num_seqs
        if snapshot.max_num_seqs <= 0 or need <= 0 or not steps:
            return 0.0
        rounds = math.ceil(need / len(steps))  # more slots wanted than run now: the batch turns over
        return rounds * steps[min(need, len(steps)) - 1] * self.timer.recent_step_s()

    def tpot_price(
        self,
        num_prompt_tokens: int,
        own: Stream,
        snapshot: QueueSnapshot,
        now: float,
        ttft_s: float | None = None,
    ) -> TpotPrice | None:
        """The newcomer's TPOT price (engine/tpot_model.py): every stream's predicted TPOT with it and
        without it, the queued prompts run in the planner's order (`rank`), each priced as the wait
        model prices prompt work; None until a decode step has been timed."""
        decode = self.decode_timer
        if decode is None or decode.estimate_s(1, 0, False) is None:
            return None
        target = self.slo_ttft_s if ttft_s is None else ttft_s
        rules, pending = self.rules, snapshot.pending
        chunks, on_lane = self._chunk_timer(snapshot)
        rows = 0 if on_lane else len(snapshot.streams)

        def prefill_s(item: PrefillItem) -> float:
            return chunks.estimate_s(
                item.tokens, rows, snapshot.prefill_cap, prompt_pairs(item.tokens, item.start)
            )

        newcomer = PrefillItem(num_prompt_tokens, now + target, target, NEWCOMER_SEQ_NO)
        streams = snapshot.pending_streams
        ranks = [rules.rank(p, now) for p in pending]
        order = sorted(range(len(pending)), key=ranks.__getitem__)
        prompts = [(prefill_s(pending[i]), streams[i] if i < len(streams) else own) for i in order]
        mine = rules.rank(newcomer, now)
        place = sum(1 for r in ranks if r < mine)
        step_fixed, per_token = self.timer.coefficients()
        prompt_fixed = self.timer.prompt_step_s()
        lane, cap = snapshot.lane, snapshot.prefill_cap

        # Prompts admitted after the newcomer keep its future steps beside prompt work for a share
        # of the time, as recent ones did: steps outside the known prompts' runs are priced at the
        # rate the decodes keep at that share. Without it, a stream's TPOT ran 1.25x its price with
        # one arrival during its life, 1.5x with two, 1.7-1.9x with five (no-bf16 CPU, 256 in / 32
        # out at 1-3 req/s; with none, 0.95x: docs/notes/tail-under-slo.md, "Arrivals in the TPOT
        # price").
        def work_s(item: PrefillItem) -> float:
            """A prompt's own compute: on the lane, its chunks' time; in the steps, beyond their
            decode rows."""
            if lane:
                return prefill_s(item)
            steps = math.ceil(item.tokens / max(cap, 1))
            return max(prefill_s(item) - steps * step_fixed, 0.0)

        share = self.arrivals_share(snapshot, work_s)

        def known_s(rows: int, context: int, busy: bool) -> float:
            if lane:
                return decode.estimate_s(rows, context, busy) or 0.0
            # No lane: prompt chunks share the steps, up to the prefill cap each.
            prompt_s = prompt_fixed + per_token * cap if busy else 0.0
            return (decode.estimate_s(rows, context, False) or 0.0) + prompt_s

        def step_s(rows: int, context: int, busy: bool) -> float:
            if busy or share == 0.0:
                return known_s(rows, context, busy)
            idle, beside = known_s(rows, context, False), known_s(rows, context, True)
            if share >= 1.0 or idle <= 0.0:
                return beside
            if lane:  # beside the lane a share of the time: steps at the mean rate of the two
                return 1.0 / ((1.0 - share) / idle + share / beside)
            return min(idle / (1.0 - share), beside)  # the prompts' compute takes a share of each step

        budget = target * self.HOLD_TTFT_SHARE if self.admission_hold else None
        return price(snapshot.streams, prompts, (place, prefill_s(newcomer), own), now, step_s, budget)

    @staticmethod
    def arrivals_share(snapshot: QueueSnapshot, work_s: Callable[[PrefillItem], float]) -> float:
        """The share of time prompt work is expected to run from arrivals still to come: the recent
        admitted prompts' own compute (`work_s`) over the window they arrived in, at most 1 (0
        with no window)."""
        if snapshot.recent_window_s <= 0 or not snapshot.recent_prompts:
            return 0.0
        by_length = Counter(t for t in snapshot.recent_prompts if t > 0)  # priced once a length
        seconds = sum(n * work_s(PrefillItem(t, 0.0, 1.0, NEWCOMER_SEQ_NO)) for t, n in by_length.items())
        return min(seconds / snapshot.recent_window_s, 1.0)
