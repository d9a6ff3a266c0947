"""Prompt-row kernels created before serving: none compiles (nor takes memory) while serving.

The engine tests run in fresh interpreters with oneDNN's creation log on (ONEDNN_VERBOSE), so the
primitive cache and its capacity are their own, as in a server process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tailserve.executor import warmup
from tailserve.kernels import onednn
from tailserve.model.linear import Linear, WeightSource

pytestmark = pytest.mark.skipif(
    not onednn.bf16_packs(),
    reason="torch's oneDNN has no bf16 kernels on this CPU (or none at all): prompt rows run on F.linear",
)

# Serves prompts whose chunks reach many row counts of a 200-token budget, after an optional warm-up;
# the last line says how many kernels the warm-up made. Prompts longer than the budget are chunked.
ENGINE = """
import json, random, sys
from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
config = EngineConfig(
    model=ModelConfig(model="dummy:tiny", weight_format="int4"),
    cache=CacheConfig(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False),
    scheduler=SchedulerConfig(max_num_batched_tokens=200, max_num_seqs=8, policy="fcfs"),
)
engine = LLMEngine(config)
warmed = engine.warm_kernels() if sys.argv[1] == "warm" else None
print("SERVING", flush=True)
rng = random.Random(5)
for i in range(60):
    ids = [rng.randrange(3, 200) for _ in range(rng.randint(2, 260))]
    engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    if i % 3 == 2:  # a few at a time: steps mix prompt chunks of several lengths
        while engine.has_unfinished():
            engine.step()
while engine.has_unfinished():
    engine.step()
print(json.dumps({"shapes": warmed.shapes if warmed else 0, "max_rows": warmed.max_rows if warmed else 0}))
"""


def _serve(mode: str) -> tuple[dict[str, int], int]:
    """Run ENGINE; returns its last line and the prompt-row kernels oneDNN created while serving."""
    env = {k: v for k, v in os.environ.items() if k != onednn.CAPACITY_ENV}
    env["ONEDNN_VERBOSE"] = "profile_create"
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    serving = out.stdout.split("SERVING", 1)[1]
    created = sum("create:cache_miss,cpu,inner_product" in line for line in serving.splitlines())
    result: dict[str, int] = json.loads(serving.strip().splitlines()[-1])
    return result, created


def test_after_the_kernel_warm_up_serving_any_prompt_length_creates_no_kernel() -> None:
    warm, created_warm = _serve("warm")
    if warm["shapes"] == 0:
        pytest.skip("the fused CPU kernels do not build here: no prompt row runs through oneDNN")
    assert warm == {"shapes": 4, "max_rows": 200}
    assert created_warm == 0
    # The same requests without it: each new row count compiles its kernels mid-step (and keeps them).
    _, created_cold = _serve("cold")
    assert created_cold >= 4 * 20


def _bf16_linear(n: int, k: int, seed: int) -> Linear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    layer = Linear(WeightSource(w), None, "bf16", "bf16")
    layer.pack_for_cpu()
    assert layer.onednn is not None
    return layer


def test_warm_up_covers_each_weight_shape_once_and_stops_where_the_cache_would_evict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layers = [_bf16_linear(64, 32, 1), _bf16_linear(64, 32, 2), _bf16_linear(48, 32, 3)]  # two shapes
    done = warmup.warm_prompt_rows(layers, budget_tokens=40, capacity=4096)
    assert (done.shapes, done.max_rows) == (2, 40)
    room = onednn.CACHE_HEADROOM + onednn.ENTRIES_PER_KERNEL * 2 * 9  # nine row counts of two shapes
    with caplog.at_level(logging.WARNING, logger="tailserve.kernels.onednn"):
        short = warmup.warm_prompt_rows(layers, budget_tokens=40, capacity=room)
    assert short.max_rows == 10
    assert "up to 10 rows of a 40-token step budget" in caplog.text
    # Nothing packed for oneDNN (fp32 layers): nothing to warm.
    fp32 = Linear(WeightSource(torch.randn(8, 8)), None, "fp32", "fp32")
    assert warmup.warm_prompt_rows([fp32], budget_tokens=40, capacity=4096).shapes == 0


def test_cache_reservation_sizes_for_the_budget_and_leaves_a_set_capacity_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(onednn.CAPACITY_ENV, raising=False)
    want = onednn.cache_entries_for(256)
    assert want == onednn.ENTRIES_PER_KERNEL * 4 * 255 + onednn.CACHE_HEADROOM
    assert onednn.reserve_cache(want) == want
    assert os.environ[onednn.CAPACITY_ENV] == str(want)
    assert onednn.reserve_cache(10 * want) == want  # oneDNN read it already: a later ask changes nothing
    monkeypatch.delenv(onednn.CAPACITY_ENV)
    assert onednn.reserve_cache(16) == onednn.DEFAULT_CAPACITY  # never below oneDNN's own default
    monkeypatch.setenv(onednn.CAPACITY_ENV, "300")  # the user's value wins
    assert onednn.reserve_cache(want) == 300
    monkeypatch.setenv(onednn.CAPACITY_ENV, "lots")
    assert onednn.reserve_cache(want) == onednn.DEFAULT_CAPACITY
    # Budgets past MAX_WARM_ROWS are sized for what the warm-up creates, not the budget.
    assert onednn.cache_entries_for(4096) == onednn.cache_entries_for(onednn.MAX_WARM_ROWS)
