"""Admission keeps its promise, decided in virtual time on a scripted engine (tests/server/virtual_serving.py):
the real scheduler, wait model and admission, steps priced by a cost model, no wall clock.

A request admitted with work queued ahead of it was promised its TTFT target: it must make it. One
with nothing ahead starts with the next step and is let in whatever its own prefill costs; its
estimate must say what that prefill costs (not 0), so a client reading `admission_estimate_s` and
the correction both see it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.config import SchedulerConfig
from tests.server.virtual_serving import Outcome, StepCost, VirtualServer

TTFT_S = 2.0


def _broken_promises(outcomes: list[Outcome]) -> list[Outcome]:
    """Admitted with work queued ahead, and then past the target."""
    return [o for o in outcomes if o.admitted and o.queued and o.missed(TTFT_S)]


def test_a_burst_of_long_prompts_on_a_fresh_server_admits_only_what_makes_its_target() -> None:
    """The probe of main: 30 prompts of ~2,000 tokens at once; 21 were admitted and waited up to
    50.9 s against estimates of at most 1.82 s. Each newcomer has every earlier one ahead."""
    server = VirtualServer(SchedulerConfig(slo_ttft_s=TTFT_S), StepCost())
    server.warm()
    outcomes = server.run([(10.0 + 0.01 * k, 2000, 64) for k in range(30)])
    admitted = [o for o in outcomes if o.admitted]
    assert 1 <= len(admitted) <= 2  # a 2,000-token prefill takes 1.5 s here: one fits in 2 s, not three
    assert not _broken_promises(outcomes)
    assert all(o.ttft_s is not None and o.ttft_s <= TTFT_S for o in admitted)
    assert all(o.estimate_s >= 0.9 * o.ttft_s for o in admitted if o.ttft_s is not None)


def test_newcomers_past_saving_on_a_server_whose_prompts_got_slow_are_priced_not_waved_in() -> None:
    """The probe of main on a server that had seen bursts: 60 of 60 admitted with an estimate of 0.0
    and waits of up to 127 s. A 2,000-token prompt whose own prefill is predicted past its target is
    past saving from arrival; pricing it as a savable newcomer (which never counts late work ahead)
    gave 0. Here prompts cost more per token the longer their context (attention), as they do."""
    server = VirtualServer(SchedulerConfig(slo_ttft_s=TTFT_S), StepCost(per_pair=0.4e-6))
    server.warm()
    rng = np.random.default_rng(1)
    bursts = [
        [(t0 + 0.002 * k, int(rng.integers(1800, 2100)), 64) for k in range(60)] for t0 in (10.0, 40.0, 70.0)
    ]
    for burst in bursts:
        outcomes = server.run(burst)
        admitted = [o for o in outcomes if o.admitted]
        assert len(admitted) <= 2
        assert not _broken_promises(outcomes)
        # What was let in alone was priced at its own prefill, never 0.
        assert all(o.estimate_s >= o.alone_s > 0.5 for o in admitted)


@pytest.mark.parametrize(("rate", "refused", "broken"), [(1.0, (0.0, 0.1), 0.01), (3.0, (0.2, 0.6), 0.03)])
def test_admitted_requests_make_their_target_under_poisson_load(
    rate: float, refused: tuple[float, float], broken: float
) -> None:
    """400 requests of 256-1,024 tokens at a load the engine nearly serves (1 req/s) and at about
    twice what it can (3 req/s): admission refuses what would miss, and of what it admits with work
    queued ahead at most 1% (3% at twice the capacity) then miss."""
    server = VirtualServer(SchedulerConfig(slo_ttft_s=TTFT_S), StepCost())
    server.warm()
    rng = np.random.default_rng(7)
    times = 10.0 + np.cumsum(rng.exponential(1 / rate, 400))
    prompts = rng.integers(256, 1025, 400)
    outcomes = server.run([(float(t), int(p), 48) for t, p in zip(times, prompts, strict=True)])
    admitted = [o for o in outcomes if o.admitted]
    low, high = refused
    assert low * len(outcomes) <= len(outcomes) - len(admitted) <= high * len(outcomes)
    assert len([o for o in admitted if o.queued]) >= 100  # the promises tested were real waits
    assert len(_broken_promises(outcomes)) <= broken * len(admitted)


# A CPU's steps: a decode step ~10 ms; a prompt step also pays a fixed part (each chunk widens the
# weights again), so 1,600 tokens take ~0.36 s in one step and ~0.46 s in seven 256-token steps
# (measured on the Sapphire Rapids VM: 318 and 412 ms).
CPU = StepCost(fixed=0.010, per_row=0.0005, prompt_fixed=0.006, per_token=0.00018, per_pair=4.7e-8)


def _quiet_spell(server: VirtualServer, rng: np.random.Generator) -> list[Outcome]:
    """A minute of ordinary load (prompts chunked beside decodes), then 20 long prompts, each alone
    on an idle engine: what the step timer and admission's correction learn from."""
    times = server.clock.now + 5 + np.cumsum(rng.exponential(1.0, 60))
    server.run([(float(t), int(p), 32) for t, p in zip(times, rng.integers(256, 1025, 60), strict=True)])
    lone = []
    for tokens in rng.integers(1200, 2049, 20):
        lone += server.run([(server.clock.now + 3, int(tokens), 8)])
    return lone


