"""Prompt log-probabilities from the model runner (echo): the rows a chunk asks for are scored
against the next prompt token, on the torch path and the fused CPU path, across chunked prefill and
beside rows that only sample."""

from __future__ import annotations

import pytest
import torch

from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.plans import build_model
from tailserve.model.sampler import SamplingSpec
from tailserve.weights.loader import LoadedModel

PROMPT = "The river Tiber runs through the city of Rome, and its bridges are old and famous"


def _runner(smol: LoadedModel, weight_format: str, dtype: torch.dtype, fused: bool) -> ModelRunner:
    model = build_model(smol, weight_format, torch.device("cpu"), 512)
    runner = ModelRunner(model, 64, 16, torch.device("cpu"), kv_dtype=dtype, cpu_kernels=fused)
    assert (model.fused is not None) == fused
    return runner


def _reference(runner: ModelRunner, prompt: list[int], split: int) -> torch.Tensor:
    """log_softmax of teacher-forced logits of the prompt in the same two chunks, on blocks of its own."""
    chunks = [SeqChunk(prompt[:split], 0, [40, 41], False, SamplingSpec(temperature=0.0))]
    chunks.append(SeqChunk(prompt[split:], split, [40, 41], False, SamplingSpec(temperature=0.0)))
    logits = torch.cat([runner.logits_for([c]) for c in chunks])
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    ("weight_format", "dtype", "fused", "tol"),
    # fp32 within 1e-4; bf16 rows within bf16 noise of the same rows run alone
    [
        ("fp32", torch.float32, False, 1e-4),
        ("int4", torch.bfloat16, True, 2e-2),
    ],
    ids=["torch-fp32", "fused-int4"],
)
def test_prompt_rows_are_scored_against_the_next_prompt_token(
    smol: LoadedModel, weight_format: str, dtype: torch.dtype, fused: bool, tol: float
) -> None:
    if fused and cpu_kernels.load() is None:
        pytest.skip("no C compiler here: the fused path does not build")
    runner = _runner(smol, weight_format, dtype, fused)
    prompt = smol.tokenizer.encode(PROMPT)
    p = len(prompt)
    other = smol.tokenizer.encode("Once upon a time")
    greedy = SamplingSpec(temperature=0.0)
    # Another sequence's prompt, then its decode, share the steps with the scored chunks.
    runner.execute([SeqChunk(other, 0, [10], True, greedy)])
    first = SeqChunk(prompt[:10], 0, [0, 1], False, greedy, prompt_targets=prompt[1:11], prompt_top=3)
    first_result = runner.execute([SeqChunk([other[0]], len(other), [10], True, greedy, decode=True), first])
    rest = SeqChunk(
        prompt[10:],
        10,
        [0, 1],
        True,
        SamplingSpec(temperature=0.0, logprobs=2),
        prompt_targets=prompt[11:],
        prompt_top=3,
    )
    plain = SeqChunk(other, 0, [11], True, greedy)
    result = runner.execute([rest, plain])
    first_scores, (rest_scores, plain_scores) = first_result.prompt_scores[1], result.prompt_scores
    assert first_scores is not None and rest_scores is not None and plain_scores is None
    assert first_result.prompt_scores[0] is None and first_result.logprobs == [None, None]
    scored = first_scores + rest_scores
    assert len(scored) == p - 1  # every prompt token after the first; the last row samples instead
    ref = _reference(runner, prompt, 10)
    for i, (logprob, top) in enumerate(scored):
        assert abs(logprob - float(ref[i, prompt[i + 1]])) < tol
        assert top[0][0] == int(ref[i].argmax()) or ref[i].topk(2).values.diff().abs().item() < tol
        if tol <= 1e-4:
            assert [t for t, _ in top] == ref[i].topk(3).indices.tolist()
        for token, value in top:
            assert abs(value - float(ref[i, token])) < tol
    rest_logprob = result.logprobs[0]
    assert rest_logprob is not None and result.logprobs[1] is None  # the sampled row keeps its own logprobs
    assert abs(rest_logprob[0] - float(ref[p - 1].max())) < tol


def test_prompt_logprobs_under_tensor_parallelism_equal_one_rank() -> None:
    """Every rank gathers the scored rows too (the plan carries their count), so TP=2 answers as TP=1."""
    from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tailserve.engine import LLM, SamplingParams

    def llm(size: int) -> LLM:
        model = ModelConfig(
            model="dummy:tiny", weight_format="fp32", device="cpu", max_model_len=128, num_threads=1,
            tensor_parallel_size=size,
        )  # fmt: skip
        cache = CacheConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
        return LLM(
            config=EngineConfig(
                model=model, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
            )
        )

    prompt = [1, *range(20, 60)]  # three chunks of 16
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    want = llm(1).generate([prompt], params)[0].prompt_logprobs
    tp = llm(2)
    try:
        got = tp.generate([prompt, prompt[:7]], params)
    finally:
        tp.engine.runner.close()
    assert [lp.token_id for lp in got[0].prompt_logprobs] == prompt[1:] and len(got[1].prompt_logprobs) == 6
    for g, w in zip(got[0].prompt_logprobs, want, strict=True):
        assert abs(g.logprob - w.logprob) < 1e-4 and [t for t, _ in g.top] == [t for t, _ in w.top]
