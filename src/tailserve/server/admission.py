"""Admission control: who gets in (ready, not draining, queue bound, predicted TTFT and TPOT) and
who is in flight.

Refuses early (503, or 429 with a Retry-After) instead of queueing work that would miss its SLO;
it never queues or touches engine state itself, it only counts tickets and reads engine estimates.
The engine's TTFT estimates are scaled by what admission learned of their error (WaitCorrection).
Its TPOT prices are not: they are played forward from decode steps timed as they run (a learned
ratio of a request's TPOT to its price at admission mostly learned the requests admitted after it,
each let in up to the line, and refused ~15% of a light load for 0.5% fewer misses in virtual time).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from tailserve.engine.quote import WaitQuote
from tailserve.engine.tpot_model import TpotPrice
from tailserve.errors import InvalidRequestError, RequestRejectedError
from tailserve.http.drain import Drain
from tailserve.http.errors import ServiceUnavailableError
from tailserve.server.engine_api import Engine


class WaitCorrection:
    """How far the engine's TTFT predictions fall from what happens, learned while serving.

    The engine prices the work queued ahead of a newcomer when it arrives. Work that arrives later
    and goes first (a shorter prompt under `slo`'s order, a request past saving taking the next free
    slot) is not in that price, so under heavy load the prediction runs short, and admission lets in
    requests that then miss their target slowly instead of refusing them at once. Each admitted
    request that had real work ahead of it (a prediction of at least MIN_SHARE of its TTFT target)
    teaches the ratio of its actual TTFT to the prediction; the factor is the QUANTILE of the latest
    WINDOW ratios no older than MAX_AGE_S, within BOUNDS, and 1 until MIN_SAMPLES are in. A high
    quantile, not the median: admission lets requests in up to their target, so a request admitted
    near the line misses whenever its ratio runs above the factor; with the median half of them
    did (scripted engine, Poisson overload, deadline order: 4-27% of admitted requests missed at
    the median, 0.6-3% at the 95th percentile, with as many refused; tests/server/
    test_admission_virtual.py). It falls back as the load does: requests admitted under a large
    factor wait less and teach smaller ratios. A factor under 1 (the engine over-predicting) lets
    more in, which the next ratios check.
    """

    WINDOW = 64
    MIN_SAMPLES = 16
    MAX_AGE_S = 60.0
    MIN_SHARE = 0.25
    BOUNDS = (0.5, 4.0)
    QUANTILE = 0.95

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.clock = clock
        self._ratios: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)  # (when, actual / predicted)

    def teaches(self, predicted_s: float, ttft_target_s: float) -> bool:
        """Whether a request admitted with this prediction will teach a ratio: only a wait the
        engine priced (fixed per-step costs dominate a shorter one)."""
        return self.enabled and predicted_s > 0 and predicted_s >= self.MIN_SHARE * ttft_target_s

    def record(self, predicted_s: float, actual_s: float) -> None:
        self._ratios.append((self.clock(), actual_s / predicted_s))

    def factor(self) -> float:
        """What admission multiplies the engine's predictions by now."""
        if not self.enabled:
            return 1.0
        oldest = self.clock() - self.MAX_AGE_S
        while self._ratios and self._ratios[0][0] < oldest:
            self._ratios.popleft()
        if len(self._ratios) < self.MIN_SAMPLES:
            return 1.0
        low, high = self.BOUNDS
        ratios = sorted(r for _, r in self._ratios)
        nearest_rank = math.ceil(self.QUANTILE * len(ratios)) - 1
        return min(max(ratios[nearest_rank], low), high)


