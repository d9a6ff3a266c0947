"""A scripted engine in virtual time: the real scheduler, wait model and admission, no model.

Each step costs what a `StepCost` says (a fixed part, a price per decode row and per prompt token,
one per prompt token per token of context it attends to, since prompt attention grows with the
context, and one per decode row per token of its context), the virtual clock advances by it, and admission decides on the wait model's quote as
the server does (`Admission.admit(WaitQuote)`), with the TPOT price in the quote where asked. A request is admitted or refused at its arrival
time, also while a step runs (against the queue as that step found it: the server's admission runs
beside the engine thread); its first token comes at the end of the step that finishes its prompt.
Nothing here reads a wall clock, so tests can assert what admission promised against what happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailserve.config import EngineConfig, SchedulerConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.quote import WaitQuote
from tailserve.engine.request import Request, RequestTimings, SamplingParams, ttft_target_s
from tailserve.engine.scheduler import Scheduler, StepPlan
from tailserve.engine.stats import DecodeTimer, EngineStats, StepTimer
from tailserve.engine.wait_model import WaitModel
from tailserve.errors import RequestRejectedError
from tailserve.server.admission import Admission, Ticket, WaitCorrection

BLOCK = 16


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step."""

    fixed: float = 0.006
    per_row: float = 0.0014  # per decode row
    prompt_fixed: float = 0.011  # once, if the step carries prompt tokens
    per_token: float = 0.00075  # per prompt token
    per_pair: float = 0.0  # per prompt token per context token it attends to (its position + 1)
    per_context: float = 0.0  # per decode row per token of its context (the KV it reads)

    def __call__(self, plan: StepPlan) -> float:
        tokens = plan.num_prefill_tokens
        pairs = sum(
            n * req.num_computed_tokens + n * (n + 1) // 2 for req, n in plan.scheduled[plan.num_decodes :]
        )
        prompt = self.prompt_fixed + self.per_token * tokens + self.per_pair * pairs if tokens else 0.0
        decodes = self.per_row * plan.num_decodes + self.per_context * decode_context(plan)
        return self.fixed + decodes + prompt


def decode_context(plan: StepPlan) -> int:
    """Tokens the step's decode rows attend, all together."""
    return sum(len(req.token_ids) for req, _ in plan.scheduled[: plan.num_decodes])


