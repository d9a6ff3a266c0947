"""Random arrivals, shared prefixes, aborts and a tiny KV pool: every request ends, nothing stalls,
every block comes back (dummy tiny model, so hundreds of steps run in seconds)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLMEngine, SamplingParams

BLOCK_BYTES = (
    2 * 2 * 2 * 16 * 4 * 16
)  # tiny preset: K+V x 2 layers x 2 kv heads x 16-dim heads x fp32 x 16 tokens


def _engine(num_blocks: int, policy: str, budget: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model="dummy:tiny", device="cpu", dtype="float32", max_model_len=512),
            cache=CacheConfig(kv_cache_memory_bytes=num_blocks * BLOCK_BYTES),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, policy=policy),
        )
    )


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 40), budget=st.sampled_from([16, 48, 128]))
def test_everything_finishes_and_blocks_return(policy: str, seed: int, num_blocks: int, budget: int) -> None:
    engine = _engine(num_blocks, policy, budget)
    assert engine.stats().kv_blocks_total == num_blocks
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    pending = []
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 1.0]), seed=i)
        pending.append((rng.randrange(0, 40), f"r{i}", prompt, params))
    pending.sort(key=lambda p: p[0])
    finished: dict[str, str] = {}
    aborted = {f"r{i}" for i in range(24) if rng.random() < 0.15}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if step % 7 == 3 and aborted:
            rid = aborted.pop()
            out = engine.abort(rid)
            if out is not None:
                finished[rid] = "abort"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
        step += 1
        assert step < 5000, f"stalled: {engine.stats()}"
    assert len(finished) == 24
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