class Ticket:
    """One admitted request: counted as not-yet-started until its first token, in flight until done.

    `estimate_s` is the TTFT that admission predicted for it on arrival, the engine's prediction
    (the work queued ahead of it, then its own prefill) times the learned correction; responses report it, so a client can check how far admission's predictions are from
    what happened (docs/INTERFACES.md). A ticket whose engine prediction `teaches` the correction
    records its actual TTFT there when its first output arrives."""

    def __init__(
        self,
        admission: Admission,
        estimate_s: float = 0.0,
        predicted_s: float = 0.0,
        teaches: bool = False,
        held_s: float = 0.0,
        tpot_estimate_s: float = 0.0,
    ) -> None:
        self._admission = admission
        self.estimate_s = estimate_s
        self.held_s = held_s  # queued with a hold this long (its TPOT price found none at once)
        # Its own TPOT as the price played the future on arrival, everything admitted so far and it
        # included (TpotPrice.own_s; 0: not priced): responses report it beside the TTFT estimate.
        self.tpot_estimate_s = tpot_estimate_s
        self._predicted_s = predicted_s
        self._teaches = teaches
        self._admitted_at = admission.correction.clock()
        self._started = False
        self._done = False

    def started(self, teach: bool = True) -> None:
        """The first output arrived: the request left the queue. `teach=False`: the first output was
        awaited together with others' (a list of prompts), so its time is not this request's own."""
        if self._started:
            return
        self._started = True
        self._admission.not_started -= 1
        if teach and self._teaches:
            correction = self._admission.correction
            correction.record(self._predicted_s, correction.clock() - self._admitted_at)

    def done(self) -> None:
        """The response is complete (or abandoned: nothing learned); idempotent."""
        if self._done:
            return
        self.started(teach=False)
        self._done = True
        self._admission.release()


class Admission:
    """Readiness, draining and the admission decision for one server (event-loop thread only)."""

    def __init__(self, engine: Engine, correction: WaitCorrection | None = None) -> None:
        self._engine = engine
        self.correction = correction or WaitCorrection()
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

    def check_fits(self, generations: int, prompts: int) -> None:
        """400 when one HTTP request asks for more engine requests (prompts x n, or x best_of) than
        the waiting queue holds: handed over together, they would all wait at once, and no wait
        would let them in (the engine may start some before the rest arrive, but not reliably)."""
        max_waiting = self._engine.config.scheduler.max_waiting
        if generations <= max_waiting:
            return
        per_prompt = generations // max(1, prompts)
        message = (
            f"This request asks for {generations} generations ({prompts} prompts x {per_prompt} choices "
            f"each), more than the server queues at once (--max-waiting {max_waiting}), so it can never "
            f"be admitted: send fewer prompts or a smaller n"
        )
        raise InvalidRequestError(message, "n" if per_prompt > 1 else "prompt")

    def admit(self, quote: WaitQuote, own_admitted: int = 0, generations: int = 1) -> Ticket:
        """A ticket, or RequestRejectedError (429) when the queue is full or, with work queued ahead
        of it, the request's own TTFT target would break. `quote`: the engine's price of the request
        (Engine.submit), whose predicted wait counts every request handed to the engine, seen by a
        step or not, as the planner orders them (a savable newcomer passes work past saving, which
        only keeps a reserve of each step: docs/ENGINE.md). `generations`: the engine requests of the
        HTTP request this one belongs to, `own_admitted` of them admitted already (the message says
        when those, not others, filled the queue)."""
        self.check_available()
        limits = self._engine.config.scheduler
        ttft_s, predicted_s, tpot = quote.ttft_s, quote.predicted_wait_s, quote.tpot
        held = tpot is not None and tpot.hold_s > 0  # to start once a stream ends: its TTFT counts that
        if held:
            assert tpot is not None
            predicted_s = max(predicted_s, tpot.own_first_s)
        wait_s = predicted_s * self.correction.factor()
        # The engine counts its own queue; our count also covers requests handed over but not yet seen
        # there. At most max_num_seqs of those can be running (prefilling) rather than waiting.
        queued = max(self._engine.stats().num_waiting, self.not_started - limits.max_num_seqs)
        if queued >= limits.max_waiting:
            message = _queue_full_message(queued, limits.max_waiting, own_admitted, generations)
            raise RequestRejectedError(message, retry_after_s=max(1.0, wait_s), reason="queue_full")
        # A request with nothing queued ahead starts with the next step: refusing it saves no one,
        # and no server could give it a sooner first token, so it is let in even when its own
        # prefill alone runs past its target (its estimate says so).
        if quote.queued and not held and wait_s > ttft_s:
            learned = (
                ""
                if wait_s == predicted_s
                else f" (the engine's {predicted_s:.2f}s x the learned correction)"
            )
            message = (
                f"Server overloaded: predicted queue wait {wait_s:.2f}s{learned} exceeds the "
                f"time-to-first-token target of {ttft_s:.2f}s"
            )
            raise RequestRejectedError(message, retry_after_s=wait_s - ttft_s, reason="slo")
        if tpot is not None:
            _check_tpot(tpot, wait_s if held else None, ttft_s)
        self.drain.enter()
        self.not_started += 1
        held_s, tpot_s = (tpot.hold_s, tpot.own_s) if tpot is not None else (0.0, 0.0)
        teaches = self.correction.teaches(predicted_s, ttft_s)
        return Ticket(self, wait_s, predicted_s, teaches, held_s, tpot_s)

    def release(self) -> None:
        """Called by Ticket.done()."""
        self.drain.leave()

    def begin_drain(self) -> None:
        """Stop admitting: every new request gets 503 from now on."""
        self.drain.begin()


