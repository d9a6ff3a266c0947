"""Per-step plan: which requests run and how many tokens each, under one token budget.

Decodes go first; prompts are then prefilled in chunks, in the policy's order and under its cap,
with what remains, so a long prompt never takes more than its chunk in a step (a request past saving
keeps a reserve of the budget and the next free sequence slot). When blocks run out,
the policy's victim is preempted by recompute and requeued ahead of newer arrivals. It reads no clock
(the caller hands `now` in) and owns no cache: the engine builds the block manager and the runner holds
the pool's tensors; the scheduler decides which blocks a request holds (allocates, commits after the
step in `postprocess`, frees). It plans and never predicts: wait predictions are
engine/wait_model.py's, from the `queue_snapshot` it hands over.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.policy import SchedulePolicy, make_policy, order_prefills, prefill_item, stream_room_s
from tailserve.engine.request import (
    Request,
    RequestStatus,
    SamplingParams,
    SloTarget,
    tpot_target_s,
    ttft_target_s,
)
from tailserve.engine.stats import DecodeTimer, EngineStats, Ewma, StepTimer, prompt_pairs
from tailserve.engine.tpot_model import Stream
from tailserve.engine.wait_model import QueueSnapshot
from tailserve.errors import ContextLengthExceededError


@dataclass
class StepPlan:
    """The work of one step: (request, number of new tokens to compute) in execution order.

    The first `num_decodes` entries are decodes (one generated token fed back each); the rest are
    prompt chunks, possibly of one token. `block_tables[i]` is entry i's block table for this step.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decodes: int = 0
    prefill_cap: int = 0
    # The prompt chunks run in the decodes' step on all threads, not on the prefill lane: the first
    # prompt's TTFT deadline passes on the lane and not there (Scheduler._all_threads_saves).
    all_threads: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    def split(self) -> tuple[StepPlan, StepPlan]:
        """(the decodes, the prompt chunks) as two plans, to run side by side (the prefill lane)."""
        d, cap = self.num_decodes, self.prefill_cap
        decodes = StepPlan(self.scheduled[:d], self.block_tables[:d], self.preempted, d, cap)
        return decodes, StepPlan(self.scheduled[d:], self.block_tables[d:], [], 0, cap)

    @property
    def prompt_pairs(self) -> int:
        """Query-key pairs of the step's prompt chunks (`prompt_pairs`); read before `postprocess`,
        while each request's computed tokens are still those before this step."""
        return sum(prompt_pairs(n, req.num_computed_tokens) for req, n in self.scheduled[self.num_decodes :])


