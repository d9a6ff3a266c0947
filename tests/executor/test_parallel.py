"""Tensor parallelism over gloo on CPU: ranks are real processes, and TP=N equals TP=1.

Logits are compared for a prefill, a chunked prefill, a decode step of two unequal sequences and a
prefix-cache hit, then greedy generations token for token (int4 / bf16: up to the first near tie).
fp32 is not bit-exact across sizes (the all-reduce sums the partial products in another order): the
measured gap is ~1e-6, asserted 1e-4.
"""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLMEngine, SamplingParams
from tailserve.engine.llm import LLM
from tailserve.engine.request import RequestOutput
from tailserve.errors import ConfigError
from tailserve.executor.parallel import TensorParallel
from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.sampler import SamplingSpec
from tailserve.model.sharding import check_shardable, shard_int4
from tailserve.weights.formats import Int4Groups, pack_amx_int4, pack_int4
from tailserve.weights.loader import LoadedModel, load_model, read_arch
from tests.engine.random_workload import drive_random_workload

FP32_ATOL = 1e-4
BF16_ATOL = 0.05  # int4 weights, bf16 activations: each rank rounds its partial sum to bf16 once


def _llm(model: str, size: int, weight_format: str = "fp32", loaded: LoadedModel | None = None) -> LLM:
    return LLM(
        loaded=loaded,
        config=EngineConfig(
            model=ModelConfig(
                model=model,
                weight_format=weight_format,
                device="cpu",
                max_model_len=256,
                num_threads=1,
                tensor_parallel_size=size,
            ),
            cache=CacheConfig(kv_cache_memory_bytes=16 << 20, block_size=16),
            scheduler=SchedulerConfig(),
        ),
    )


def _chunk(ids: list[int], start: int, table: list[int], decode: bool = False) -> SeqChunk:
    return SeqChunk(ids, start, table, sample=True, sampling=SamplingSpec(temperature=0.0), decode=decode)


def _scenario(runner: ModelRunner, vocab: int) -> list[torch.Tensor]:
    """Teacher-forced logits of the four kinds of step, on blocks 0-4 of a fresh pool."""
    rng = random.Random(0)
    a = [rng.randrange(3, vocab) for _ in range(21)]
    b = [rng.randrange(3, vocab) for _ in range(25)]
    return [
        runner.logits_for([_chunk(a, 0, [0, 1])]),  # prefill
        runner.logits_for([_chunk(b[:10], 0, [2, 3])]),  # chunked prefill: first chunk
        runner.logits_for([_chunk(b[10:], 10, [2, 3])]),  # ... and the rest over its cached prefix
        runner.logits_for(  # decode: two sequences of unequal length in one step
            [_chunk([5], 21, [0, 1], decode=True), _chunk([7], 25, [2, 3], decode=True)]
        ),
        runner.logits_for([_chunk(a[16:] + [9, 10], 16, [0, 4])]),  # prefix-cache hit on a's block 0
    ]


PROMPTS = [
    [1, 17, 33, 90, 4, 250],
    [1, 300, 12],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]


