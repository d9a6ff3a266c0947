"""Capacity arithmetic checked against hand computation (SPEC.md, "Capacity arithmetic")."""

from __future__ import annotations

import math

import pytest

from tailserve.plan.capacity import PlanRequest, make_plan
from tailserve.plan.catalog import GIB, GpuCatalog
from tailserve.plan.errors import PlanError
from tailserve.plan.shapes import ModelShape, find_preset

CATALOG = GpuCatalog()


def preset(name: str) -> ModelShape:
    shape = find_preset(name)
    assert shape is not None, name
    return shape


def test_llama_3_70b_fp16_weights_and_kv_per_token() -> None:
    plan = make_plan(PlanRequest(preset("Llama-3-70B"), CATALOG.get("H200"), dtype="fp16"))
    assert plan.weight_bytes == 70_553_706_496 * 2
    assert plan.weight_bytes / 1e9 == pytest.approx(141, abs=0.5)
    assert plan.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # ~0.33 MB with 8 KV heads
    assert plan.kv_bytes_per_token / 1e6 == pytest.approx(0.33, abs=0.005)
    assert plan.kv_bytes_per_token_hidden_formula == 2 * 80 * 8192 * 2  # ~2.6 MB, 8x too much
    assert plan.kv_bytes_per_token_hidden_formula / 1e6 == pytest.approx(2.6, abs=0.05)


def test_llama_3_1_8b_on_h200_decode_floor() -> None:
    plan = make_plan(
        PlanRequest(preset("Llama-3.1-8B"), CATALOG.get("H200"), dtype="bf16", context_tokens=4096)
    )
    floor = plan.floor_batch1
    assert 3.4e-3 <= floor.step_s <= 3.8e-3
    by_hand = (8_030_261_248 * 2 + 4096 * (2 * 32 * 8 * 128 * 2)) / 4800e9
    assert floor.step_s == pytest.approx(by_hand, rel=1e-9)
    assert floor.bound == "memory"
    assert floor.tokens_per_s_per_stream == pytest.approx(1 / by_hand)


# (preset, gpu, dtype) covering each preset; every figure is recomputed below from the shapes.
CASES = [
    ("Llama-3.1-8B", "A100 80GB", "bf16"),
    ("Llama-3-70B", "H200", "fp8"),
    ("Qwen2.5-7B", "RTX 3090", "fp16"),
    ("Qwen2.5-72B", "H100", "int4"),
    ("SmolLM2-135M", "T4", "fp16"),
]
BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 128}


