"""LLMEngine: the synchronous step loop. Add requests, call step(), collect outputs.

One step = schedule, run the model once, apply sampled tokens (stop rules, detokenization), free
finished requests' blocks. Every check on a new request happens before it takes any block.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

import torch

from tailserve.config import EngineConfig
from tailserve.engine.block_manager import KVCacheManager
from tailserve.engine.request import Request, RequestOutput, RequestTimings, SamplingParams
from tailserve.engine.scheduler import Scheduler, StepPlan
from tailserve.engine.stats import EngineStats, QueueSnapshot, StepTimer
from tailserve.errors import ContextLengthExceededError, InvalidRequestError
from tailserve.model.attention import AttentionBackend
from tailserve.model.loader import LoadedModel, load_model
from tailserve.model.runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tailserve.model.sampler import SamplingSpec
from tailserve.model.tokenizer import IncrementalDetokenizer
from tailserve.model.transformer import TransformerLM

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
_MAX_DEFAULT_CONTEXT = 8192


def default_cpu_threads() -> int:
    """One core fewer than the process may use (at least one).

    The spare core runs the HTTP loop, tokenization and everything else: when a parallel op's thread
    is descheduled, the whole op waits for it, and on 2 cores a 0.5 ms matmul was seen to take 16 ms.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from tailserve.errors import ConfigError

        raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)  # type: ignore[no-any-return]


