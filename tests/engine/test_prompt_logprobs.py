"""Prompt log-probabilities through the engine (what echo in /v1/completions reads): chunked
prefill, a prompt already in the prefix cache, n > 1 forks and max_tokens=0, against teacher-forced
logits of the real model."""

from __future__ import annotations

import pytest
import torch

from tailserve.config import EngineConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.errors import InvalidRequestError
from tailserve.executor.runner import SeqChunk
from tailserve.model.sampler import SamplingSpec
from tailserve.weights.loader import LoadedModel

PROMPT = (
    "The river Tiber runs through the city of Rome, and its bridges are old and famous; "
    "people have crossed them for more than two thousand years, on foot, on horses and in carts, "
    "in peace and in war"
)


@pytest.fixture(scope="module")
def llm(smol: LoadedModel) -> LLM:
    from tailserve.config import CacheConfig, ModelConfig, SchedulerConfig

    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=256),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),  # a 40-token prompt: 3 chunks
    )
    return LLM(config=config, loaded=smol)


def _reference(llm: LLM, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    kv = engine.scheduler.kv
    assert kv.allocate("reference", len(prompt))
    try:
        chunk = SeqChunk(prompt, 0, kv.block_table("reference"), False, SamplingSpec(temperature=0.0))
        return torch.log_softmax(engine.runner.logits_for([chunk]).float(), dim=-1)
    finally:
        kv.free("reference")


def _assert_matches(scored: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert [lp.token_id for lp in scored] == prompt[1:]
    for i, lp in enumerate(scored):
        assert abs(lp.logprob - float(ref[i, prompt[i + 1]])) < 1e-4
        assert [t for t, _ in lp.top] == ref[i].topk(k).indices.tolist()
        for token, value in lp.top:
            assert abs(value - float(ref[i, token])) < 1e-4


def test_prompt_logprobs_equal_teacher_forced_logits_across_chunks_and_the_prefix_cache(llm: LLM) -> None:
    prompt = llm.tokenizer.encode(PROMPT)
    assert len(prompt) > 32  # more than two chunks and two full blocks
    warm = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]  # now in the prefix cache
    assert warm.prompt_logprobs == []
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=4)
    again = llm.generate([prompt], params)[0]
    ref = _reference(llm, prompt)
    _assert_matches(again.prompt_logprobs, prompt, ref, 4)
    assert again.num_cached_tokens == 0  # scored requests skip the cache: a cached prefix has no logits
    assert again.token_ids == warm.token_ids[:2] + again.token_ids[2:]
    assert abs(again.logprobs[0].logprob - float(ref[-1].max())) < 1e-4


def test_prompt_only_with_max_tokens_zero_and_n_choices_share_the_scores(llm: LLM) -> None:
    prompt = llm.tokenizer.encode(PROMPT)
    ref = _reference(llm, prompt)
    only = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert only.token_ids == [] and only.text == "" and only.finish_reason == "length"
    assert [lp.top for lp in only.prompt_logprobs] == [()] * (len(prompt) - 1)
    assert all(
        abs(lp.logprob - float(ref[i, prompt[i + 1]])) < 1e-4 for i, lp in enumerate(only.prompt_logprobs)
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=5, prompt_logprobs=1)
    engine.add_request("parent", prompt, params)
    engine.add_request("child", prompt, params, fork_of="parent")
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    _assert_matches(finals["parent"].prompt_logprobs, prompt, ref, 1)
    assert finals["child"].prompt_logprobs == finals["parent"].prompt_logprobs
    assert finals["child"].num_cached_tokens > 0  # the child forked the parent's blocks


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}])
def test_bad_prompt_logprob_settings_name_the_field(bad: dict[str, int]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)  # type: ignore[arg-type]
    assert err.value.param == next(iter(bad))


def test_a_scored_request_preempted_and_recomputed_keeps_its_prompt_scores(smol: LoadedModel) -> None:
    from tailserve.config import CacheConfig, ModelConfig, SchedulerConfig

    bytes_per_token = (
        2 * smol.arch.num_layers * smol.arch.num_kv_heads * smol.arch.head_dim * 4
    )  # fp32 K and V
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=256),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=7 * 16 * bytes_per_token),  # 7 blocks
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
    )
    small = LLM(config=config, loaded=smol)
    assert small.engine.scheduler.kv.num_blocks == 7
    texts = [
        PROMPT[:110],
        "In a distant land, long ago, there lived a king who loved maps and old stone bridges",
    ]
    texts.append("Once upon a time in a small village by the sea, a girl found a shell that sang")
    prompts = [small.tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
    ]
    outs = small.generate(prompts, params)
    assert sum(o.timings.preemptions for o in outs if o.timings) >= 1  # the pool cannot hold all three
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        _assert_matches(out.prompt_logprobs, prompt, _reference(small, prompt), p.prompt_logprobs or 0)
