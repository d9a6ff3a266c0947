"""The loading thread's OpenMP workers exit when the steps move to another thread.

Each runs in a fresh interpreter with two torch threads, so the pools it counts are its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tailserve.kernels import openmp

pytestmark = pytest.mark.skipif(
    openmp._libgomp() is None, reason="torch here runs on another OpenMP runtime than libgomp"
)

# Thread ids of the process, and a helper that waits for exiting ones to leave /proc.
PRELUDE = """
import json, os, time, torch
torch.set_num_threads(2)
def tasks():
    return set(os.listdir("/proc/self/task"))
def settled(want):
    for _ in range(100):
        now = tasks()
        if now <= want:
            return now
        time.sleep(0.02)
    return tasks()
def parallel_op():
    x = torch.arange(1 << 22, dtype=torch.float64)
    return float(x.mul_(2).sum()) == (1 << 22) * ((1 << 22) - 1)  # above torch's grain: OpenMP
"""


def _run(body: str) -> dict[str, int | bool]:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, int | bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_release_pool_lets_the_calling_threads_workers_exit_and_work_goes_on() -> None:
    result = _run(
        """
from tailserve.kernels import openmp
before = tasks()
parallel_op()
with_pool = tasks()
released = openmp.release_pool()
after = settled(before)
value = parallel_op()  # a new pool on demand: still computes
print(json.dumps({"started": len(with_pool - before), "released": released,
                  "left": len(after - before), "value": value}))
"""
    )
    assert result["started"] == 1  # two threads: the caller and one worker
    assert result["released"] is True
    assert result["left"] == 0
    assert result["value"] is True


def test_async_engine_start_releases_the_loading_threads_pool() -> None:
    """The model loads (and computes) on the main thread; once the engine thread serves, no worker
    of the main thread's pool is left, only the engine thread's own."""
    result = _run(
        """
import asyncio
from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine, SamplingParams
before = tasks()
engine = AsyncEngine(EngineConfig(
    model=ModelConfig(model="dummy:tiny", device="cpu", num_threads=2, max_model_len=256),
    cache=CacheConfig(kv_cache_memory_bytes=8 << 20),
    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
parallel_op()
loaded = tasks() - before
async def main():
    await engine.start()
    texts = []
    async for out in engine.generate("r", list(range(10, 60)), SamplingParams(max_tokens=4, temperature=0.0)):
        texts.append(out.new_text)
    await engine.shutdown()
    return len(texts)
tokens = asyncio.run(main())
print(json.dumps({"loaded": len(loaded), "left": len(loaded & settled(before)), "tokens": tokens}))
"""
    )
    assert result["loaded"] >= 1  # loading started the main thread's pool
    assert result["left"] == 0
    assert result["tokens"] == 4
