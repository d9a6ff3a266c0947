"""Random arrivals, shared prefixes, aborts and a tiny KV pool: every request ends, nothing stalls,
every block comes back (dummy tiny model, so hundreds of steps run in seconds)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLMEngine
from tests.engine.random_workload import drive_random_workload

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
    finished = drive_random_workload(
        engine,
        random.Random(seed),
        24,
        last_arrival_step=40,
        max_tokens=30,
        abort_share=0.15,
        abort_every=(7, 3),
    )
    assert len(finished) == 24
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
