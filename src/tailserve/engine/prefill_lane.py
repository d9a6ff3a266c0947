"""The prefill lane: prompt chunks computed on a thread of their own while the step loop decodes.

A step that carries prompt tokens costs every running stream many decode steps (2 streams decode at
12 ms a step; a step with a 256-token chunk beside them takes 79 ms: docs/notes/tail-under-slo.md).
While streams decode and prompts wait, the engine splits its CPU threads instead: the lane runs the
prompt chunks with half of them, the step loop goes on decoding with the rest, and a chunk's
results join the streams at the first step after it ends. With no stream decoding, prompts run in
the ordinary step on every thread. The kernels give the same bits at any thread count and for any
batch, so where a chunk runs changes no output.

A plan handed over with several prompts runs them one after another, each its own forward, and the
step loop takes each one's results (its first token) as soon as it ends: run as one forward, the
first prompt of a pair waited for the second's rows too (on the no-bf16 CPU a 512-token chunk of two
256-token prompts took 0.42-0.52 s, one prompt 0.22-0.25 s; docs/notes/tail-under-slo.md, "The lane
runs a plan's prompts one by one"). Back to back on the lane's thread, they pay no gap between them.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tailserve.engine.scheduler import StepPlan

if TYPE_CHECKING:
    from tailserve.executor.runner import ModelRunner, SeqChunk, StepResult


@dataclass
class LaneRun:
    """A finished lane chunk: its plan, chunks, what the runner found, and when it ran (monotonic s)."""

    plan: StepPlan
    chunks: list[SeqChunk]
    result: StepResult
    start: float
    end: float


class PrefillLane:
    """One worker thread with `threads` CPU threads that runs one plan at a time, its prompts one by
    one (`submit`); `take` hands their results over in that order, each as soon as it ends."""

    def __init__(self, runner: ModelRunner, threads: int) -> None:
        self.runner = runner
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailserve-prefill-lane")
        # The plan's parts not yet taken, in the order they run: (part, its chunks, its run).
        self._parts: deque[tuple[StepPlan, list[SeqChunk], Future[tuple[StepResult, float, float]]]] = deque()

    @property
    def busy(self) -> bool:
        """A plan was handed over and not all of its results taken."""
        return bool(self._parts)

    def done(self) -> bool:
        """The next part to take has finished (its results wait in `take`)."""
        return bool(self._parts) and self._parts[0][2].done()

    def submit(self, plan: StepPlan, chunks: list[SeqChunk]) -> None:
        """Run the plan's prompts one after another on the lane's thread, each its own part."""
        if self._parts:
            raise RuntimeError("the prefill lane runs one plan at a time")
        for part, part_chunks in split_by_request(plan, chunks):
            self._parts.append((part, part_chunks, self._pool.submit(self._run, part_chunks)))

    def _run(self, chunks: list[SeqChunk]) -> tuple[StepResult, float, float]:
        start = time.monotonic()
        result = self.runner.execute(chunks, threads=self.threads)
        return result, start, time.monotonic()

    def take(self) -> LaneRun:
        """The next part's results, waiting for it to end; an error in the lane is raised here, on
        the step loop's thread, as a failed step's would be."""
        if not self._parts:
            raise RuntimeError("the prefill lane has no plan")
        plan, chunks, future = self._parts.popleft()
        try:
            result, start, end = future.result()
        except BaseException:  # the plan fails as one: its later parts are let end and dropped
            while self._parts:
                self._parts.popleft()[2].exception()
            raise
        return LaneRun(plan, chunks, result, start, end)

    def close(self) -> None:
        """Let the running parts end, then stop the thread (idempotent)."""
        self._pool.shutdown(wait=True)


def split_by_request(plan: StepPlan, chunks: list[SeqChunk]) -> list[tuple[StepPlan, list[SeqChunk]]]:
    """A prompt plan (no decodes) as one plan per request, in its order, each with its chunk."""
    if len(plan.scheduled) <= 1:
        return [(plan, chunks)]
    return [
        (StepPlan([entry], [table], [], 0, plan.prefill_cap), [chunk])
        for entry, table, chunk in zip(plan.scheduled, plan.block_tables, chunks, strict=True)
    ]