@dataclass
class Outcome:
    """One request: what admission said on arrival and what happened."""

    arrival: float
    prompt: int
    output: int
    admitted: bool = False
    queued: bool = False  # work was predicted ahead of it
    estimate_s: float = 0.0  # admission's predicted TTFT (the engine's times the correction)
    alone_s: float = 0.0  # its own prefill as predicted
    ttft_s: float | None = None
    tpot_s: float | None = None
    held: bool = False  # admitted with a hold (its prompt waits for a stream to end)
    gaps_s: list[float] = field(default_factory=list)  # between its output tokens (ITL)

    def missed(self, target_s: float) -> bool:
        return self.ttft_s is not None and self.ttft_s > target_s


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _EngineView:
    """What Admission reads of an engine: its config and its waiting count."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler) -> None:
        self.config = config
        self._scheduler = scheduler

    def stats(self) -> EngineStats:
        return EngineStats(len(self._scheduler.running), len(self._scheduler.waiting), 0, 0, 0, 0, 0, 0)


class VirtualServer:
    """Admission in front of the scheduler, stepping in virtual time (see the module docstring)."""

    def __init__(
        self, config: SchedulerConfig, cost: StepCost, correction: bool = True, tpot: bool = False
    ) -> None:
        """`tpot`: admission also gets the TPOT price (else the quote has none, as before it existed)."""
        self.config = config
        self.tpot = tpot
        self.cost = cost
        self.clock = _Clock()
        self.timer = StepTimer(budget_tokens=config.max_num_batched_tokens)
        self.scheduler = Scheduler(
            config, KVCacheManager(100_000, BLOCK, enable_prefix_caching=False), self.timer
        )
        # As on a CPU whose prompt rows run our own kernels: with nothing decoding, the first prompt
        # in line may take --prefill-step-tokens in one step (engine/llm_engine.py `idle_budget`).
        self.scheduler.idle_budget = config.idle_step_tokens
        self.decode_timer = DecodeTimer()
        self.wait_model = WaitModel(
            self.scheduler.policy,
            self.timer,
            config.slo_ttft_s,
            decode_timer=self.decode_timer,
            admission_hold=config.admission_hold,
        )
        view = _EngineView(EngineConfig(scheduler=config), self.scheduler)
        self.admission = Admission(view, WaitCorrection(enabled=correction, clock=self.clock))  # type: ignore[arg-type]
        self.admission.ready = True
        self._live: dict[str, tuple[Request, Outcome, Ticket]] = {}
        self._step_began: float | None = None  # the step running now, while one does
        self._seq = 0

    def warm(self, prompt_tokens: int = 256) -> None:
        """What a server's warm-up leaves: one prompt served alone, then a few decode steps."""
        self.run([(self.clock.now, prompt_tokens, 4)])

    def run(self, arrivals: Sequence[tuple[float, int, int]]) -> list[Outcome]:
        """Offer each (time, prompt tokens, output tokens), sorted by time, and step until all end."""
        outcomes: list[Outcome] = []
        pending = list(arrivals)
        while pending or self.scheduler.num_unfinished:
            while pending and pending[0][0] <= self.clock.now:
                outcomes.append(self._offer(*pending.pop(0)))
            plan = self.scheduler.step_plan(self.clock.now)
            if not plan.scheduled:
                held = self.scheduler.held_s(self.clock.now)  # a prompt admission holds: its time
                assert pending or held > 0, "the scheduler planned nothing with requests left"
                wake = [pending[0][0]] if pending else []
                self.clock.now = min([*wake, *([self.clock.now + held] if held > 0 else [])])
                continue
            seconds = self.cost(plan)
            end = self.clock.now + seconds
            # The server admits on its own thread while a step runs: a request arriving meanwhile
            # is priced at its arrival, against the queue as it stands until the step ends, and
            # the snapshot the engine published as the step began.
            self._step_began = self.clock.now
            while pending and pending[0][0] < end:
                self.clock.now = max(self.clock.now, pending[0][0])
                outcomes.append(self._offer(*pending.pop(0)))
            self._step_began = None
            self.clock.now = end
            self.timer.record(plan, seconds)
            if plan.num_prefill_tokens == 0:
                self.decode_timer.record(plan.num_decodes, decode_context(plan), seconds, beside_lane=False)
            self.scheduler.postprocess(plan)
            self._emit(plan)
        return outcomes

    def _offer(self, arrival: float, prompt: int, output: int) -> Outcome:
        outcome = Outcome(arrival, prompt, output)
        ttft_s = ttft_target_s(None, self.config.slo_ttft_s)
        # Between steps the newcomer joins the next plan; during one, it waits for what is left of it.
        snapshot = dataclasses.replace(
            self.scheduler.queue_snapshot(self.clock.now), step_began=self._step_began
        )
        wait = self.wait_model.estimate(prompt, snapshot, self.clock.now, ttft_s)
        params = SamplingParams(max_tokens=output, ignore_eos=True)
        tpot = None
        if self.tpot:
            own = self.scheduler.new_stream(prompt, params, None)
            tpot = self.wait_model.tpot_price(prompt, own, snapshot, self.clock.now, ttft_s)
        try:
            ticket = self.admission.admit(WaitQuote(prompt, ttft_s, wait.ttft_s, wait.alone_s, tpot))
        except RequestRejectedError:
            return outcome
        outcome.admitted, outcome.queued = True, wait.queued
        outcome.estimate_s, outcome.alone_s = ticket.estimate_s, wait.alone_s
        name = f"r{self._seq}"
        ids = [(self._seq * 31 + j) % 5000 + 1 for j in range(prompt)]
        request = Request(name, ids, params, RequestTimings(arrival=arrival), seq_no=self._seq)
        if tpot is not None and tpot.hold_s > 0:  # as AsyncEngine.submit queues it
            request.not_before = self.clock.now + tpot.hold_s
            outcome.held = True
        self._seq += 1
        self.scheduler.add(request)
        self._live[name] = (request, outcome, ticket)
        return outcome

    def _emit(self, plan: StepPlan) -> None:
        now = self.clock.now
        for req, _ in plan.scheduled:
            if req.num_computed_tokens < len(req.token_ids):
                continue  # a prompt chunk that does not end the prompt: no token yet
            req.token_ids.append(1)
            _, outcome, ticket = self._live[req.request_id]
            if req.timings.first_token is None:
                req.timings.first_token = now
                outcome.ttft_s = now - outcome.arrival
                ticket.started()
            if req.timings.token_times:
                outcome.gaps_s.append(now - req.timings.token_times[-1])
            req.timings.token_times.append(now)
            if req.num_output_tokens >= outcome.output:
                self.scheduler.finish(req, "length")
                outcome.tpot_s = (now - req.timings.first_token) / max(outcome.output - 1, 1)
                ticket.done()
                del self._live[req.request_id]
