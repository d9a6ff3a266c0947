"""A small in-process engine implementing the server's contract (docs/INTERFACES.md), for precise tests.

Byte-level tokenizer, a fixed reply text, a semaphore for running slots and a counted block pool;
it never imports torch and is not a model: it exists to test error mapping, admission and disconnects.
Like AsyncEngine it queues a request when generate() is called and reports refusals on the stream;
its wait estimate is a known model: requests queued ahead x step_s.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from tailserve.config import EngineConfig, SchedulerConfig
from tailserve.engine.quote import Admitted, WaitQuote
from tailserve.engine.request import RequestOutput, RequestTimings, SamplingParams, SloTarget, ttft_target_s
from tailserve.engine.stats import EngineStats
from tailserve.engine.tpot_model import TpotPrice
from tailserve.errors import ContextLengthExceededError, InvalidRequestError

T = TypeVar("T")

VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; a trivial chat template."""

    supports_tools = False  # the template knows no `tools`: the server's default tool prompt is used

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + "<assistant>")


class FakeEngine:
    """Generates `reply` (rotated by seed) one byte per step of `step_s` seconds."""

    def __init__(
        self,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 512,
        step_s: float = 0.002,
        max_running: int = 4,
        kv_blocks_total: int = 256,
        block_size: int = 16,
        reply: str = "The quick brown fox jumps over the lazy dog. ",
        wait_estimate_s: float | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.tokenizer = ByteTokenizer()
        self.config = EngineConfig(scheduler=scheduler or SchedulerConfig())
        self.explode_on: str | None = None  # a prompt containing this raises an unexpected error
        self.gate = threading.Event()  # cleared: requests stay queued (a stalled engine) until set
        self.gate.set()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.block_size = block_size
        self.kv_blocks_total = kv_blocks_total
        self.reply = reply
        self.wait_estimate_s = wait_estimate_s
        self.tpot_price: TpotPrice | None = None  # the TPOT price every newcomer gets (None: unpriced)
        self._max_running = max_running
        self._slots: asyncio.Semaphore | None = None
        self._aborted: set[str] = set()
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.blocks_used = 0
        self.prefix_queries = 0
        self.started = False
        self.shut_down = False
        self.finished_reasons: dict[str, str] = {}
        self.generate_calls = 0
        self.flushes = 0

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self._max_running)
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True
        for request_id in self.running | self.waiting:
            self.abort(request_id)

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's own border (LLMEngine.add_request): token range and context."""
        if any(t >= VOCAB_SIZE for t in prompt_token_ids):
            raise InvalidRequestError(f"token ids must be < {VOCAB_SIZE}", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            message = f"prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}"
            raise ContextLengthExceededError(message, "prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            message = (
                f"prompt + max_tokens = {len(prompt_token_ids) + params.max_tokens} > {self.max_model_len}"
            )
            raise ContextLengthExceededError(message, "max_tokens")

    def abort(self, request_id: str) -> None:
        if request_id in self.running or request_id in self.waiting:
            self._aborted.add(request_id)
        self.waiting.discard(request_id)  # also a stream that was never iterated: it holds nothing

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_used=self.blocks_used,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_queries // 2,
            preemptions_total=0,
            steps_total=0,
        )

    async def flush_prefix_cache(self, force: bool = False) -> bool:
        """Refused while requests are queued or running, unless forced (as AsyncEngine's)."""
        if (self.running or self.waiting) and not force:
            return False
        self.flushes += 1
        return True

    def estimate_wait_s(self) -> float:
        if self.wait_estimate_s is not None:
            return self.wait_estimate_s
        return len(self.waiting) * self.step_s

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        admit: Callable[[WaitQuote], T],
        *,
        slo: SloTarget | None = None,
        fork_of: str | None = None,
    ) -> Admitted[T]:
        """Priced by the whole prompt (no prefix cache), admitted, then queued as generate does."""
        if self.explode_on is not None and self.explode_on in self.tokenizer.decode(prompt_token_ids):
            raise RuntimeError("scripted bug")  # an unexpected error inside the engine call
        ttft_s = ttft_target_s(slo, self.config.scheduler.slo_ttft_s)
        ticket = admit(WaitQuote(len(prompt_token_ids), ttft_s, self.estimate_wait_s(), tpot=self.tpot_price))
        return Admitted(ticket, self.generate(request_id, prompt_token_ids, params))

    def _reply_bytes(self, params: SamplingParams) -> bytes:
        shift = (params.seed or 0) % len(self.reply)
        return (self.reply[shift:] + self.reply[:shift]).encode("utf-8")

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queued now (the wait estimate counts it at once); a refusal is raised on first iteration."""
        if self.explode_on is not None and self.explode_on in self.tokenizer.decode(prompt_token_ids):
            raise RuntimeError("scripted bug")  # an unexpected error inside the engine call
        try:
            self._check(prompt_token_ids, params)
        except InvalidRequestError as exc:
            return _refused(exc)
        self.generate_calls += 1
        self.waiting.add(request_id)
        return self._run(request_id, prompt_token_ids, params)

    async def _run(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        assert self._slots is not None, "start() first"
        timings = RequestTimings(arrival=time.monotonic(), prompt_tokens=len(prompt_token_ids))
        held_blocks = 0
        acquired = False
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            await self._slots.acquire()
            acquired = True
            self.waiting.discard(request_id)
            self.running.add(request_id)
            timings.first_scheduled = time.monotonic()
            self.prefix_queries += len(prompt_token_ids)
            reply = self._reply_bytes(params)
            ids: list[int] = []
            text = ""
            while True:
                await asyncio.sleep(self.step_s)
                reason = None
                if request_id in self._aborted:
                    new_ids: list[int] = []
                    reason = "abort"
                else:
                    new_ids = [reply[len(ids) % len(reply)]]
                needed = math.ceil((len(prompt_token_ids) + len(ids) + len(new_ids)) / self.block_size)
                self.blocks_used += needed - held_blocks
                held_blocks = needed
                ids += new_ids
                now = time.monotonic()
                if new_ids:
                    timings.token_times.append(now)
                    timings.first_token = timings.first_token or now
                full = self.tokenizer.decode(ids)
                for stop in params.stop:
                    if stop in full:
                        full, reason = full[: full.index(stop)], "stop"
                if reason is None and len(ids) >= params.max_tokens:
                    reason = "length"
                if reason is None and not params.ignore_eos and len(ids) == len(reply):
                    reason = "stop"
                new_text, text = full[len(text) :], full
                if reason is not None:
                    timings.finish = now
                    self.finished_reasons[request_id] = reason
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=new_ids,
                    new_text=new_text,
                    token_ids=list(ids),
                    text=text,
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=0,
                    timings=timings if reason is not None else None,
                )
                if reason is not None:
                    return
        finally:
            self.finished_reasons.setdefault(request_id, "closed")
            self.blocks_used -= held_blocks
            self.running.discard(request_id)
            self.waiting.discard(request_id)
            self._aborted.discard(request_id)
            if acquired:
                self._slots.release()


async def _refused(exc: Exception) -> AsyncIterator[RequestOutput]:
    raise exc
    yield
