"""AsyncEngine: the LLMEngine's step loop on a background thread, streaming outputs to asyncio callers.

Adds and aborts are thread-safe (they go through an inbox the loop drains between steps); a caller
that stops iterating, or is cancelled, aborts its request so no block stays held.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tailserve.config import EngineConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import RequestOutput, SamplingParams
from tailserve.engine.stats import EngineStats
from tailserve.errors import TailserveError
from tailserve.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: asyncio.Queue[RequestOutput | BaseException]
    arrival: float


@dataclass
class _Abort:
    request_id: str


class EngineDeadError(TailserveError):
    """The step loop failed; the request could not finish."""


class AsyncEngine:
    """Streams each request's tokens as they are produced; safe to call from any thread's event loop."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.engine = LLMEngine(config, loaded)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = self.engine.stats()
        self._queue = self.engine.queue_snapshot()
        self._lock = threading.Lock()

    async def start(self) -> None:
        """Start the step loop (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tailserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; unfinished requests are aborted."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a typed error if the request can never be served; changes nothing."""
        self.engine.check_request(prompt_token_ids, params)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per step that advanced the request, the last with finished=True."""
        import time

        self.check_request(prompt_token_ids, params)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                from tailserve.errors import InvalidRequestError

                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, stream, arrival or time.monotonic()))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (idempotent)."""
        self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def estimate_wait_s(self, num_prompt_tokens: int) -> float:
        """Predicted queue wait plus prefill for a new request, from the last step's snapshot."""
        return self.engine.estimate_wait_s(num_prompt_tokens, self._queue)

    # ----- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            block = not engine.has_unfinished()
            if not self._drain_inbox(block):
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

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending adds/aborts; wait for one if idle. False once asked to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
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

    def _apply(self, item: _Add | _Abort) -> None:
        if isinstance(item, _Abort):
            out = self.engine.abort(item.request_id)
            if out is not None:
                self._deliver(out)
            return
        try:
            self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.arrival)
        except Exception as exc:
            self._deliver_error(item.request_id, exc)

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
        for rid in list(self.engine._requests):
            self.engine.abort(rid)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._deliver_error(rid, EngineDeadError(str(exc)))
        self._publish()

    def _publish(self) -> None:
        engine = self.engine
        self._queue = engine.queue_snapshot()
        self._stats = engine.stats()
