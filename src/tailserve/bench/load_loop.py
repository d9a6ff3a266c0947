"""The load generator's event loop: conversations sent on an absolute clock or by closed-loop workers.

Open loop: a dispatcher sleeps until `start + offset` and starts each conversation as its own task.
Ctrl-C or a fatal failure stops sending, cancels what is in flight and returns what was measured;
the client's own health (CPU, loop lag, lateness) is measured alongside."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx

from tailserve.bench.client import TargetConfig, preflight, request_body, send_request
from tailserve.bench.client_health import ClientHealth, client_health
from tailserve.bench.errors import TargetError
from tailserve.bench.records import FATAL_ERROR_KINDS, RequestRecord
from tailserve.bench.stats import nearest_rank
from tailserve.bench.tokenizers import PromptTokenizer
from tailserve.bench.workload import ConversationPlan, WorkloadGenerator

_START_LEAD_S = 0.05
_LAG_PROBE_S = 0.05
MAX_RETRY_AFTER_S = 10.0


@dataclass(frozen=True)
class RunControl:
    """How long to run and what to count. Give `num_requests`, `duration_s`, or both (first one wins)."""

    num_requests: int | None = None
    duration_s: float | None = None
    warmup_s: float = 0.0
    warmup_requests: int = 0  # the first N requests sent are warm-up too (how -n counts it)
    cooldown_s: float = 0.0
    max_concurrency: int | None = None
    concurrency: int = 1
    progress: bool = False
    progress_interval_s: float = 1.0
    fatal_after: int = 5
    handle_sigint: bool = True


@dataclass
class RunOutcome:
    """Everything a run measured, however it ended (`status`: complete | interrupted | aborted)."""

    records: list[RequestRecord]
    status: str
    abort_reason: str | None
    model: str
    started_at: str
    wall_s: float
    client: ClientHealth | None = None
    send_end_s: float = 0.0


@dataclass
class _RunState:
    records: list[RequestRecord] = field(default_factory=list)
    in_flight: set[asyncio.Task[Any]] = field(default_factory=set)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    finished: int = 0
    active: int = 0
    abort_reason: str | None = None
    interrupted: bool = False
    loop_lags: list[float] = field(default_factory=list)


class LoadLoop:
    """One benchmark run against one target."""

    def __init__(
        self,
        target: TargetConfig,
        control: RunControl,
        tokenizer: PromptTokenizer,
        conversations: list[ConversationPlan] | None = None,
        generator: WorkloadGenerator | None = None,
        target_rate_per_s: float | None = None,
        out: TextIO | None = None,
    ) -> None:
        if conversations is None and generator is None:
            raise ValueError("give scheduled conversations (open loop) or a generator (closed loop)")
        self.target = target
        self.control = control
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.generator = generator
        self.target_rate_per_s = target_rate_per_s
        self.out = out or sys.stderr
        self._model = target.model or ""
        self._claimed = 0

    async def run(self) -> RunOutcome:
        """Preflight, send everything, wait, and return the outcome (never raises for request failures)."""
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            self._model = await preflight(self.target)
        except TargetError as exc:
            return RunOutcome([], "aborted", str(exc), self.target.model or "", started_at, 0.0)
        state = _RunState()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.target.timeout_s, connect=min(10.0, self.target.timeout_s))
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            # The clock starts once the client exists: building it took 150-400 ms on a busy box,
            # which would otherwise send the first requests late and in a burst.
            run_start = time.perf_counter() + _START_LEAD_S
            with self._sigint(state):
                helpers = [asyncio.create_task(self._probe_loop_lag(state))]
                if self.control.progress:
                    helpers.append(asyncio.create_task(self._progress(state, run_start)))
                try:
                    await self._send_all(http, state, run_start)
                finally:
                    for task in helpers:
                        task.cancel()
                    await asyncio.gather(*helpers, return_exceptions=True)
        wall_s = time.perf_counter() - wall_start
        cpu_util = (time.process_time() - cpu_start) / max(wall_s, 1e-9)
        if self.control.progress:
            self.out.write("\n")
        status = "aborted" if state.abort_reason else "interrupted" if state.interrupted else "complete"
        outcome = RunOutcome(state.records, status, state.abort_reason, self._model, started_at, wall_s)
        outcome.send_end_s = self._send_end(state)
        outcome.client = client_health(state.records, state.loop_lags, cpu_util, self.target_rate_per_s)
        return outcome

    async def _send_all(self, http: httpx.AsyncClient, state: _RunState, run_start: float) -> None:
        if self.conversations is not None:
            senders = [
                asyncio.create_task(self._dispatch_open_loop(http, state, run_start, self.conversations))
            ]
        else:
            senders = [
                asyncio.create_task(self._closed_loop_worker(http, state, run_start))
                for _ in range(self.control.concurrency)
            ]
        await self._wait_or_stop(state, senders)

    async def _wait_or_stop(self, state: _RunState, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for `tasks` and every request they start; on a stop (Ctrl-C, fatal abort) cancel all."""
        stopper: asyncio.Task[Any] = asyncio.create_task(state.stop.wait())
        pending: set[asyncio.Task[Any]] = set(tasks)
        while pending and not state.stop.is_set():
            _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopper)
            pending |= {t for t in state.in_flight if not t.done()}
        stopper.cancel()
        to_cancel = pending | {t for t in state.in_flight if not t.done()}
        for task in to_cancel:
            task.cancel()
        await asyncio.gather(*to_cancel, stopper, return_exceptions=True)

    async def _dispatch_open_loop(
        self, http: httpx.AsyncClient, state: _RunState, run_start: float, plans: list[ConversationPlan]
    ) -> None:
        """Start each conversation at run_start + offset; never sleep relative to the previous send."""
        limit = asyncio.Semaphore(self.control.max_concurrency) if self.control.max_concurrency else None
        for plan in plans:
            due = run_start + (plan.offset_s or 0.0)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # a stop cancels this task, waits included
            if limit is not None:
                await limit.acquire()
            task = asyncio.create_task(self._conversation(http, state, run_start, plan, limit))
            state.in_flight.add(task)
            task.add_done_callback(state.in_flight.discard)

    async def _closed_loop_worker(self, http: httpx.AsyncClient, state: _RunState, run_start: float) -> None:
        assert self.generator is not None
        deadline = run_start + self.control.duration_s if self.control.duration_s is not None else math.inf
        await asyncio.sleep(max(0.0, run_start - time.perf_counter()))
        while not state.stop.is_set() and time.perf_counter() < deadline:
            if self.control.num_requests is not None and self._claimed >= self.control.num_requests:
                return
            plan = self.generator.conversation(None)
            self._claimed += len(plan.turns)
            last = await self._conversation(http, state, run_start, plan, None)
            if last is not None and last.retry_after_s:
                # A user told to come back later does; hammering a shedding server measures nothing.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        state.stop.wait(), timeout=min(last.retry_after_s, MAX_RETRY_AFTER_S)
                    )

    async def _conversation(
        self,
        http: httpx.AsyncClient,
        state: _RunState,
        run_start: float,
        plan: ConversationPlan,
        limit: asyncio.Semaphore | None,
    ) -> RequestRecord | None:
        """Send the turns in order (later turns carry the earlier exchange); return the last record."""
        history: list[dict[str, str]] = []
        record: RequestRecord | None = None
        try:
            for turn in plan.turns:
                if turn.turn > 0 and self.generator is not None and self.generator.spec.think_time_s:
                    await asyncio.sleep(self.generator.spec.think_time_s)
                record = RequestRecord(
                    index=turn.index,
                    conversation=turn.conversation,
                    turn=turn.turn,
                    requested_output_tokens=turn.output_tokens,
                    planned_input_tokens=turn.input_tokens,
                    scheduled_s=plan.offset_s if turn.turn == 0 else None,
                    shared_prefix=turn.system_prefix is not None,
                )
                state.records.append(record)
                body = request_body(self.target, self._model, turn, history)
                state.active += 1
                try:
                    await send_request(http, self.target, body, record, self.tokenizer, run_start)
                except asyncio.CancelledError:
                    record.phase, record.error_kind = "cancelled", "cancelled"
                    record.error_message = "run stopped before the request finished"
                    raise
                finally:
                    state.active -= 1
                self._on_finished(state, record)
                if not record.ok:
                    return record
                history += [{"role": "user", "content": turn.prompt}]
                history += [{"role": "assistant", "content": record.output_text}]
        finally:
            if limit is not None:
                limit.release()
        return record

    def _on_finished(self, state: _RunState, record: RequestRecord) -> None:
        """Count the request; stop the run if the first few all failed in a way that will not heal."""
        state.finished += 1
        n = self.control.fatal_after
        if state.finished != n or state.abort_reason:
            return
        done = [r for r in state.records if r.error_kind != "cancelled" and (r.done_s is not None)]
        kinds = Counter(r.error_kind for r in done[:n])
        if len(done) >= n and all(r.error_kind in FATAL_ERROR_KINDS for r in done[:n]):
            kind = kinds.most_common(1)[0][0]
            example = next(r.error_message for r in done if r.error_kind == kind)
            state.abort_reason = f"the first {n} requests all failed ({kind}): {example}"
            state.stop.set()

    @contextlib.contextmanager
    def _sigint(self, state: _RunState) -> Iterator[None]:
        """Ctrl-C stops the run cleanly (partial report); a second one is not needed."""
        loop = asyncio.get_running_loop()
        installed = False
        if self.control.handle_sigint:

            def on_sigint() -> None:
                state.interrupted = True
                state.stop.set()

            try:
                loop.add_signal_handler(signal.SIGINT, on_sigint)
                installed = True
            except (NotImplementedError, RuntimeError, ValueError):
                installed = False
        try:
            yield
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGINT)

    async def _probe_loop_lag(self, state: _RunState) -> None:
        """How late the event loop wakes up: a busy client sends late and reads chunks late."""
        while True:
            before = time.perf_counter()
            await asyncio.sleep(_LAG_PROBE_S)
            state.loop_lags.append(max(0.0, time.perf_counter() - before - _LAG_PROBE_S))

    async def _progress(self, state: _RunState, run_start: float) -> None:
        """One status line, rewritten every interval, with live P99s of what finished so far."""
        while True:
            await asyncio.sleep(self.control.progress_interval_s)
            line = progress_line(state.records, time.perf_counter() - run_start, state.active)
            self.out.write("\r" + line)
            self.out.flush()

    def _send_end(self, state: _RunState) -> float:
        """End of the sending period, from which the cool-down is counted back."""
        if self.control.duration_s is not None and not state.interrupted and not state.abort_reason:
            return self.control.duration_s
        return max((r.sent_s for r in state.records), default=0.0)


def progress_line(records: list[RequestRecord], elapsed_s: float, in_flight: int) -> str:
    """`[    12s] sent 120 done 110 err 0 in-flight 10 | p99 TTFT 0.231s TPOT 12.1ms E2E 1.200s`."""
    done = [r for r in records if r.done_s is not None and r.phase != "cancelled"]
    ok = [r for r in done if r.ok]
    ttft = _live_p99([r.ttft_s for r in ok])
    tpot = _live_p99([r.tpot_s for r in ok])
    e2e = _live_p99([r.e2e_s for r in ok])
    return (
        f"[{elapsed_s:6.0f}s] sent {len(records)} done {len(done)} err {len(done) - len(ok)} "
        f"in-flight {in_flight} | p99 TTFT {_live(ttft, 1, 's')} TPOT {_live(tpot, 1000, 'ms')} "
        f"E2E {_live(e2e, 1, 's')}   "
    )


def _live_p99(values: list[float | None]) -> float | None:
    data = sorted(v for v in values if v is not None)
    return nearest_rank(data, 99.0) if data else None


def _live(value: float | None, scale: float, unit: str) -> str:
    return "-" if value is None else f"{value * scale:.{1 if scale > 1 else 3}f}{unit}"
