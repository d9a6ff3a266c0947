"""Per-step plan: which requests run and how many tokens each, under one token budget.

Running requests go first (decodes, then unfinished prompt chunks); waiting requests are prefilled
in chunks with what remains, so a long prompt never takes more than the budget left in a step.
When blocks run out, the lowest-priority running request is preempted by recompute.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tailserve.config import SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.request import Request, RequestStatus


@dataclass
class StepPlan:
    """The work of one step: (request, number of new tokens to compute) in execution order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step_plan(self) -> StepPlan:
        """Decide this step's batch; allocates the blocks it needs."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # it was its own victim; the list shrank past it
            plan.scheduled.append((req, n))
            scheduled_ids.add(req.request_id)
            budget -= n
            i += 1
        if plan.preempted:
            return plan  # the pool is short: admitting now would only preempt again
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting()
            if not self.kv.has(req.request_id):
                cached = self.kv.match_prefix(req.request_id, req.token_ids)
                req.num_computed_tokens = cached
                if req.timings.first_scheduled is None:
                    req.timings.cached_tokens = cached
            n = min(req.num_uncomputed_tokens, budget)
            if not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                break  # keeps its prefix-cache hits; retried next step
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = time.monotonic()
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
        return plan

    def _next_waiting(self) -> Request:
        return self.waiting[0]

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
