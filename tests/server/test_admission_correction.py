"""Admission learns how far the engine's TTFT predictions are from what happens, and refuses on the
corrected prediction: requests that would miss their target slowly get a fast 429 instead.

Unit tests drive WaitCorrection and Admission on a scripted clock; the HTTP test runs a real server
over FakeEngine whose first tokens come later than its predictions say.
"""

from __future__ import annotations

import httpx
import pytest

from tailserve.config import SchedulerConfig
from tailserve.engine.quote import WaitQuote
from tailserve.engine.tpot_model import StreamTpot, TpotPrice
from tailserve.errors import RequestRejectedError
from tailserve.server.admission import Admission, WaitCorrection
from tailserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server
from tests.server.test_app_fake import metric


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admission_over(engine: FakeEngine, clock: Clock, enabled: bool = True) -> Admission:
    admission = Admission(engine, WaitCorrection(enabled=enabled, clock=clock))
    admission.ready = True
    return admission


def quote(engine: FakeEngine) -> WaitQuote:
    """The price of a 10-token prompt under the tests' 1 s TTFT target."""
    return WaitQuote(10, engine.config.scheduler.slo_ttft_s, engine.estimate_wait_s())


def teach(admission: Admission, engine: FakeEngine, clock: Clock, n: int, actual_s: float) -> None:
    """n admitted requests whose first token came `actual_s` after admission."""
    for _ in range(n):
        ticket = admission.admit(quote(engine))
        clock.now += actual_s
        ticket.started()
        ticket.done()


def test_factor_is_a_high_quantile_of_recent_ratios_bounded_and_one_until_enough() -> None:
    clock = Clock()
    c = WaitCorrection(clock=clock)
    for _ in range(WaitCorrection.MIN_SAMPLES - 1):
        c.record(0.5, 1.0)
    assert c.factor() == 1.0  # too few to say
    for _ in range(38 - (WaitCorrection.MIN_SAMPLES - 1)):
        c.record(0.5, 1.0)
    c.record(0.5, 1.5)
    c.record(0.5, 1.5)
    assert c.factor() == pytest.approx(2.0)  # 38 of 40 ratios are 2.0: 95% are at most 2.0
    c.record(0.5, 1.5)
    assert c.factor() == pytest.approx(3.0)  # 3 of 41 are 3.0: more than 5% would run past 2.0
    for _ in range(WaitCorrection.WINDOW):
        c.record(0.5, 0.2)  # the engine over-predicting: a factor under 1, down to the bound
    assert c.factor() == WaitCorrection.BOUNDS[0]
    for _ in range(WaitCorrection.WINDOW):
        c.record(0.1, 5.0)
    assert c.factor() == WaitCorrection.BOUNDS[1]
    clock.now += WaitCorrection.MAX_AGE_S + 1
    assert c.factor() == 1.0  # what it learned has aged out
    assert WaitCorrection(enabled=False).factor() == 1.0


def test_only_priced_waits_teach() -> None:
    c = WaitCorrection()
    assert not c.teaches(0.0, 1.0)  # nothing to compute, nothing priced
    assert not c.teaches(0.2, 1.0)  # under MIN_SHARE of the target: per-step costs dominate
    assert c.teaches(0.3, 1.0)
    assert not WaitCorrection(enabled=False).teaches(0.5, 1.0)


def test_admission_refuses_on_the_corrected_prediction_and_reports_it() -> None:
    clock = Clock()
    engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=1.0), wait_estimate_s=0.4)
    admission = admission_over(engine, clock)
    teach(admission, engine, clock, WaitCorrection.MIN_SAMPLES, actual_s=1.2)  # three times the prediction
    assert admission.correction.factor() == pytest.approx(3.0)
    with pytest.raises(RequestRejectedError) as refused:
        admission.admit(quote(engine))  # 0.4 s raw, 1.2 s corrected: over the 1 s target
    assert "0.40s x the learned correction" in str(refused.value)
    assert refused.value.retry_after_s == pytest.approx(0.2)
    engine.wait_estimate_s = 0.3
    ticket = admission.admit(quote(engine))  # 0.9 s corrected: admitted, and that is its reported estimate
    assert ticket.estimate_s == pytest.approx(0.9)
    ticket.done()
    # The same history on an admission told not to correct: the raw 0.4 s is admitted.
    raw_engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=1.0), wait_estimate_s=0.4)
    raw = admission_over(raw_engine, clock, False)
    teach(raw, raw_engine, clock, WaitCorrection.MIN_SAMPLES, actual_s=1.2)
    assert raw.admit(quote(raw_engine)).estimate_s == pytest.approx(0.4)