def _greedy(llm: LLM) -> list[RequestOutput]:
    """Greedy generations of PROMPTS with each step's two best log-probabilities (the tie margin)."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params)


def _assert_equal_until_a_near_tie(got: list[RequestOutput], want: list[RequestOutput], tie: float) -> None:
    """Greedy tokens of TP=N equal TP=1's, and their log-probabilities agree, up to the first step
    where the reference's best two tokens are within `tie` of each other: there a partial sum rounded
    differently may pick either, and the generations go separate ways after it (an int4 / bf16 model
    is not token-exact across TP sizes; docs/ENGINE.md)."""
    for prompt, (g, w) in enumerate(zip(got, want, strict=True)):
        for step, (gt, wt) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            best, second = wt.top[0][1], wt.top[1][1]
            if gt.token_id != wt.token_id:
                assert best - second <= tie, (
                    f"prompt {prompt} step {step}: TP=N chose {gt.token_id}, TP=1 {wt.token_id} "
                    f"with a margin of {best - second:.4f} (> {tie}): not a near tie"
                )
                break
            assert abs(gt.logprob - wt.logprob) <= 5 * tie, (prompt, step, gt.logprob, wt.logprob)


def _compare(
    model: str, size: int, weight_format: str, atol: float, loaded: LoadedModel | None = None
) -> None:
    """TP=size against TP=1: the scenario's logits within `atol`, same argmax; greedy tokens equal
    where the format is fp32; in bf16 / int4 equal up to the first near tie."""
    ref = _llm(model, 1, weight_format, loaded)
    vocab = ref.engine.arch.vocab_size
    want_logits, want_tokens = _scenario(ref.engine.runner, vocab), _greedy(ref)
    tp = _llm(model, size, weight_format)
    try:
        got_logits, got_tokens = _scenario(tp.engine.runner, vocab), _greedy(tp)
    finally:
        tp.close()
    for step, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert got.shape == want.shape == (want.shape[0], vocab)
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
        # The same top token, except on a near tie (random dummy weights have some): where the
        # reference's best two are within a fifth of the tolerance, rounding may pick either.
        top2 = want.topk(2, dim=-1).values
        differ = got.argmax(-1) != want.argmax(-1)
        tie = top2[:, 0] - top2[:, 1] <= atol / 5
        assert not (differ & ~tie).any(), f"step {step}: rows {differ.nonzero().flatten().tolist()}"
    if weight_format == "fp32":
        assert [o.token_ids for o in got_tokens] == [o.token_ids for o in want_tokens]
    else:
        _assert_equal_until_a_near_tie(got_tokens, want_tokens, atol / 5)
    assert not multiprocessing.active_children(), "workers outlived close()"


def test_a_worker_dying_at_start_up_ends_the_join_naming_it() -> None:
    """A worker that dies while loading (here: at once) must not leave rank 0 in the rendezvous for
    JOIN_TIMEOUT_S: the join ends with an error that names the worker and its exit status."""
    import sys

    from tailserve.executor import parallel
    from tailserve.weights.arch import preset

    arch = preset("tiny")
    split = check_shardable(arch, 2, "fp32")
    tp = parallel.start_workers(arch, split, torch.device("cpu"), sys.exit, ())  # exits with status 1
    try:
        with pytest.raises(parallel.TensorParallelError, match="tp-worker-1 exited with status 1"):
            parallel.join_workers(tp)
    finally:
        tp.close()


def test_tp2_splits_the_kv_heads_of_a_qwen2_shaped_model_and_equals_tp1() -> None:
    _compare("dummy:tp-qwen2", 2, "fp32", FP32_ATOL)  # 14 heads, 2 KV heads, biases, odd vocabulary


def test_tp4_replicates_kv_heads_when_there_are_fewer_than_ranks() -> None:
    _compare("dummy:tiny", 4, "fp32", FP32_ATOL)  # 4 heads, 2 KV heads: each KV head on 2 ranks


def test_tp3_on_the_default_model_equals_tp1(smol: LoadedModel) -> None:
    _compare("default", 3, "fp32", FP32_ATOL, smol)  # SmolLM2-135M: 9 heads, 3 KV heads


def test_int4_fused_kernels_under_tp2_match_tp1() -> None:
    # int4 on CPU runs the fused kernels (AMX where present): o and down all-reduce inside them.
    _compare("dummy:tiny", 2, "int4", BF16_ATOL)


def test_sizes_that_cannot_split_are_refused_before_any_worker_starts(smol: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="does not divide the model's 9 query heads; use one of 1, 3, 9"):
        LLM("default", loaded=smol, weight_format="fp32", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="int4 weights shard on 32-wide groups"):
        # 14 heads of 16 over 2 ranks: o_proj's input per rank is 112, not a multiple of 32.
        LLM("dummy:tp-qwen2", weight_format="int4", tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def _random_groups(n: int, k: int, seed: int) -> Int4Groups:
    rng = np.random.default_rng(seed)
    return Int4Groups(
        rng.integers(0, 16, (n, k), dtype=np.uint8),
        rng.uniform(0.001, 0.02, (n, k // 32)).astype(np.float32),
        rng.uniform(-0.01, 0.01, (n, k // 32)).astype(np.float32),
    )


def _matmul(groups: Int4Groups, x: torch.Tensor) -> torch.Tensor:
    lib = cpu_kernels.tile_matmuls()
    packed = pack_amx_int4(groups, lib) if lib is not None else pack_int4(groups)
    return packed.matmul(x).float()


def test_int4_groups_shard_on_group_boundaries_and_sum_to_the_unsharded_matmul() -> None:
    full = _random_groups(96, 256, 0)
    dense = full.dequantize()
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = _matmul(full, x)
    # Column-parallel: output rows in halves, concatenated.
    cols = [shard_int4(full, (0, r * 48, (r + 1) * 48)) for r in range(2)]
    assert torch.equal(torch.cat([g.dequantize() for g in cols]), dense)
    torch.testing.assert_close(torch.cat([_matmul(g, x) for g in cols], 1), want, atol=0, rtol=0)
    # Row-parallel: input in 32-wide-group runs (here 3 + 5 groups), partial products summed.
    rows = [shard_int4(full, (1, 0, 96)), shard_int4(full, (1, 96, 256))]
    assert torch.equal(torch.cat([g.dequantize() for g in rows], 1), dense)
    parts = _matmul(rows[0], x[:, :96].contiguous()) + _matmul(rows[1], x[:, 96:].contiguous())
    torch.testing.assert_close(parts, want, atol=0.05, rtol=0.01)
    with pytest.raises(ConfigError, match="not on 32-wide groups"):
        shard_int4(full, (1, 0, 80))


# ----- the engine's random-arrival test, at TP=2 -------------------------------------------------
TINY_TP2_BLOCK_BYTES = 2 * 2 * 1 * 16 * 4 * 16  # K+V x 2 layers x 1 KV head per rank x 16 x fp32 x 16
STRESS_BLOCKS = 20


@pytest.fixture
def tp2_engine() -> Iterator[LLMEngine]:
    """One TP=2 engine for the hypothesis examples of one test, closed after it: a process holds one
    tensor-parallel engine at a time, so none may outlive its test (the suite runs in any order)."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model="dummy:tiny",
                device="cpu",
                weight_format="fp32",
                max_model_len=512,
                num_threads=1,
                tensor_parallel_size=2,
            ),
            cache=CacheConfig(kv_cache_memory_bytes=STRESS_BLOCKS * TINY_TP2_BLOCK_BYTES),
            scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8),
        )
    )
    try:
        yield engine
    finally:
        engine.runner.close()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6))