class LLMEngine:
    """Owns the model runner, the KV cache manager and the scheduler; advances all requests a step at a time."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Build from the config; `loaded` reuses weights already in memory (tests build many engines)."""
        self.config = config
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        if self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads or default_cpu_threads())  # per process: the engine owns it
        self.dtype = resolve_dtype(mc.dtype, self.device)
        if loaded is None:
            loaded = load_model(mc.model, self.dtype, mc.seed)
        self.load_s = loaded.load_s
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.model_name = mc.served_model_name or loaded.name
        self.max_model_len = min(
            mc.max_model_len or min(self.arch.max_position_embeddings, _MAX_DEFAULT_CONTEXT),
            self.arch.max_position_embeddings,
        )
        model = TransformerLM(self.arch, loaded.weights, self.max_model_len).to(self.device)
        del loaded
        self.kv_bytes_per_token = kv_bytes_per_token(self.arch, self.dtype)
        num_blocks = self._num_blocks(model)
        self.runner = ModelRunner(
            model, num_blocks, cc.block_size, self.device, backend=_pick_backend(self.device)
        )
        self.execute: Callable[[list[SeqChunk]], list[int | None]] = self.runner.execute
        if self.runner.backend.name == "triton" and not mc.enforce_eager:
            self.execute = self._capture_decode_graphs()
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.last_plan: StepPlan | None = None  # for tests and debugging
        self.timer = StepTimer(budget_tokens=config.scheduler.max_num_batched_tokens)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.timer)
        self._requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self._rng = torch.Generator().manual_seed(mc.seed)
        tokens = num_blocks * cc.block_size
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %d bytes/token (%.1f MiB), "
            "max %d concurrent requests at %d tokens of context; attention backend %s",
            num_blocks,
            cc.block_size,
            tokens,
            self.kv_bytes_per_token,
            tokens * self.kv_bytes_per_token / 2**20,
            tokens // self.max_model_len,
            self.max_model_len,
            self.runner.backend.name,
        )

    def _num_blocks(self, model: TransformerLM) -> int:
        cc = self.config.cache
        block_bytes = self.kv_bytes_per_token * cc.block_size
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = (
                int(total * cc.gpu_memory_utilization) - used_by_others - (1 << 30)
            )  # 1 GiB for activations
            log.info(
                "KV budget: %.2f GiB = %.2f GiB x %.2f - %.2f GiB in use - 1 GiB activations",
                budget / 2**30,
                total / 2**30,
                cc.gpu_memory_utilization,
                used_by_others / 2**30,
            )
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            from tailserve.errors import ConfigError

            raise ConfigError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; give it more memory"
            )
        return int(num_blocks)

    def _capture_decode_graphs(self) -> Callable[[list[SeqChunk]], list[int | None]]:
        """CUDA graphs for decode steps at a ladder of batch sizes; eager if capture fails."""
        from tailserve.model.cuda_graphs import DecodeGraphRunner

        try:
            graphs = DecodeGraphRunner(self.runner, max_context=self.max_model_len)
            seconds = graphs.capture()
        except Exception:
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            return self.runner.execute
        log.info("captured decode CUDA graphs for batch sizes %s in %.2f s", graphs.batch_sizes, seconds)
        return graphs.execute

    # ----- requests -------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error if the request can never be served; changes nothing."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if n >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit): shorten the prompt",
                param="prompt",
            )
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens: lower max_tokens to at most {self.max_model_len - n}",
                param="max_tokens",
            )
        if -(-(n + params.max_tokens) // self.kv.block_size) > self.kv.num_blocks:
            raise ContextLengthExceededError(
                f"prompt + max_tokens ({n + params.max_tokens} tokens) exceeds the whole KV pool "
                f"({self.kv.num_blocks * self.kv.block_size} tokens): lower max_tokens or give the pool more memory",
                param="max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
    ) -> None:
        """Validate, then queue. Raises before any state changes if the request is bad."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.check_request(prompt_token_ids, params)
        gen = torch.Generator()
        gen.manual_seed(
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        )
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            timings=RequestTimings(arrival=arrival if arrival is not None else time.monotonic()),
            seq_no=next(self._seq),
            generator=gen,
        )
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown or done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        req.timings.finish = time.monotonic()
        return self._output(req, [], finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and the model once; return an output per request that advanced."""
        plan = self.scheduler.step_plan()
        self.last_plan = plan
        if not plan.scheduled:
            return []
        chunks = [self._chunk(req, n) for req, n in plan.scheduled]
        start = time.monotonic()
        sampled = self.execute(chunks)
        now = time.monotonic()
        self.timer.record(plan, now - start)
        outputs: list[RequestOutput] = []
        for (req, n), token in zip(plan.scheduled, sampled, strict=True):
            req.num_computed_tokens += n
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)
            if token is not None:
                out = self._append_token(req, token, now)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        c = req.num_computed_tokens
        p = req.params
        return SeqChunk(
            token_ids=req.token_ids[c : c + n],
            start_pos=c,
            block_table=self.kv.block_table(req.request_id),
            sample=c + n == len(req.token_ids),
            sampling=SamplingSpec(p.temperature, p.top_p, p.top_k, req.generator),
        )

    def _append_token(self, req: Request, token: int, now: float) -> RequestOutput | None:
        p = req.params
        req.token_ids.append(token)
        t = req.timings
        if t.first_token is None:
            t.first_token = now
        t.token_times.append(now)
        reason: str | None = None
        is_eos = token in self.tokenizer.eos_token_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            reason = "stop"
        else:
            req.text += req.detokenizer.add(token)
            if p.stop and self._cut_at_stop(req):
                reason = "stop"
        if reason is None and (
            req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
            t.finish = now
            self._requests.pop(req.request_id, None)
        return self._output(req, [token], finished=reason is not None)

    @staticmethod
    def _cut_at_stop(req: Request) -> bool:
        longest = max(len(s) for s in req.params.stop)
        window_start = max(0, req.emitted_chars - longest)
        hits = [i for s in req.params.stop if (i := req.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        req.text = req.text[: min(hits)]
        return True

    def _output(self, req: Request, new_ids: list[int], finished: bool) -> RequestOutput:
        # Hold back text that could still become the start of a stop string.
        hold = 0 if finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        upto = max(req.emitted_chars, len(req.text) - hold)
        new_text = req.text[req.emitted_chars : upto]
        req.emitted_chars = upto
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=req.output_token_ids,
            text=req.text[:upto],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.timings.cached_tokens,
            timings=req.timings if finished else None,
        )

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            preemptions_total=self.scheduler.num_preemptions,
            steps_total=self.timer.steps,
        )

    def queue_snapshot(self) -> QueueSnapshot:
        """What admission control needs, taken on the engine thread between steps."""
        ttft = self.config.scheduler.slo_ttft_s
        sched = self.scheduler
        prefilling = [*sched.waiting, *(r for r in sched.running if r.num_uncomputed_tokens > 1)]
        decoding = [r for r in sched.running if r.num_uncomputed_tokens <= 1]
        budget = self.config.scheduler.max_num_batched_tokens
        return QueueSnapshot(
            pending=[(r.num_uncomputed_tokens, r.timings.arrival + ttft) for r in prefilling],
            num_running=len(sched.running),
            prefill_cap=sched.policy.prefill_cap(decoding, budget, time.monotonic()),
        )

    def estimate_wait_s(self, num_prompt_tokens: int, snapshot: QueueSnapshot | None = None) -> float:
        """Predicted time to a new request's first token: the prefill work the policy puts ahead of it,
        plus its own. Zero when nothing is ahead: an idle server never refuses."""
        snap = snapshot or self.queue_snapshot()
        ahead = self.scheduler.policy.tokens_ahead(snap.pending, num_prompt_tokens, time.monotonic())
        if ahead == 0:
            return 0.0
        return self.timer.estimate_s(
            ahead + num_prompt_tokens, snap.num_running, per_step_tokens=snap.prefill_cap
        )


def _pick_backend(device: torch.device) -> AttentionBackend | None:
    """The fastest attention backend for the device; None means the portable torch one."""
    if device.type != "cuda":
        return None
    try:
        from tailserve.model.triton_attention import TritonPagedAttention  # type: ignore[import-not-found]
    except ImportError:
        return None
    backend: AttentionBackend = TritonPagedAttention()
    return backend