def _queue_full_message(queued: int, max_waiting: int, own_admitted: int, generations: int) -> str:
    """The 429's text: whose requests fill the queue, and what this request needed."""
    if own_admitted:
        return (
            f"Server overloaded: this request's {generations} generations (prompts x n) do not fit beside "
            f"the requests already queued; {own_admitted} fitted before the waiting queue reached its "
            f"limit of {max_waiting}"
        )
    needs = f"; this request needs {generations} places" if generations > 1 else ""
    return f"Server overloaded: {queued} requests are already waiting (the limit of {max_waiting}){needs}"


def _check_tpot(price: TpotPrice, held_wait_s: float | None, ttft_s: float) -> None:
    """429 when, with the newcomer, a stream predicted within its TPOT target without it would miss
    it (one predicted to miss anyway is not saved by refusing), or the newcomer's own TPOT would
    miss its target while alone it would not (one that misses even alone is let in: nothing
    refused would speed it up): `TpotPrice.keeps_promises`. Where the price holds the newcomer
    until a stream ends (`held_wait_s`: its TTFT so, with the learned correction), also when that
    TTFT runs past `ttft_s`. No headroom under the target: with one (95%, and streams between
    it and the target kept from sliding over), one served chat-scaled run at 0.8 req/s refused 58%
    and 4.8% of the admitted still missed, against 19-47% and 3.7-15% in four runs without
    (docs/notes/tail-under-slo.md, "Admission prices TPOT"). Retry-After: until the first stream
    running now is expected to end."""
    harmed = price.harmed()
    own_s, target_s = price.own_s, price.own_target_s
    late = held_wait_s is not None and held_wait_s > ttft_s
    if not harmed and not price.own_misses() and not late:
        return
    if late:
        assert held_wait_s is not None
        what = (
            f"a running request over its time-per-output-token target, and waiting for one to end "
            f"would give its first token in {held_wait_s:.2f}s, past its target of {ttft_s:.2f}s"
        )
    elif harmed:
        worst = max(harmed, key=lambda o: o.with_s / o.target_s)
        what = (
            f"{len(harmed)} running or queued request(s) over their time-per-output-token target: "
            f"the worst predicted {1e3 * worst.with_s:.1f} ms against {1e3 * worst.target_s:.1f} ms"
        )
    else:
        what = f"its own predicted TPOT {1e3 * own_s:.1f} ms over its target of {1e3 * target_s:.1f} ms"
    message = f"Server overloaded: admitting this request would put {what}"
    raise RequestRejectedError(message, retry_after_s=max(1.0, price.first_end_s), reason="slo_tpot")