def test_tp2_random_arrivals_and_aborts_return_every_block(tp2_engine: LLMEngine, seed: int) -> None:
    engine = tp2_engine
    assert engine.stats().kv_blocks_total == STRESS_BLOCKS
    finished = drive_random_workload(
        engine, random.Random(seed), 16, last_arrival_step=30, max_tokens=20, abort_share=0.2,
        abort_every=(5, 2), prefix=f"s{seed}-", max_steps=3000,
    )  # fmt: skip
    assert len(finished) == 16
    stats = engine.stats()
    # Rank 0's accounting is back to full; the workers hold no block state at all (they run the
    # block tables each plan carries), so the next example starting from a full pool checks them.
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert all(p.is_alive() for p in multiprocessing.active_children())


def test_the_gguf_loader_keeps_only_a_ranks_shard(smol: LoadedModel) -> None:
    arch = read_arch("default")
    tp = TensorParallel(1, arch, check_shardable(arch, 3, "fp32"), torch.device("cpu"))
    shard = load_model("default", torch.float32, keep=tp.keep)
    assert shard.sharded
    got, full = shard.weights, smol.weights
    q, k, down = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    )
    assert got[q].shape == (3 * 64, 576) and torch.equal(got[q], full[q][192:384])  # heads 3-5
    assert got[k].shape == (64, 576) and torch.equal(got[k], full[k][64:128])  # KV head 1
    assert got[down].shape == (576, 512) and torch.equal(got[down], full[down][:, 512:1024])
    assert torch.equal(got["model.embed_tokens.weight"], full["model.embed_tokens.weight"][16384:32768])
    assert torch.equal(got["model.norm.weight"], full["model.norm.weight"])  # replicated