class Scheduler:
    """Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute."""

    ARRIVALS_WINDOW_S = 30.0  # the recent admitted prompts a newcomer's TPOT price reads a rate from

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, timer: StepTimer | None = None) -> None:
        self.config = config
        self.kv = kv
        self.timer = timer or StepTimer(budget_tokens=config.max_num_batched_tokens)
        self._output_tokens = Ewma()  # output lengths of finished requests: when running ones end
        self.policy: SchedulePolicy = make_policy(
            config, self.timer, kv.block_size, self._steps_left, self._prompt_timer
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._steps = 0  # steps planned with work past saving waiting: whose turn a one-chunk step is
        # Requests whose prompt chunk is computing on another thread (the engine's prefill lane):
        # they get no other work and are never preempted until the engine's `postprocess` of it.
        self.in_flight: set[str] = set()
        self.lane = False  # the engine has a prefill lane: prompt chunks never share a decode step
        # The lane's chunks run on half the threads beside the decode steps: they are timed apart
        # (the engine records them here), so they neither teach the steps' prices nor take them.
        # One timer for both priced a lane chunk 16-25% short and a step with no decode 28% long.
        self.lane_timer = StepTimer(budget_tokens=config.lane_chunk_tokens)
        # Decode-only steps by rows and context, on all threads or beside a lane chunk (the engine
        # records them): what the TPOT price plays the streams' future with.
        self.decode_timer = DecodeTimer()
        # Prompt tokens the first prompt of a step with no decode may take (the engine raises it to
        # --prefill-step-tokens where its kernels allow); the step budget otherwise.
        self.idle_budget = config.max_num_batched_tokens
        # Whether prompt chunks go on the lane now (it exists and a stream decodes), as of the last
        # plan: what the prefill order prices a prompt with (`_prompt_timer`).
        self._prompts_on_lane = False
        # (arrival, prompt tokens to compute) of the requests added in the last ARRIVALS_WINDOW_S:
        # the prompt work that keeps arriving while a newcomer would decode (its TPOT price).
        self._arrivals: deque[tuple[float, int]] = deque()

    def add(self, request: Request) -> None:
        # A request scoring its prompt computes it all (see _admit): it expects no hit.
        if not request.scores_prompt:
            salt = request.params.cache_salt
            request.expected_cached_tokens = self.kv.cached_prefix_tokens(request.token_ids, salt)
        self.waiting.append(request)
        work = len(request.prompt_token_ids) - request.expected_cached_tokens
        self._arrivals.append((request.timings.arrival, max(work, 0)))

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of a prompt the prefix cache holds now under its salt (read-only; any thread)."""
        return self.kv.cached_prefix_tokens(token_ids, cache_salt)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step_plan(self, now: float, prefill: bool = True, lane: bool = False) -> StepPlan:
        """Decide this step's batch at time `now` (the caller's clock); allocates the blocks it needs.
        `prefill=False`: decodes only (the prefill lane is busy). `lane`: the prompt chunks will run
        beside the decodes, not in their step, so the decodes' TPOT does not cap them."""
        plan = StepPlan()
        self._prompts_on_lane = self.lane and any(r.is_decoding for r in self.running)
        scheduled: set[str] = set(self.in_flight)
        budget = self.config.max_num_batched_tokens
        for req in [r for r in self.running if r.is_decoding]:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room
            if self._reserve(req, 1, plan, scheduled):
                plan.scheduled.append((req, 1))
                scheduled.add(req.request_id)
                budget -= 1
        plan.num_decodes = len(plan.scheduled)
        if not prefill:
            plan.block_tables = [list(self.kv.block_table(r.request_id)) for r, _ in plan.scheduled]
            return plan
        if lane:
            budget = self.config.lane_chunk_tokens  # the lane's chunk has a budget of its own
        protect = [] if lane else [r for r, _ in plan.scheduled]
        plan.prefill_cap = self.policy.prefill_cap(protect, budget, now)
        left = min(budget, plan.prefill_cap)
        candidates = [r for r in self.running if not r.is_decoding and r.request_id not in self.in_flight]
        candidates += [r for r in self.waiting if r.not_before <= now]  # a held prompt waits its turn
        order = order_prefills(self.policy, candidates, now, self.config.slo_ttft_s)
        first = next(iter([*order.savable, *order.past_saving]), None)
        if lane and first is not None:
            decodes = [r for r, _ in plan.scheduled]
            if self._lane_waits(first, decodes, now):
                left = 0  # the decodes take all threads this step; the lane goes once they have room
            elif self._all_threads_saves(first, decodes, now):
                plan.all_threads = True
                step_cap = max(self.config.max_num_batched_tokens, self.idle_budget) - plan.num_decodes
                left = min(left, max(step_cap, 0))
        if first is not None and self._idle_step_longer(plan.num_decodes):
            # No stream to protect: the first prompt in order may go in one longer step, up to
            # idle_budget. Only the first: a queue of prompts still goes a budget at a time, so a
            # request that arrives meanwhile (an urgent one) waits for one prompt, not for the queue.
            left = max(left, min(self._idle_step_tokens(), first.num_uncomputed_tokens))
        # Requests past saving keep a reserve of the step; savable ones take the rest first, and
        # whatever they leave goes to the late ones too (nothing idles while work waits).
        # A late request still waiting for a sequence slot has the next free one: savable newcomers
        # stop one slot short. Otherwise, under a steady stream of them, every slot that frees goes
        # to a newcomer and the late request waits until the stream ends (seen at 1.5x capacity:
        # TTFT 13.7 s against a 0.55 s target).
        reserve, slots = 0, self.config.max_num_seqs
        if order.past_saving:
            self._steps += 1
            late_running = any(r.status is RequestStatus.RUNNING for r in order.past_saving)
            if late_running or len(self.running) < slots:  # else no late one could use a reserve
                reserve = self.policy.past_saving_reserve(left, self._steps)
            if not all(r.status is RequestStatus.RUNNING for r in order.past_saving):
                slots -= 1
        used, admitting = self._prefill_chunks(
            order.savable, left - reserve, plan, scheduled, now, slots=slots
        )
        self._prefill_chunks(order.past_saving, left - used, plan, scheduled, now, admitting)
        plan.block_tables = [list(self.kv.block_table(r.request_id)) for r, _ in plan.scheduled]
        return plan

    def _prefill_chunks(
        self,
        requests: list[Request],
        left: int,
        plan: StepPlan,
        scheduled: set[str],
        now: float,
        admitting: bool = True,
        slots: int | None = None,
    ) -> tuple[int, bool]:
        """Prompt chunks for `requests` in order within `left` tokens, admitting waiting ones while
        fewer than `slots` (default --max-num-seqs) run; (tokens used, whether waiting requests may
        still be admitted this step)."""
        used = 0
        slots = self.config.max_num_seqs if slots is None else slots
        for req in requests:
            if used >= left:
                break
            if req.status is RequestStatus.RUNNING:
                n = min(req.num_uncomputed_tokens, left - used)
                if not self._reserve(req, n, plan, scheduled):
                    continue
            else:
                # A waiting request that cannot start holds up no running prompt behind it in the
                # order (those still get their chunks), only the waiting ones behind it.
                if not admitting or (slots < self.config.max_num_seqs and len(self.running) >= slots):
                    continue  # (the last free slot is kept for a late request)
                if plan.preempted or len(self.running) >= self.config.max_num_seqs:
                    # The pool or the batch is full: admitting now would only preempt again.
                    admitting = False
                    continue
                n = self._admit(req, left - used, now)
                if n == 0:
                    admitting = False
                    continue  # not enough blocks; retried next step (ahead of anyone behind it)
            plan.scheduled.append((req, n))
            scheduled.add(req.request_id)
            used += n
        return used, admitting

    def postprocess(self, plan: StepPlan) -> None:
        """After the model ran the plan: its tokens are computed, and full blocks join the prefix cache."""
        for req, n in plan.scheduled:
            req.num_computed_tokens += n
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)

    def _reserve(self, req: Request, n: int, plan: StepPlan, scheduled: set[str]) -> bool:
        """Blocks for n more tokens of a running request, preempting others if needed; False if it was preempted itself."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
            others = [r for r in self.running if r is not req and r.request_id not in scheduled]
            victim = self.policy.pick_victim(others) if others else req
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, req: Request, left: int, now: float) -> int:
        """Move a waiting request to running with its first chunk; 0 if its blocks don't fit."""
        # A cached prefix has no logits: a request scoring its prompt computes it all (a lookup of nothing).
        cached = self.kv.match_prefix(
            req.request_id, req.token_ids[:1] if req.scores_prompt else req.token_ids, req.params.cache_salt
        )
        req.num_computed_tokens = cached
        n = min(req.num_uncomputed_tokens, left)
        if not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
            # A waiting request holds no block: blocks held while not running could starve the
            # running ones and stall the whole pool.
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            return 0
        self.kv.count_lookup(len(req.token_ids), cached)
        if req.timings.first_scheduled is None:
            req.timings.cached_tokens = cached
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        if req.timings.first_scheduled is None:
            req.timings.first_scheduled = now
        self.running.append(req)
        return n

    def fork(self, parent: Request, child: Request, now: float) -> None:
        """Start `child`, a sibling with the same prompt, once `parent`'s prompt is computed: it takes
        the parent's full prompt blocks by reference and recomputes only the partial last block (its
        own first sample needs that last position's logits). With the batch full it queues instead,
        and still hits the prefix cache."""
        if len(self.running) >= self.config.max_num_seqs:
            self.add(child)
            return
        shared = (parent.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        self.kv.fork(parent.request_id, child.request_id, shared)  # full blocks only: no copy
        child.num_computed_tokens = shared
        child.status = RequestStatus.RUNNING
        child.timings.cached_tokens = shared
        child.timings.first_scheduled = now
        self.kv.count_lookup(len(child.token_ids), shared)
        self.running.append(child)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and put it back at the head of the queue, to be recomputed."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.timings.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request wherever it is and free every block it holds."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if reason in ("stop", "length") and req.num_output_tokens > 0:
            self._output_tokens.record(req.num_output_tokens)

    # ----- limits, pool state and what the wait model reads ------------------------------------
    def stats(self) -> EngineStats:
        """Queue, pool and prefix-cache counters as one snapshot."""
        kv = self.kv
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            prefix_cache_collisions=kv.prefix_collisions,
            preemptions_total=self.num_preemptions,
            steps_total=self.timer.steps + self.lane_timer.steps,
        )

    def check_fits_pool(self, num_tokens: int) -> None:
        """Refuse a request whose whole context could never be held by the pool at once."""
        kv = self.kv
        if -(-num_tokens // kv.block_size) > kv.num_blocks:
            raise ContextLengthExceededError(
                f"prompt + max_tokens ({num_tokens} tokens) exceeds the whole KV pool "
                f"({kv.num_blocks * kv.block_size} tokens): lower max_tokens or give the pool more memory",
                param="max_tokens",
            )

    def _lane_waits(self, first: Request, decodes: list[Request], now: float) -> bool:
        """Whether the prefill lane sits out this step so that no stream is pushed over its TPOT
        target (--pace-lane; issue 40: steps bounded by what each stream's target allows).

        A lane chunk of C seconds slows the decodes beside it from their all-threads step to their
        step beside the lane (`DecodeTimer`): a stream loses C x (1 - all / beside) against decoding
        on all threads, or only its own steps' share where it ends first (n gaps left: n x beside
        in place of C). Its room is its target times all its gaps, less the time taken so far, less
        its expected remaining gaps at the all-threads step: the lane goes when every stream's room
        covers the loss. A stream predicted to miss even without the chunk (no room) holds nothing
        back, as at admission. The rule gives way to the first prompt in order whose TTFT deadline
        would otherwise pass: once its prefill, still to run on the lane, plus one chunk's wait
        would end after its deadline, the lane runs whatever the streams' room."""
        if not self.config.pace_lane or not decodes:
            return False
        timer = self.lane_timer
        _, per_token = timer.coefficients()
        if per_token <= 0:
            return False  # no chunk timed yet
        work, start = _prompt_work(first)
        chunk = min(work, self.config.lane_chunk_tokens)
        chunk_s = timer.estimate_s(chunk, 0, None, prompt_pairs(chunk, start))
        rest_s = timer.estimate_s(work, 0, None, prompt_pairs(work, start))
        deadline = first.timings.arrival + ttft_target_s(first.slo, self.config.slo_ttft_s)
        if first.timings.first_token is None and now + rest_s + chunk_s > deadline:
            return False  # its TTFT target needs the lane now
        rows, context = len(decodes), sum(len(r.token_ids) for r in decodes)
        all_s = self.decode_timer.estimate_s(rows, context, False)
        beside_s = self.decode_timer.estimate_s(rows, context, True)
        if all_s is None or beside_s is None or beside_s <= all_s:
            return False
        slower = 1.0 - all_s / beside_s
        for r in decodes:
            if r.timings.first_token is None:
                continue
            tpot = tpot_target_s(r.slo, self.config.slo_tpot_s)
            left = self._steps_left(r)
            room = stream_room_s(r, tpot, now, left, min(all_s, tpot))
            # A stream that ends during the chunk loses only its own steps beside it.
            if 0 <= room < min(chunk_s, left * beside_s) * slower:
                return True
        return False

    # The lane's slow chunks against its price: served chat-scaled on the no-bf16 kind (2 threads,
    # 0.35 req/s), 512-token chunks took 0.43 / 0.55 / 0.72 s at p10 / p50 / p90. Priced at the
    # median, a prompt the lane would end just in time ended late about half the time.
    LANE_SPREAD = 1.3

    def _all_threads_saves(self, first: Request, decodes: list[Request], now: float) -> bool:
        """Whether the first prompt's chunk runs in this step with the decodes, on all threads, rather
        than on the prefill lane (--late-prompts-all-threads): its prefill, run on the lane from now,
        would end after its TTFT deadline, run on all threads it would not, and every decoding
        stream's TPOT target has room for the long step. The lane's price is its chunks' mean: it
        counts as missing where LANE_SPREAD times it does.

        On a CPU whose lane (half the threads) takes a long prompt's prefill past the TTFT target
        (2,048 tokens on one of two threads without AMX), that prompt missed whatever the queue;
        all threads save it. The cost is the decodes': one step of the chunk's length in place of
        a decode step, a long gap (a long inter-token latency) that each stream's TPOT target must
        still cover. Its room is priced as `_lane_waits` prices it, with the gaps left at the step
        beside the lane (the slower of the two, as if prompts kept the lane busy from now on). A
        prompt past saving on all threads too keeps the lane: the streams keep their steps."""
        if not self.config.late_prompts_all_threads or not decodes or first.timings.first_token is not None:
            return False
        steps, lane = self.timer, self.lane_timer
        if steps.coefficients()[1] <= 0 or lane.coefficients()[1] <= 0:
            return False  # a prompt not yet timed on one of them
        work, start = _prompt_work(first)
        chunk_tokens = self.config.lane_chunk_tokens
        pairs = prompt_pairs(work, start)
        deadline = first.timings.arrival + ttft_target_s(first.slo, self.config.slo_ttft_s)
        if now + self.LANE_SPREAD * lane.estimate_s(work, 0, chunk_tokens, pairs) <= deadline:
            return False  # the lane makes it, even at its slow chunks' pace
        if now + steps.estimate_s(work, 0, chunk_tokens, pairs) > deadline:
            return False  # past saving either way
        chunk = min(work, chunk_tokens)
        step_s = steps.estimate_s(chunk, 0, chunk, prompt_pairs(chunk, start))
        rows, context = len(decodes), sum(len(r.token_ids) for r in decodes)
        all_s = self.decode_timer.estimate_s(rows, context, False)
        beside_s = self.decode_timer.estimate_s(rows, context, True)
        if all_s is None or beside_s is None:
            return False
        for r in decodes:
            if r.timings.first_token is None:
                continue
            tpot = tpot_target_s(r.slo, self.config.slo_tpot_s)
            room = stream_room_s(r, tpot, now, self._steps_left(r), min(max(all_s, beside_s), tpot))
            if room < step_s - all_s:
                return False
        return True

    def held_s(self, now: float) -> float:
        """Seconds until the first waiting prompt held by admission may start; 0 if none is held."""
        return min((r.not_before - now for r in self.waiting if r.not_before > now), default=0.0)

    def queue_snapshot(self, now: float) -> QueueSnapshot:
        """Prompt work not yet done, with each request's TTFT deadline: what admission control reads."""
        prefilling = [*self.waiting, *(r for r in self.running if not r.is_decoding)]
        decoding = [r for r in self.running if r.is_decoding]
        # With a lane, the prompts behind the first go there in its chunks (the first may too).
        budget = self.config.lane_chunk_tokens if self.lane else self.config.max_num_batched_tokens
        pending = [prefill_item(r, self.config.slo_ttft_s) for r in prefilling]
        running_prefills = sum(1 for r in self.running if not r.is_decoding)
        return QueueSnapshot(
            pending=pending,
            num_running=len(self.running),
            prefill_cap=self.policy.prefill_cap([] if self.lane else decoding, budget, now),
            steady_cap=0 if self.lane else self.policy.steady_cap(decoding, budget),
            running_prefills=running_prefills,
            slots_free_steps=tuple(sorted(self._steps_left(r) for r in self.running)),
            max_num_seqs=self.config.max_num_seqs,
            idle_step_tokens=self._idle_step_tokens() if self._idle_step_longer(len(decoding)) else 0,
            lane=self.lane,
            streams=tuple(self._stream(r) for r in decoding),
            pending_streams=tuple(self._stream(r) for r in prefilling),
            recent_prompts=self._recent_prompts(now),
            recent_window_s=self.ARRIVALS_WINDOW_S,
            step_began=now if self._step_follows(now, bool(decoding)) else None,
        )

    def _step_follows(self, now: float, decoding: bool) -> bool:
        """Whether the engine starts a step as it takes the snapshot (it publishes one between
        steps): it has work it may run now. Not where the prefill lane computes prompts beside the
        decodes: its chunk runs apart from the steps."""
        if self.lane and decoding:
            return False
        return bool(self.running) or any(r.not_before <= now for r in self.waiting)

    def _recent_prompts(self, now: float) -> tuple[int, ...]:
        """Prompt tokens to compute of the requests added in the last ARRIVALS_WINDOW_S."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < now - self.ARRIVALS_WINDOW_S:
            arrivals.popleft()
        return tuple(tokens for _, tokens in arrivals)

    def _stream(self, req: Request) -> Stream:
        """A running or queued request as the TPOT price sees it."""
        tpot_s = tpot_target_s(req.slo, self.config.slo_tpot_s)
        if req.is_decoding and req.timings.first_token is not None:
            done = req.num_output_tokens - 1
            return Stream(tpot_s, self._steps_left(req), len(req.token_ids), done, req.timings.first_token)
        stream = self.new_stream(len(req.token_ids), req.params, req.slo)
        return replace(stream, start_at=req.not_before) if req.not_before else stream

    def new_stream(self, prompt_tokens: int, params: SamplingParams, slo: SloTarget | None) -> Stream:
        """A request not yet streaming as the TPOT price sees it: its expected gaps (its max_tokens, or
        fewer where finished requests have been ending sooner) after its prompt."""
        tokens = self._expected_output_tokens(params)
        return Stream(tpot_target_s(slo, self.config.slo_tpot_s), max(tokens - 1, 0), prompt_tokens + 1)

    def _expected_output_tokens(self, params: SamplingParams) -> int:
        """Output tokens a request is expected to make in all: its max_tokens where nothing can end
        it sooner (ignore_eos, no stop strings or tokens: a benchmark's fixed lengths), else at most
        the mean output length of finished requests."""
        typical = self._output_tokens.mean
        if typical is None or (params.ignore_eos and not params.stop and not params.stop_token_ids):
            return params.max_tokens
        return min(params.max_tokens, max(math.ceil(typical), 1))

    def _idle_step_tokens(self) -> int:
        """Prompt tokens the first prompt in line may take in a step with no decode: the idle budget,
        or fewer where a step that long is predicted to take more than half the tightest TTFT target
        served (a request of that class arriving as the step starts waits it out, then prefills);
        never fewer than the step budget. Without timed steps, the idle budget."""
        budget, limit = self.config.max_num_batched_tokens, self.idle_budget
        bound_s = 0.5 * (self.config.tightest_ttft_s or self.config.slo_ttft_s)

        def step_s(tokens: int) -> float:
            return self.timer.estimate_s(tokens, 0, tokens, prompt_pairs(tokens, 0))

        if limit <= budget or step_s(limit) <= bound_s:
            return limit
        low, high = budget, limit  # step_s(high) > bound_s; the budget is the floor either way
        while high - low > self.kv.block_size:
            mid = (low + high) // 2
            low, high = (mid, high) if step_s(mid) <= bound_s else (low, mid)
        return low

    def _prompt_timer(self) -> StepTimer:
        """What the prefill order prices a prompt's own prefill with (its slack, so whether it is
        urgent or past saving): the lane's chunks, on half the threads, while prompts go there and
        once it has timed one; else the steps'. Where a prompt late on the lane may run on all
        threads (--late-prompts-all-threads), the steps': a prompt is past saving only where all
        threads would not save it either. The wait model prices the work ahead of a newcomer at the
        lane's speed all the same (`WaitModel._chunk_timer`; docs/ENGINE.md says why). Priced by the lane's, a prompt the lane would end late went
        behind every newcomer the lane could still serve in time, and waited for them (chat-scaled
        at 0.35 req/s on the no-bf16 kind: a 1,475-token prompt with nothing ahead of it on arrival,
        predicted 1.87 s, took 5.91 s)."""
        if self.config.late_prompts_all_threads:
            return self.timer
        if self._prompts_on_lane and self.lane_timer.coefficients()[1] > 0:
            return self.lane_timer
        return self.timer

    def _idle_step_longer(self, num_decodes: int) -> bool:
        """Whether a step may give the first prompt in line more than the step budget (the rule
        step_plan follows and queue_snapshot reports): no stream decodes, no chunk is in flight,
        and the idle budget is the larger."""
        return (
            num_decodes == 0 and not self.in_flight and self.idle_budget > self.config.max_num_batched_tokens
        )

    def _steps_left(self, req: Request) -> int:
        """Decode steps until a running request is expected to end: its max_tokens left, or fewer where
        finished requests have been ending sooner (the mean output length so far)."""
        return max(self._expected_output_tokens(req.params) - req.num_output_tokens, 1)


def _prompt_work(req: Request) -> tuple[int, int]:
    """(prompt tokens still to compute, the context before them) of a request waiting or prefilling."""
    work = req.num_uncomputed_tokens if req.status is RequestStatus.RUNNING else req.prompt_work_tokens
    return work, max(len(req.token_ids) - work, 0)