def test_abandoned_and_unpriced_requests_teach_nothing() -> None:
    clock = Clock()
    engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=1.0), wait_estimate_s=0.4)
    admission = admission_over(engine, clock)
    for _ in range(2 * WaitCorrection.MIN_SAMPLES):
        ticket = admission.admit(quote(engine))
        clock.now += 5.0
        ticket.done()  # the client went away before a first token: its wait is not a TTFT
    engine.wait_estimate_s = 0.1  # under a quarter of the target
    teach(admission, engine, clock, 2 * WaitCorrection.MIN_SAMPLES, actual_s=5.0)
    for _ in range(2 * WaitCorrection.MIN_SAMPLES):
        ticket = admission.admit(quote(engine))
        clock.now += 5.0
        ticket.started(teach=False)  # awaited with other prompts' first tokens
        ticket.done()
    assert admission.correction.factor() == 1.0
    assert admission.not_started == 0 and admission.in_flight == 0


def test_server_learns_slow_first_tokens_and_refuses_fast() -> None:
    """The engine predicts 40 ms and takes at least 120 ms to a first token: after enough of those,
    a request is refused at once, and the factor is on /metrics. Told not to correct, it admits."""
    for correct in (True, False):
        engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=0.1), step_s=0.12, wait_estimate_s=0.04)
        with threaded_server(engine, ServerConfig(admission_correction=correct)) as base:
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 1}
            for _ in range(WaitCorrection.MIN_SAMPLES):
                assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
            r = httpx.post(f"{base}/v1/completions", json=body)
            factor = metric(base, "tailserve_admission_correction")
            if correct:
                assert factor >= 2.9  # each first token took >= 3x its prediction
                assert r.status_code == 429 and r.json()["error"]["code"] == "slo"
                assert metric(base, "tailserve_requests_rejected_total", {"reason": "slo"}) == 1
            else:
                assert factor == 1.0
                assert r.status_code == 200
                assert r.json()["tailserve_timings"]["admission_estimate_s"] == pytest.approx(0.04)


def test_a_held_request_is_priced_with_its_hold_and_refused_when_that_breaks_its_ttft() -> None:
    """A newcomer the TPOT price holds until a stream ends: its reported estimate and what the
    correction learns include the hold, and where the corrected TTFT runs past its target it is
    refused as `slo_tpot` (the TPOT price is why it would have to wait)."""
    clock = Clock()
    engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=1.0), wait_estimate_s=0.4)
    admission = admission_over(engine, clock)
    stream = StreamTpot(0.028, 0.028, 0.03)
    held = TpotPrice(0.02, 0.02, 0.03, (stream,), 0.5, hold_s=0.5, own_first_s=0.7)
    ticket = admission.admit(WaitQuote(10, 1.0, 0.4, 0.1, held))
    assert ticket.estimate_s == pytest.approx(0.7) and ticket.held_s == 0.5
    ticket.done()
    teach(admission, engine, clock, WaitCorrection.MIN_SAMPLES, actual_s=0.8)  # twice the prediction
    assert admission.correction.factor() == pytest.approx(2.0)
    with pytest.raises(RequestRejectedError) as refused:
        admission.admit(WaitQuote(10, 1.0, 0.4, 0.1, held))  # 0.7 s x 2: past the 1 s target
    assert refused.value.reason == "slo_tpot"
    assert "first token in 1.40s" in str(refused.value)
