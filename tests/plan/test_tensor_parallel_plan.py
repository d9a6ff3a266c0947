"""`tailserve plan --gpus N` under tensor parallelism: the runtime's split rule, all-reduce bytes per
step, and the warning when the model fits one GPU and communication would eat the step."""

from __future__ import annotations

import pytest

from tailserve.errors import ConfigError
from tailserve.model.sharding import check_shardable
from tailserve.model.tp_split import allreduce_bytes_per_token, tensor_parallel_split
from tailserve.plan.capacity import PlanRequest, make_plan
from tailserve.plan.catalog import GpuCatalog
from tailserve.plan.errors import PlanError
from tailserve.plan.shapes import ModelShape
from tailserve.plan.shapes import find_preset as preset
from tailserve.weights.arch import preset as runtime_preset

CATALOG = GpuCatalog()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "per_rank", "replicated", "kv_of_ranks"),
    [
        (9, 3, 3, 1, False, [0, 1, 2]),  # SmolLM2 at TP=3: one KV head each
        (14, 2, 2, 1, False, [0, 1]),  # Qwen2.5-0.5B at TP=2
        (8, 2, 4, 1, True, [0, 0, 1, 1]),  # fewer KV heads than ranks: each on 2 ranks
        (32, 8, 4, 2, False, [0, 2, 4, 6]),
    ],
)
def test_split_rule(
    heads: int, kv_heads: int, size: int, per_rank: int, replicated: bool, kv_of_ranks: list[int]
) -> None:
    split = tensor_parallel_split(heads, kv_heads, size)
    assert (split.kv_heads_per_rank, split.kv_replicated) == (per_rank, replicated)
    assert [split.kv_heads(r).start for r in range(size)] == kv_of_ranks
    # Every query head of a rank reads a KV head that rank holds (groups of heads // kv_heads).
    group = heads // kv_heads
    for r in range(size):
        assert {h // group for h in split.heads(r)} <= set(split.kv_heads(r))


def test_plan_and_server_refuse_the_same_sizes() -> None:
    with pytest.raises(
        PlanError, match="--gpus 2 does not divide the model's 9 query heads; use one of 1, 3, 9"
    ):
        PlanRequest(preset("SmolLM2-135M"), CATALOG.get("H100"), num_gpus=2)
    with pytest.raises(
        ConfigError, match="--tensor-parallel-size 2 does not divide the model's 9 query heads"
    ):
        check_shardable(runtime_preset("smollm2-135m"), 2, "fp32")
    twelve_by_four = ModelShape("12x4", 2, 768, 12, 4, 64, 1024, 1000, True, 2048)
    with pytest.raises(PlanError, match="--gpus 6 neither divides the model's 4 KV heads nor is a multiple"):
        PlanRequest(twelve_by_four, CATALOG.get("H100"), num_gpus=6)


def test_allreduce_bytes_and_share_in_the_plan() -> None:
    shape = preset("Llama-3-70B")
    plan = make_plan(PlanRequest(shape, CATALOG.get("A100 80GB"), num_gpus=4, dtype="fp16", concurrency=32))
    ar = plan.allreduce
    assert ar is not None and ar.batch == 32 and ar.collectives == 2 * 80 + 1
    # (2 x 80 + 1) hidden-wide fp16 rows per token, a ring sends 2 (N-1)/N of each.
    assert ar.bytes_per_gpu == 32 * 161 * 8192 * 2 * 2 * 3 // 4
    assert ar.bytes_per_gpu == 32 * allreduce_bytes_per_token(80, 8192, 4, 2)
    assert 0 < ar.share < 1 and not ar.fits_one_gpu
    assert not any(n.startswith("warning") for n in plan.notes)  # needs 4 GPUs: TP is the point
    assert make_plan(PlanRequest(shape, CATALOG.get("A100 80GB"), dtype="fp16")).allreduce is None


def test_warning_when_a_small_model_would_mostly_communicate() -> None:
    plan = make_plan(PlanRequest(preset("SmolLM2-135M"), CATALOG.get("H100"), num_gpus=3, concurrency=4))
    assert plan.allreduce is not None and plan.allreduce.fits_one_gpu and plan.allreduce.share > 0.2
    assert any(n.startswith("warning: the model fits one H100") for n in plan.notes)
