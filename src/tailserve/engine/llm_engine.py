"""LLMEngine: the synchronous step loop. Add requests, call step(), collect outputs.

One step = the scheduler's plan, the model runner once, the scheduler's post-step bookkeeping, then
sampled tokens through the output processor. It is glue: the runner is built in `executor.builder`, the
KV cache belongs to the scheduler, stop rules and text to `engine.outputs`, siblings to `engine.forks`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tailserve.config import EngineConfig, SchedulerConfig
from tailserve.engine.block_keys import BlockKeys
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.chunks import record_prompt_logprobs, step_chunks
from tailserve.engine.forks import ForkWaitlist
from tailserve.engine.outputs import OutputProcessor
from tailserve.engine.prefill_lane import LaneRun, PrefillLane
from tailserve.engine.request import (
    Request,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    SloTarget,
    TokenLogprob,
    check_limits,
)
from tailserve.engine.scheduler import Scheduler, StepPlan
from tailserve.engine.stats import EngineStats, StepStats, StepTimer, step_kind
from tailserve.engine.structured import GrammarCache
from tailserve.engine.wait_model import QueueSnapshot, WaitModel
from tailserve.errors import InvalidRequestError
from tailserve.executor import warmup
from tailserve.executor.build import use_device
from tailserve.executor.builder import build_runner
from tailserve.executor.runner import ModelRunner, SeqChunk, StepResult
from tailserve.quality.gate import choose_weight_format
from tailserve.weights.loader import LoadedModel
from tailserve.weights.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from tailserve.engine.kv_event_publisher import KVEventPublisher


class LLMEngine:
    """Advances every request a step at a time; the border where engine limits are checked."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Build from the config; `loaded` reuses weights already in memory (tests build many engines)."""
        self.config = config
        self.primitive_cache = warmup.reserve_kernel_cache(config.scheduler.max_num_batched_tokens)
        mc = config.model
        # The quality gate decides `auto` and vets an explicit fast format before anything is built.
        choice = choose_weight_format(
            mc.model,
            mc.weight_format,
            use_device(mc),
            kv_cache_dtype=mc.kv_cache_dtype,
            force=mc.force_weight_format,
            loaded=loaded,
        )
        built = build_runner(mc, config.cache, choice.weight_format, loaded)
        self.runner = built.runner
        self.arch = built.arch
        self.tokenizer = built.tokenizer
        self.model_name = built.model_name
        self.max_model_len = built.max_model_len
        self.kv_bytes_per_token = built.kv_bytes_per_token
        self.load_s = built.load_s
        self.weight_format = built.weight_format
        cc = config.cache
        keys = BlockKeys.from_seed(cc.prefix_cache_seed)
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events.enabled:
            # pyzmq and msgspec are loaded only by an engine that publishes events
            from tailserve.engine.kv_event_publisher import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events, cc.block_size)
        events = self.kv_events.log if self.kv_events is not None else None
        kv = KVCacheManager(self.runner.num_blocks, cc.block_size, cc.enable_prefix_caching, keys, events)
        self.scheduler = Scheduler(config.scheduler, kv)
        self.wait_model = WaitModel(
            self.scheduler.policy,
            self.scheduler.timer,
            config.scheduler.slo_ttft_s,
            self.scheduler.lane_timer,
            self.scheduler.decode_timer,
            config.scheduler.admission_hold,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.last_plan: StepPlan | None = None  # for tests and debugging
        self.step_stats = StepStats(time.monotonic())
        self._requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.forks = ForkWaitlist(self.scheduler)  # siblings (n > 1) waiting to share a prompt
        self._rng = torch.Generator().manual_seed(config.model.seed)
        self.grammars = GrammarCache(self.tokenizer, self.arch.vocab_size)
        self.lane = make_lane(self.runner) if config.scheduler.prefill_lane else None
        self.scheduler.lane = self.lane is not None
        self.scheduler.idle_budget = idle_budget(self.runner, config.scheduler)
        self._lane_outputs: list[RequestOutput] = []  # from a lane chunk taken outside `step`
        # The last decode-only step, timed when the next step begins: (rows, context, beside the
        # lane, when it began).
        self._decode_step: tuple[int, int, bool, float] | None = None
        # When the lane chunk taken since the last plan ended, if prompt work was left for the next
        # one (None: none was, or no chunk was taken).
        self._lane_ended: float | None = None

    # ----- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
        slo: SloTarget | None = None,
        fork_of: str | None = None,
        not_before: float = 0.0,
    ) -> None:
        """Check the engine's limits, then queue. Raises a typed error, changing nothing, if the request is bad.
        `slo`: its own latency targets (None: the engine's). `fork_of`: the id of a request with the same
        prompt whose full KV blocks it takes by reference once that prompt is computed (n > 1).
        `not_before`: admission's hold (time.monotonic()): its prompt starts no sooner."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        check_limits(prompt_token_ids, params, self.arch.vocab_size, self.max_model_len)
        self.scheduler.check_fits_pool(len(prompt_token_ids) + params.max_tokens)
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            timings=RequestTimings(arrival=arrival if arrival is not None else time.monotonic()),
            seq_no=next(self._seq),
            generator=torch.Generator().manual_seed(seed),
            slo=slo,
            not_before=not_before,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            grammar=None if params.grammar is None else self.grammars.matcher(params.grammar),
        )
        self._requests[request_id] = req
        self.forks.add(req, self._requests.get(fork_of or ""))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown or done."""
        while request_id in self.scheduler.in_flight:  # its KV blocks are being written: let its part end
            self._lane_outputs += self._take_lane()
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.forks.forget(req)
        return self._finish(req, "abort", time.monotonic(), [])

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (the step loop is going away)."""
        return [out for rid in list(self._requests) if (out := self.abort(rid)) is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._lane_outputs)

    def held_idle_s(self) -> float:
        """Seconds until a prompt held by admission may start, where the last step ran nothing and
        nothing else is in flight (the caller may wait that long for new requests); else 0."""
        if self.last_plan is None or self.last_plan.scheduled or self._lane_outputs:
            return 0.0
        if self.lane is not None and self.lane.busy:
            return 0.0
        return self.scheduler.held_s(time.monotonic())

    def flush_prefix_cache(self, force: bool = False) -> bool:
        """Empty the prefix cache; refused (False) while requests are queued or running, unless forced
        (theirs keep their KV; only later requests stop finding it)."""
        if self.has_unfinished() and not force:
            return False
        return self.scheduler.kv.clear_prefix_cache(force=True)

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and the model once; return an output per request that advanced.
        Where a prefill-lane chunk ended since the last step, return its outputs alone at once, without
        planning or running a step: its first tokens do not wait for another decode step."""
        outputs, self._lane_outputs = self._lane_outputs, []
        lane = self.lane
        if lane is not None and lane.done():
            outputs += self._take_lane()
        if outputs:  # a lane chunk's first tokens go out now, not after one more decode step
            return outputs
        begin = time.monotonic()
        self._time_decode_step(begin)
        lane_ended, self._lane_ended = self._lane_ended, None  # a chunk taken since the last plan
        lane_busy = lane is not None and lane.busy
        lane_free = lane is not None and not lane_busy and any(r.is_decoding for r in self.scheduler.running)
        plan = self.scheduler.step_plan(begin, prefill=not lane_busy, lane=lane_free)
        threads = None
        if (
            lane is not None
            and lane_free
            and 0 < plan.num_decodes < len(plan.scheduled)
            and not plan.all_threads
        ):
            plan, prompts = plan.split()
            self.scheduler.in_flight.update(r.request_id for r, _ in prompts.scheduled)
            if lane_ended is not None:  # the next chunk at the first plan after: the lane's idle gap
                self.scheduler.lane_timer.record_gap(time.monotonic() - lane_ended)
            lane.submit(prompts, step_chunks(prompts, self.tokenizer.eos_token_ids, self.grammars))
        if lane is not None and lane.busy:
            threads = max(1, (self.runner.num_threads or 1) - lane.threads)  # the decodes' share
        self.last_plan = plan
        if not plan.scheduled:
            if lane is not None and lane.busy:  # nothing to decode: the lane's chunk is all there is
                outputs += self._take_lane()
            return outputs
        chunks = step_chunks(plan, self.tokenizer.eos_token_ids, self.grammars)
        start = time.monotonic()
        result = self.runner.execute(chunks, threads)
        now = time.monotonic()
        outputs += self._after_step(plan, chunks, result, now - start, now)
        kind = step_kind(plan.num_decodes, len(plan.scheduled))
        if plan.num_prefill_tokens == 0 and any(r.is_decoding for r in self.scheduler.running):
            context = sum(len(r.token_ids) for r, _ in plan.scheduled)
            self._decode_step = (plan.num_decodes, context, threads is not None, begin)
        self.step_stats.record(kind, plan.num_tokens, begin, time.monotonic())
        if self.runner.tp is not None:
            self.step_stats.record_tensor_parallel(kind, self.runner.last_comm_s, self.runner.last_compute_s)
        return outputs

    def _time_decode_step(self, now: float) -> None:
        """Teach the decode timer the last decode-only step: from its start to this one's, the gap its
        streams saw (taking a lane chunk, planning and sampling included; the next step starts at
        once, since streams were still decoding after it)."""
        last, self._decode_step = self._decode_step, None
        if last is not None:
            rows, context, beside_lane, began = last
            self.scheduler.decode_timer.record(rows, context, now - began, beside_lane)

    def _take_lane(self) -> list[RequestOutput]:
        """The prefill lane's next part of its plan, waited for: its tokens computed and its first
        token out."""
        assert self.lane is not None
        try:
            run: LaneRun = self.lane.take()
        except BaseException:  # a failed part: its plan's requests end with the error all the same
            self.scheduler.in_flight.clear()
            raise
        self.scheduler.in_flight.difference_update(r.request_id for r, _ in run.plan.scheduled)
        # Its tokens go out now, not when the chunk ended: what a client sees.
        seconds, now = run.end - run.start, time.monotonic()
        outputs = self._after_step(run.plan, run.chunks, run.result, seconds, now, self.scheduler.lane_timer)
        sched = self.scheduler
        left = bool(sched.waiting) or any(not r.is_decoding for r in sched.running)
        self._lane_ended = run.end if left else None
        self.step_stats.record(step_kind(0, len(run.plan.scheduled)), run.plan.num_tokens, run.start, run.end)
        return outputs

    def _after_step(
        self,
        plan: StepPlan,
        chunks: list[SeqChunk],
        result: StepResult,
        seconds: float,
        now: float,
        timer: StepTimer | None = None,
    ) -> list[RequestOutput]:
        """A run plan's bookkeeping (step timer, computed tokens, siblings) and its sampled tokens out
        at `now`; `seconds`: how long the runner took; `timer`: the one that learns from it (default
        the steps'; a lane chunk's is the lane's)."""
        record_prompt_logprobs(plan.scheduled, chunks, result.prompt_scores)
        (timer or self.scheduler.timer).record(plan, seconds)
        self.scheduler.postprocess(plan)
        self.forks.start(plan.scheduled, now)
        outputs: list[RequestOutput] = []
        for (req, _), token, score in zip(plan.scheduled, result.tokens, result.logprobs, strict=True):
            if token is None:
                continue
            if req.params.max_tokens == 0:  # the prompt only (scored for echo): the sampled token is dropped
                outputs.append(self._finish(req, "length", now, []))
                continue
            if score is not None:
                req.logprobs.append(TokenLogprob(token, score[0], tuple(score[1])))
            reason = self.outputs.append_token(req, token, now)
            if reason is None:
                outputs.append(self.outputs.output(req, [token], finished=False))
            else:
                outputs.append(self._finish(req, reason, now, [token]))
        return outputs

    def _finish(self, req: Request, reason: str, now: float, new_ids: list[int]) -> RequestOutput:
        """End the request for `reason`: its waiting siblings queue on their own, its blocks go back."""
        self.forks.release(req)
        self.scheduler.finish(req, reason)
        req.timings.finish = now
        self._requests.pop(req.request_id, None)
        return self.outputs.output(req, new_ids, finished=True)

    # ----- what the server reads -------------------------------------------------------------
    def stats(self) -> EngineStats:
        steps = self.step_stats.snapshot(self.runner.num_graph_steps, self.runner.num_eager_steps)
        return dataclasses.replace(self.scheduler.stats(), steps=steps)

    def queue_snapshot(self) -> QueueSnapshot:
        """What admission control needs, taken on the engine thread between steps."""
        return self.scheduler.queue_snapshot(time.monotonic())

    def prompt_work_tokens(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Prompt tokens a new request would compute before its first output: the prompt less the
        prefix the cache holds now (all of it when it asks for prompt logprobs, which a cached
        prefix cannot give). Read-only: admission calls it from the server's thread."""
        if params.prompt_logprobs is not None:
            return len(prompt_token_ids)
        cached = self.scheduler.cached_prefix_tokens(prompt_token_ids, params.cache_salt)
        return len(prompt_token_ids) - cached

    def close(self) -> None:
        """Stop the tensor-parallel workers and the KV-event publisher, if any (idempotent); the engine
        cannot generate afterwards."""
        if self.lane is not None:
            self.lane.close()
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def warm_kernels(self) -> warmup.WarmResult:
        """Create the prompt-row kernels of every row count the step budget allows now (executor.warmup);
        call it on the thread that runs the steps."""
        budget = self.config.scheduler.max_num_batched_tokens
        return warmup.warm_runner(self.runner, budget, self.primitive_cache)


def idle_budget(runner: ModelRunner, config: SchedulerConfig) -> int:
    """Prompt tokens a step with no decode may carry: --prefill-step-tokens (at least the step
    budget), except where prompt rows run oneDNN, whose kernels exist only for the row counts up to
    the step budget (executor.warmup: larger ones would compile, and hold memory, while serving), and
    under tensor parallelism (not measured there)."""
    budget = config.max_num_batched_tokens
    if runner.tp is not None or any(linear.onednn is not None for linear in runner.model.prompt_linears()):
        return budget
    return config.idle_step_tokens


def make_lane(runner: ModelRunner) -> PrefillLane | None:
    """A prefill lane with half the runner's CPU threads, where it has 2 or more and runs alone (no
    tensor parallelism), and its prompt rows run no oneDNN kernel or float32 copy; None elsewhere.

    oneDNN's prompt-row kernels (the dense bf16 copy, used where there is no AMX) are created per
    thread count before serving (executor.warmup) and round by it: on the lane's thread count they
    would compile while serving, and a prompt's bits would depend on which thread ran it. The
    float32 copy of CPUs without bf16 arithmetic (`fp32w`) rounds by thread count too (torch's
    float32 GEMM splits its sums by it); their int8 dot products (`int4a8`) do not (integer sums)."""
    threads = runner.num_threads or 1
    if runner.device.type != "cpu" or runner.tp is not None or threads < 2:
        return None
    if any(
        linear.onednn is not None or linear.prefill_kernel == "fp32w"
        for linear in runner.model.prompt_linears()
    ):
        return None
    return PrefillLane(runner, threads // 2)