def test_a_prompt_alone_on_an_idle_engine_is_quoted_the_one_long_step_it_takes() -> None:
    """With nothing decoding, a prompt goes in one step of up to --prefill-step-tokens; its estimate
    (what a client reads as `admission_estimate_s`) says so. Priced in 256-token steps it was ~15%
    over here (+37% on the real engine: docs/notes/tail-under-slo.md)."""
    server = VirtualServer(SchedulerConfig(slo_ttft_s=1.0), CPU)
    server.warm()
    lone = _quiet_spell(server, np.random.default_rng(3))
    assert all(o.admitted and not o.queued and o.ttft_s is not None for o in lone)
    assert all(0.95 * o.ttft_s <= o.estimate_s <= 1.05 * o.ttft_s for o in lone if o.ttft_s is not None)


def test_long_prompts_alone_do_not_teach_admission_to_let_a_burst_miss() -> None:
    """Each lone long prompt teaches the correction its actual / predicted TTFT. Quoted ~15% long,
    they taught a factor of 0.87, and admission then let in a burst request predicted past its 1 s
    target (it took 1.04 s). Quoted the step they take, the factor stays ~1 and every request
    admitted with work ahead of it makes its target."""
    server = VirtualServer(SchedulerConfig(slo_ttft_s=1.0), CPU)
    server.warm()
    _quiet_spell(server, np.random.default_rng(3))
    assert server.admission.correction.factor() >= 0.95
    burst = server.run([(server.clock.now + 3 + 0.01 * k, 600, 32) for k in range(12)])
    admitted = [o for o in burst if o.admitted]
    assert len(admitted) >= 5  # not refusing everything: each 600-token prompt takes ~0.15 s
    assert not [o for o in admitted if o.queued and o.missed(1.0)]


# The chat-scaled lengths on a CPU-like engine whose decode rows also read their context's KV (1.5 ms
# a step per thousand context tokens, as measured on two threads: engine/stats.py DecodeFit).
CHAT = StepCost(
    fixed=0.010, per_row=0.0003, prompt_fixed=0.006, per_token=0.00018, per_pair=4.7e-8, per_context=1.5e-6
)
TPOT_S = 0.03


def _chat_load(tpot: bool, hold: bool = True) -> list[Outcome]:
    """400 chat-scaled requests (prompts of 512-2,048 tokens, 64-256 out) at Poisson 0.8 req/s,
    under the chat SLA's targets (2 s TTFT, 30 ms TPOT). `hold`: --admission-hold."""
    config = SchedulerConfig(slo_ttft_s=TTFT_S, slo_tpot_s=TPOT_S, admission_hold=hold)
    server = VirtualServer(config, CHAT, tpot=tpot)
    server.warm()
    rng = np.random.default_rng(5)
    n = 400
    times = 10.0 + np.cumsum(rng.exponential(1 / 0.8, n))
    prompts, outputs = rng.integers(512, 2049, n), rng.integers(64, 257, n)
    return server.run([(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)])


def _met(o: Outcome) -> bool:
    """Admitted, and within both targets."""
    return o.admitted and not o.missed(TTFT_S) and o.tpot_s is not None and o.tpot_s <= TPOT_S


def _tpot_misses(outcomes: list[Outcome]) -> list[float]:
    return [o.tpot_s for o in outcomes if o.admitted and o.tpot_s is not None and o.tpot_s > TPOT_S]


def test_admission_priced_on_tpot_keeps_the_streams_within_their_target() -> None:
    """Priced on TTFT alone, admission let in requests whose streams then ran past the 30 ms TPOT
    target (25% of them here, by up to 1.28x; 55% on the served engine). With the TPOT price, a
    newcomer that would push a stream over its target is refused: at most 3% of the admitted miss,
    by 10% on average (the policy lends a stream's room under its target to prefill, so streams
    end near it), and more requests meet both targets than before, despite the extra refusals."""
    ttft_only, priced = _chat_load(tpot=False), _chat_load(tpot=True, hold=False)
    admitted = [o for o in priced if o.admitted]
    misses = _tpot_misses(priced)
    assert len(_tpot_misses(ttft_only)) >= 0.15 * len([o for o in ttft_only if o.admitted])
    assert max(o.tpot_s or 0.0 for o in ttft_only) > 1.2 * TPOT_S
    assert len(misses) <= 0.03 * len(admitted)
    assert sum(misses) <= 1.1 * TPOT_S * len(misses)
    assert sum(map(_met, priced)) >= 1.1 * sum(map(_met, ttft_only))


def test_a_newcomer_held_until_a_stream_ends_is_not_refused() -> None:
    """Where a newcomer's prompt would push a stream over its TPOT target now but not once a stream
    has ended, and its first token still comes within its TTFT target so, admission holds it in the
    queue instead of refusing it (--admission-hold, the default): fewer refusals than refusing it
    (67 of 400 here, against 77; 54 against 67 before the price counted arrivals still to come),
    misses still at most 3% of the admitted, the held ones within their TTFT target, and more
    requests within both targets."""
    refusing, holding = _chat_load(tpot=True, hold=False), _chat_load(tpot=True)
    held = [o for o in holding if o.held]
    admitted = [o for o in holding if o.admitted]
    assert len(held) >= 10
    assert len(admitted) > len([o for o in refusing if o.admitted])
    assert not [o for o in held if o.missed(TTFT_S)]
    assert len(_tpot_misses(holding)) <= 0.03 * len(admitted)
    assert sum(map(_met, holding)) > sum(map(_met, refusing))
