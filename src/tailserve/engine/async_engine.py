"""AsyncEngine: the LLMEngine's step loop on a background thread, streaming outputs to asyncio callers.

Adds and aborts are thread-safe (they go through an inbox the loop drains between steps); a caller
that stops iterating, or is cancelled, aborts its request so no block stays held. It validates
nothing itself: LLMEngine.add_request is the border, and its errors reach the caller on the stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from tailserve.config import EngineConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.policy import PrefillItem
from tailserve.engine.quote import Admitted, WaitQuote
from tailserve.engine.request import GrammarSpec, RequestOutput, SamplingParams, SloTarget, ttft_target_s
from tailserve.engine.stats import EngineStats
from tailserve.engine.tpot_model import Stream
from tailserve.engine.wait_model import QueueSnapshot, Wait, unseen_item
from tailserve.errors import TailserveError
from tailserve.executor import warmup
from tailserve.weights.loader import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    arrival: float
    seq: int
    slo: SloTarget | None
    fork_of: str | None
    not_before: float = 0.0  # admission's hold: its prompt starts no sooner


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Flush:
    """Empty the prefix cache between steps; the answer (done or refused) goes to `done`."""

    force: bool
    done: concurrent.futures.Future[bool]


class EngineDeadError(TailserveError):
    """The step loop failed; the request could not finish."""


class AsyncEngine:
    """Streams each request's tokens as they are produced; safe to call from any thread's event loop."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, warm_kernels: bool = False
    ) -> None:
        """`warm_kernels`: the step loop first creates every prompt-row kernel the step budget
        allows (LLMEngine.warm_kernels; 3-9 s on 2 cores), so requests that arrive
        meanwhile wait for it; the server turns it on with its warm-up."""
        self.engine = LLMEngine(config, loaded)
        self._warm_kernels = warm_kernels
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Flush | None] = queue.SimpleQueue()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = self.engine.stats()
        self._queue = self.engine.queue_snapshot()
        # Requests handed to generate() but not yet in a published snapshot.
        self._unseen: dict[int, tuple[PrefillItem, Stream]] = {}
        self._applied: list[int] = []  # engine thread only: adds applied since the last publish
        self._add_seq = itertools.count()
        self._lock = threading.Lock()

    async def start(self) -> None:
        """Start the step loop (idempotent). The calling thread (the one that loaded the model) gives
        its OpenMP workers up first: left alive, they slow every parallel op of the engine thread's
        own pool on a small machine (executor.warmup)."""
        if self._thread is None:
            warmup.release_loading_thread()
            self._thread = threading.Thread(target=self._run, name="tailserve-engine", daemon=True)
            self._thread.start()

    async def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` on a worker thread into the engine's grammar cache, so the step loop finds it
        there; a bad spec raises InvalidRequestError (a 400) and queues nothing."""
        await asyncio.to_thread(self.engine.grammars.compile, spec, True)

    async def shutdown(self) -> None:
        """Stop the loop; unfinished requests are aborted."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def exit_process_on_worker_death(self) -> None:
        """Serving's policy under tensor parallelism: a dead worker fails what is in flight, then the
        process exits non-zero so the orchestrator restarts it. Nothing without tensor parallelism."""
        tp = self.engine.runner.tp
        if tp is not None:
            tp.exit_process_on_worker_death()

    def close(self) -> None:
        """After shutdown: stop the tensor-parallel workers and the KV-event publisher, if any; the engine
        cannot generate afterwards."""
        self.engine.close()

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
        """Price the request once (its prompt work, TTFT target and predicted wait), let `admit`
        decide on that price (it raises to refuse, and then nothing is queued), and queue it with
        the same price: the server's one call per request. `slo` and `fork_of`: LLMEngine.add_request's."""
        work = self.engine.prompt_work_tokens(prompt_token_ids, params)
        ttft_s = ttft_target_s(slo, self.config.scheduler.slo_ttft_s)
        own = self.engine.scheduler.new_stream(len(prompt_token_ids), params, slo)
        snapshot, now = self._snapshot(), time.monotonic()
        model = self.engine.wait_model
        wait = model.estimate(work, snapshot, now, ttft_s)
        tpot = model.tpot_price(work, own, snapshot, now, ttft_s)
        ticket = admit(WaitQuote(work, ttft_s, wait.ttft_s, wait.alone_s, tpot))
        # Admitted with a hold (the TPOT price found none at once): the prompt waits in the queue
        # until a stream is expected to end, within its TTFT target.
        not_before = now + tpot.hold_s if tpot is not None and tpot.hold_s > 0 else 0.0
        stream = self._enqueue(
            request_id, prompt_token_ids, params, work, ttft_s, slo, fork_of, not_before, own
        )
        return Admitted(ticket, stream)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        slo: SloTarget | None = None,
        fork_of: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue the request now, unpriced by any admission (wait estimates count it from this call),
        and return its outputs: a RequestOutput per step that advanced it, the last with
        finished=True. A request the engine refuses raises its typed error on the first iteration.
        Iterate it, or abort the id."""
        work = self.engine.prompt_work_tokens(prompt_token_ids, params)
        ttft_s = ttft_target_s(slo, self.config.scheduler.slo_ttft_s)
        return self._enqueue(request_id, prompt_token_ids, params, work, ttft_s, slo, fork_of)

    def _enqueue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        work_tokens: int,
        ttft_s: float,
        slo: SloTarget | None,
        fork_of: str | None,
        not_before: float = 0.0,
        own: Stream | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue the request for the engine thread; `own`: its stream as priced, if it was."""
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        now = time.monotonic()
        seq = next(self._add_seq)
        item = _Add(
            request_id, list(prompt_token_ids), params, stream, loop, now, seq, slo, fork_of, not_before
        )
        with self._lock:
            # A duplicate id keeps the first stream; add_request refuses the second (see _apply).
            self._streams.setdefault(request_id, (loop, stream))
            if own is None:
                own = self.engine.scheduler.new_stream(len(prompt_token_ids), params, slo)
            own = dataclasses.replace(own, start_at=not_before)
            self._unseen[item.seq] = (unseen_item(work_tokens, now, ttft_s), own)
        self._inbox.put(item)
        return self._outputs(request_id, stream)

    async def _outputs(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        settled = False  # finished, or refused/failed by the engine: nothing left to abort
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    settled = True
                    raise item
                settled = item.finished
                yield item
                if settled:
                    return
        finally:
            if not settled:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (idempotent)."""
        self._inbox.put(_Abort(request_id))

    async def flush_prefix_cache(self, force: bool = False) -> bool:
        """Empty the prefix cache on the engine thread between steps (LLMEngine.flush_prefix_cache):
        False, nothing changed, while requests are queued or running, unless forced."""
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._inbox.put(_Flush(force, done))
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        return self._stats

    def estimate_wait_s(self, num_prompt_tokens: int, ttft_s: float | None = None) -> float:
        """Predicted TTFT of a new request whose target is `ttft_s` (None: --slo-ttft): see `estimate_wait`."""
        return self.estimate_wait(num_prompt_tokens, ttft_s).ttft_s

    def estimate_wait(self, num_prompt_tokens: int, ttft_s: float | None = None) -> Wait:
        """Predicted queue wait plus prefill for a new request whose TTFT target is `ttft_s` (None:
        --slo-ttft), and its prefill alone: the last step's snapshot plus every request handed to
        generate() since (a burst arrives faster than the engine thread sees it)."""
        return self.engine.wait_model.estimate(num_prompt_tokens, self._snapshot(), time.monotonic(), ttft_s)

    def _snapshot(self) -> QueueSnapshot:
        """The last step's snapshot plus every request handed to generate() since, queued last."""
        with self._lock:
            snapshot = self._queue
            unseen = list(self._unseen.values())
        if not unseen:
            return snapshot
        # The snapshot's streams cover its own pending prompts: the unseen ones' follow them.
        streams = snapshot.pending_streams[: len(snapshot.pending)]
        return dataclasses.replace(
            snapshot,
            pending=[*snapshot.pending, *(item for item, _ in unseen)],
            pending_streams=(*streams, *(stream for _, stream in unseen)),
        )

    # ----- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if self._warm_kernels:
            try:  # on this thread: oneDNN keys a kernel by its thread count too
                engine.warm_kernels()
            except Exception:  # serving works without it: kernels then compile on first use
                log.exception("creating the prompt-row kernels failed; they compile on first use")
        while not self._stopping.is_set():
            # Idle, or with nothing to run until a held prompt's time: wait for the inbox meanwhile.
            held_s = engine.held_idle_s()
            block = not engine.has_unfinished() or held_s > 0
            if not self._drain_inbox(block, min(held_s, 0.05) if held_s > 0 else 0.5):
                break
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug must not leave clients hanging or blocks held
                log.exception("engine step failed; aborting every request")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)
            self._publish()
        self._fail_all(EngineDeadError("the engine is shutting down"))
        while True:  # a flush asked for as the loop ended gets an answer too
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Flush):
                item.done.set_exception(EngineDeadError("the engine is shutting down"))

    def _drain_inbox(self, block: bool, timeout_s: float = 0.5) -> bool:
        """Apply pending adds/aborts; wait up to `timeout_s` for one if `block`. False once asked to stop."""
        try:
            item = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stopping.is_set()
        while True:
            if item is None:
                return False
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._publish()
                return True

    def _apply(self, item: _Add | _Abort | _Flush) -> None:
        if isinstance(item, _Flush):
            item.done.set_result(self.engine.flush_prefix_cache(item.force))
            return
        if isinstance(item, _Abort):
            out = self.engine.abort(item.request_id)
            if out is not None:
                self._deliver(out)
            return
        self._applied.append(item.seq)
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt_token_ids,
                item.params,
                item.arrival,
                item.slo,
                item.fork_of,
                not_before=item.not_before,
            )
        except Exception as exc:
            with self._lock:  # drop the map entry only if it is this request's own stream
                if self._streams.get(item.request_id, (None, None))[1] is item.stream:
                    del self._streams[item.request_id]
            item.loop.call_soon_threadsafe(item.stream.put_nowait, exc)
            return
        with self._lock:  # accepted: no other live request has this id, so the outputs are ours
            self._streams[item.request_id] = (item.loop, item.stream)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            target = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._streams.pop(request_id, None)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, exc)

    def _fail_all(self, exc: Exception) -> None:
        self.engine.abort_all()
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._deliver_error(rid, EngineDeadError(str(exc)))
        self._publish()

    def _publish(self) -> None:
        engine = self.engine
        snapshot: QueueSnapshot = engine.queue_snapshot()
        stats = engine.stats()
        with self._lock:
            self._queue = snapshot
            self._stats = stats
            for seq in self._applied:
                self._unseen.pop(seq, None)
        self._applied.clear()
