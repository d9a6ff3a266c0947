"""`--pace-slowdown`: while streams decode, `slo` prefills a prompt only as fast as it needs to have
its first token by G x its idle prefill time. The steps stay short (even token gaps), the prompt
still makes its due time, tokens do not change, and pacing never holds back a prompt that is late."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLMEngine, SamplingParams
from tailserve.engine.policy import FcfsPolicy, PrefillOrder, SloPolicy
from tailserve.engine.request import Request, RequestTimings
from tailserve.engine.stats import StepTimer
from tailserve.errors import ConfigError

NOW = 1000.0
DECODE_S = 0.010  # the step-time model the policy is given: a decode step and a prompt token's price
TOKEN_S = 0.0005


@dataclass
class Plan:
    num_tokens: int
    num_prefill_tokens: int


def _timer() -> StepTimer:
    timer = StepTimer(budget_tokens=256)
    timer.record(Plan(4, 0), DECODE_S)
    timer.record(Plan(204, 200), DECODE_S + 200 * TOKEN_S)
    assert timer.coefficients() == pytest.approx((DECODE_S, TOKEN_S))
    return timer


def _policy(pace: float = 2.0, ttft_s: float = 2.0) -> SloPolicy:
    config = SchedulerConfig(policy="slo", slo_ttft_s=ttft_s, slo_tpot_s=0.1, pace_slowdown=pace)
    return SloPolicy(config, _timer(), block_size=16)


def _waiting(tokens: int, waited_s: float = 0.0, seq_no: int = 0) -> Request:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return Request(f"w{seq_no}", [3] * tokens, params, RequestTimings(arrival=NOW - waited_s), seq_no=seq_no)


def _stream() -> Request:
    req = _waiting(4, waited_s=1.0, seq_no=99)
    req.token_ids += [5, 6]
    req.timings.first_token = NOW - 0.5
    return req


def _finish_s(tokens: int, per_step: int) -> float:
    """When `tokens` prompt tokens are done at `per_step` a step, under the policy's step-time model."""
    steps = math.ceil(tokens / per_step)
    return steps * DECODE_S + tokens * TOKEN_S


def test_a_long_prompt_is_spread_over_short_steps_and_still_makes_its_due_time() -> None:
    slo = _policy()
    long = _waiting(400)
    # Idle, its 400 tokens take 2 steps + 400 x 0.5 ms = 0.22 s; paced to 2x that, it is due in 0.44 s.
    assert slo.paced_ttft_s(400, 2.0) == pytest.approx(0.44)
    cap = slo.pace_cap(PrefillOrder([long], []), [_stream()], 240, NOW)
    assert cap < 240 / 4  # a short step instead of a whole budget of prompt tokens
    assert _finish_s(400, cap) <= 0.44  # and the prompt still has its first token by its due time
    assert _finish_s(400, cap - 8) > 0.44 - DECODE_S  # not much slower than it needs
    # A short prompt queued ahead of it (shortest first) raises what this step must carry.
    short = _waiting(60, seq_no=1)
    assert slo.pace_cap(PrefillOrder([short, long], []), [_stream()], 240, NOW) > cap
    # As it waits, its due time comes closer and the steps carry more; once it cannot make the
    # due time at all, it gets the whole cap.
    assert cap < slo.pace_cap(PrefillOrder([_waiting(400, waited_s=0.15)], []), [_stream()], 240, NOW) < 240
    assert slo.pace_cap(PrefillOrder([_waiting(400, waited_s=0.3)], []), [_stream()], 240, NOW) == 240


def test_pacing_never_holds_back_what_is_late_or_has_no_stream_to_protect() -> None:
    slo = _policy()
    order = PrefillOrder([_waiting(400)], [])
    assert slo.pace_cap(order, [], 240, NOW) == 240  # no decodes: nothing to keep short
    late = PrefillOrder([_waiting(400)], [_waiting(900, waited_s=5.0, seq_no=2)])
    assert slo.pace_cap(late, [_stream()], 240, NOW) == 240  # a request past saving waits
    resumed = _stream()  # preempted while it streamed, prefilling again
    assert slo.pace_cap(PrefillOrder([resumed], []), [_stream()], 240, NOW) == 240
    assert _policy(pace=0).pace_cap(order, [_stream()], 240, NOW) == 240  # off
    assert _policy(pace=0).paced_ttft_s(400, 2.0) == 0.0
    assert FcfsPolicy().pace_cap(order, [_stream()], 240, NOW) == 240
    # The due time stays inside the target, before the prompt turns urgent (0.75 x 0.5 s here).
    assert _policy(ttft_s=0.5).paced_ttft_s(400, 0.5) == pytest.approx(0.375)
    # No step-time model yet: no pacing.
    fresh = SloPolicy(SchedulerConfig(policy="slo", pace_slowdown=2.0), StepTimer(), block_size=16)
    assert fresh.pace_cap(order, [_stream()], 240, NOW) == 240


def test_pace_slowdown_must_be_off_or_at_least_one() -> None:
    with pytest.raises(ConfigError, match="--pace-slowdown"):
        SchedulerConfig(pace_slowdown=0.5)
    with pytest.raises(ConfigError, match="--pace-slowdown"):
        SchedulerConfig(pace_slowdown=-1)


def _run(pace: float) -> tuple[dict[str, list[int]], list[tuple[int, int]], int]:
    """Two streams decode; a 400-token prompt lands. The engine's step timer is fed a fixed cost
    model (decode 100 ms, 2 ms a prompt token) so the schedule does not depend on this machine's
    speed. (tokens per request, (decodes, prompt tokens) per step, the step of the long one's first token)."""
    config = EngineConfig(
        model=ModelConfig(model="dummy:tiny", device="cpu"),
        cache=CacheConfig(kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=128, policy="slo", slo_ttft_s=100.0, slo_tpot_s=10.0, pace_slowdown=pace
        ),
    )
    engine = LLMEngine(config)
    timer = engine.scheduler.timer
    record = timer.record

    def modelled(plan: Any, seconds: float) -> None:
        record(plan, 0.1 + 0.002 * plan.num_prefill_tokens)

    timer.record = modelled  # type: ignore[method-assign]
    stream = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [11, 12, 13], stream)
    engine.add_request("b", [14, 15, 16], stream)
    for _ in range(3):
        engine.step()
    timer.record(Plan(98, 96), 0.0)  # a prompt token's price, as a step with a prompt would teach it
    engine.add_request("long", [(7 * i) % 200 + 20 for i in range(400)], SamplingParams(max_tokens=4, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[int, int]] = []
    first = -1
    while engine.has_unfinished():
        outs = engine.step()
        plan = engine.last_plan
        assert plan is not None
        steps.append((plan.num_decodes, plan.num_prefill_tokens))
        for out in outs:
            if out.request_id == "long" and first < 0:
                first = len(steps)
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return tokens, steps, first


def test_paced_engine_keeps_steps_short_beside_streams_with_the_same_tokens() -> None:
    fast_tokens, fast_steps, _ = _run(pace=0)
    paced_tokens, paced_steps, paced_first = _run(pace=2.0)
    assert paced_tokens == fast_tokens  # pacing changes when, never what
    assert paced_first > 0  # the long prompt got its first token while the streams ran
    fast_chunk = max(p for d, p in fast_steps if d)
    paced_chunk = max(p for d, p in paced_steps if d)
    assert fast_chunk == 128 - 2  # unpaced, a step beside the two streams takes the whole budget
    assert paced_chunk <= fast_chunk / 2  # paced: the 400 tokens go in small pieces
