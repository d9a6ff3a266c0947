"""The prefill lane: prompt chunks computed on a thread of their own while the step loop decodes.

A step that carries prompt tokens costs every running stream many decode steps (2 streams decode at
12 ms a step; a step with a 256-token chunk beside them takes 79 ms: docs/notes/tail-under-slo.md).
While streams decode and prompts wait, the engine splits its CPU threads instead: the lane runs the
prompt chunks with half of them, the step loop goes on decoding with the rest, and a chunk's
results join the streams at the first step after it ends. With no stream decoding, prompts run in
the ordinary step on every thread. The kernels give the same bits at any thread count and for any
batch, so where a chunk runs changes no output.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailserve.engine.scheduler import StepPlan
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
    """One worker thread with `threads` CPU threads that runs one prompt plan at a time."""

    def __init__(self, runner: ModelRunner, threads: int) -> None:
        self.runner = runner
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailserve-prefill-lane")
        self._job: tuple[StepPlan, list[SeqChunk], Future[tuple[StepResult, float, float]]] | None = None

    @property
    def busy(self) -> bool:
        """A plan was handed over and its results not yet taken."""
        return self._job is not None

    def done(self) -> bool:
        """The plan handed over has finished (its results wait in `take`)."""
        return self._job is not None and self._job[2].done()

    def submit(self, plan: StepPlan, chunks: list[SeqChunk]) -> None:
        if self._job is not None:
            raise RuntimeError("the prefill lane runs one plan at a time")
        self._job = (plan, chunks, self._pool.submit(self._run, chunks))

    def _run(self, chunks: list[SeqChunk]) -> tuple[StepResult, float, float]:
        start = time.monotonic()
        result = self.runner.execute(chunks, threads=self.threads)
        return result, start, time.monotonic()

    def take(self) -> LaneRun:
        """The plan's results, waiting for it to end; an error in the lane is raised here, on the
        step loop's thread, as a failed step's would be."""
        if self._job is None:
            raise RuntimeError("the prefill lane has no plan")
        plan, chunks, future = self._job
        try:
            result, start, end = future.result()
        finally:
            self._job = None
        return LaneRun(plan, chunks, result, start, end)

    def close(self) -> None:
        """Let a running chunk end, then stop the thread (idempotent)."""
        self._pool.shutdown(wait=True)