def _hand_params(s: ModelShape) -> tuple[int, int]:
    """(layer matrices, everything kept 16-bit) counted by hand."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    matrices = s.num_layers * (
        2 * s.hidden_size * q + 2 * s.hidden_size * kv + 3 * s.hidden_size * s.intermediate_size
    )
    bias = (q + 2 * kv) if s.qkv_bias else 0
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    kept = embeddings + s.num_layers * (2 * s.hidden_size + bias) + s.hidden_size
    return matrices, kept


@pytest.mark.parametrize(("model", "gpu_name", "dtype"), CASES)
def test_every_number_matches_hand_computation(model: str, gpu_name: str, dtype: str) -> None:
    shape, gpu = preset(model), CATALOG.get(gpu_name)
    context, concurrency = 2048, 16
    plan = make_plan(PlanRequest(shape, gpu, dtype=dtype, context_tokens=context, concurrency=concurrency))
    matrices, kept = _hand_params(shape)
    weights = math.ceil(matrices * BYTES[dtype] + kept * 2)
    kv_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    usable = int(gpu.memory_gib * GIB * 0.9)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    activations = (
        math.ceil(
            2048 * (2 * shape.hidden_size + q + 2 * kv + 3 * shape.intermediate_size) * 2
            + 2 * concurrency * shape.vocab_size * 4
        )
        + GIB
    )
    pool = usable - weights - activations
    max_concurrency = max(pool, 0) // kv_token // context
    floor_c = (weights + concurrency * context * kv_token) / (gpu.bandwidth_gb_s * 1e9)

    assert plan.weight_bytes == weights
    assert plan.kv_bytes_per_token == kv_token
    assert plan.activation_bytes_per_gpu == activations
    assert plan.kv_pool_bytes_per_gpu == pool
    assert plan.max_concurrency == max_concurrency
    assert plan.fits == (max_concurrency >= 1)
    assert plan.floor_at_concurrency.memory_s == pytest.approx(floor_c, rel=1e-9)
    assert plan.floor_batch1.memory_s < plan.floor_at_concurrency.memory_s


def test_seventy_b_does_not_fit_one_a100_but_fits_four() -> None:
    shape, a100 = preset("Llama-3-70B"), CATALOG.get("A100 80GB")
    one = make_plan(PlanRequest(shape, a100, dtype="fp16"))
    assert not one.fits and one.kv_pool_bytes_per_gpu < 0 and one.max_concurrency == 0
    four = make_plan(PlanRequest(shape, a100, num_gpus=4, dtype="fp16"))
    assert four.fits
    assert four.weight_bytes_per_gpu == pytest.approx(one.weight_bytes / 4, rel=1e-3)
    assert four.kv_bytes_per_token_per_gpu == four.kv_bytes_per_token // 4  # 8 KV heads split 2 per GPU
    assert four.floor_batch1.memory_s == pytest.approx(one.floor_batch1.memory_s / 4, rel=2e-3)


def test_more_gpus_than_kv_heads_replicates_heads() -> None:
    plan = make_plan(PlanRequest(preset("Llama-3.1-8B"), CATALOG.get("H100"), num_gpus=16))
    assert plan.kv_bytes_per_token_per_gpu == 2 * 32 * 1 * 128 * 2  # 8 KV heads over 16 GPUs: one each
    assert any("replica" in note for note in plan.notes)
    assert any("KV heads replicated: each KV head on 2 ranks" in note for note in plan.notes)


def test_slo_verdict_and_largest_batch_within_it() -> None:
    shape, t4 = preset("Llama-3.1-8B"), CATALOG.get("T4")
    # int8 weights (9 GB) plus 8k tokens of KV, read at 320 GB/s: over 30 ms even for one request.
    slow = make_plan(PlanRequest(shape, t4, dtype="int8", context_tokens=8192, concurrency=2))
    assert slow.fits and slow.floor_batch1.step_s > 0.030 and not slow.meets_slo
    assert slow.max_batch_within_slo == 0
    fast = make_plan(PlanRequest(shape, CATALOG.get("H200"), context_tokens=4096, concurrency=32))
    assert fast.meets_slo
    limit = fast.max_batch_within_slo
    assert 32 <= limit <= fast.max_concurrency
    if limit < fast.max_concurrency:  # the next batch size would break the SLO
        over = make_plan(PlanRequest(shape, CATALOG.get("H200"), context_tokens=4096, concurrency=limit + 1))
        assert over.floor_at_concurrency.step_s > 0.030


def test_fp8_on_ampere_is_weight_only_and_noted() -> None:
    plan = make_plan(PlanRequest(preset("Llama-3.1-8B"), CATALOG.get("A100 80GB"), dtype="fp8"))
    assert (
        plan.weight_bytes
        < make_plan(PlanRequest(preset("Llama-3.1-8B"), CATALOG.get("A100 80GB"))).weight_bytes
    )
    assert any("no fp8 tensor cores" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp4"}, "unknown dtype"),
        ({"num_gpus": 0}, "num_gpus must be at least 1"),
        ({"context_tokens": 0}, "context_tokens"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_request_is_a_clear_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        PlanRequest(preset("SmolLM2-135M"), CATALOG.get("T4"), **kwargs)  # type: ignore[arg-type]
