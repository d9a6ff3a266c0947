"""Admission control: who gets in (ready, not draining, queue bound, predicted TTFT) and who is in flight.

Refuses early (503, or 429 with a Retry-After) instead of queueing work that would miss its SLO;
it never queues or touches engine state itself, it only counts tickets and reads engine estimates.
"""

from __future__ import annotations

from tailserve.engine.request import SloTarget
from tailserve.errors import RequestRejectedError
from tailserve.server.drain import Drain
from tailserve.server.engine_api import Engine
from tailserve.server.errors import ServiceUnavailableError


class Ticket:
    """One admitted request: counted as not-yet-started until its first token, in flight until done.

    `estimate_s` is the TTFT that admission predicted for it on arrival (0 when nothing was ahead:
    an idle server does not price a lone prompt); responses report it, so a client can check how
    far admission's predictions are from what happened (docs/INTERFACES.md)."""

    def __init__(self, admission: Admission, estimate_s: float = 0.0) -> None:
        self._admission = admission
        self.estimate_s = estimate_s
        self._started = False
        self._done = False

    def started(self) -> None:
        """The first output arrived: the request left the queue."""
        if not self._started:
            self._started = True
            self._admission.not_started -= 1

    def done(self) -> None:
        """The response is complete (or abandoned); idempotent."""
        if self._done:
            return
        self.started()
        self._done = True
        self._admission.release()


class Admission:
    """Readiness, draining and the admission decision for one server (event-loop thread only)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.ready = False
        self.not_started = 0
        self.drain = Drain()

    @property
    def draining(self) -> bool:
        return self.drain.draining

    @property
    def in_flight(self) -> int:
        return self.drain.in_flight

    @property
    def serving(self) -> bool:
        """Ready and not draining: what /ready and `tailserve_ready` report."""
        return self.ready and not self.draining

    def check_available(self) -> None:
        """503 before warm-up has finished and from the moment draining starts."""
        if self.draining:
            raise ServiceUnavailableError("draining")
        if not self.ready:
            raise ServiceUnavailableError("not_ready")

    def admit(self, num_prompt_tokens: int, slo: SloTarget | None = None) -> Ticket:
        """A ticket, or RequestRejectedError (429) when the queue is full or the request's own TTFT
        target (`slo`, else --slo-ttft) would break. `num_prompt_tokens`: the prompt tokens it would
        compute (Engine.prompt_work_tokens: a cached prefix costs nothing)."""
        self.check_available()
        limits = self._engine.config.scheduler
        ttft_s = slo.ttft_s if slo is not None and slo.ttft_s is not None else limits.slo_ttft_s
        # The estimate counts every request handed to engine.generate(), seen by a step or not, and
        # leaves out work past saving (it only keeps a reserve of each step: docs/ENGINE.md).
        wait_s = self._engine.estimate_wait_s(num_prompt_tokens, ttft_s)
        # The engine counts its own queue; our count also covers requests handed over but not yet seen
        # there. At most max_num_seqs of those can be running (prefilling) rather than waiting.
        queued = max(self._engine.stats().num_waiting, self.not_started - limits.max_num_seqs)
        if queued >= limits.max_waiting:
            message = f"Server overloaded: {queued} requests are already waiting (limit {limits.max_waiting})"
            raise RequestRejectedError(message, retry_after_s=max(1.0, wait_s), reason="queue_full")
        if wait_s > ttft_s:
            message = (
                f"Server overloaded: predicted queue wait {wait_s:.2f}s exceeds the "
                f"time-to-first-token target of {ttft_s:.2f}s"
            )
            raise RequestRejectedError(message, retry_after_s=wait_s - ttft_s, reason="slo")
        self.drain.enter()
        self.not_started += 1
        return Ticket(self, wait_s)

    def release(self) -> None:
        """Called by Ticket.done()."""
        self.drain.leave()

    def begin_drain(self) -> None:
        """Stop admitting: every new request gets 503 from now on."""
        self.drain.begin()
