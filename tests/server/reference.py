"""Teacher-forced log-probabilities of a token sequence from an in-process fp32 engine: what the
server's echo / prompt logprobs must equal."""

from __future__ import annotations

import torch

from tailserve.config import CacheConfig, EngineConfig, ModelConfig
from tailserve.engine import LLM
from tailserve.executor.runner import SeqChunk
from tailserve.model.sampler import SamplingSpec
from tailserve.weights.loader import LoadedModel


def fp32_llm(smol: LoadedModel) -> LLM:
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
    )
    return LLM(config=config, loaded=smol)


def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log_softmax of the logits after ids[: i + 1]."""
    return teacher_forced_many(llm, [ids])[0]


def teacher_forced_many(llm: LLM, seqs: list[list[int]], per_step: int = 32) -> list[torch.Tensor]:
    """`teacher_forced` of each sequence, `per_step` sequences to a forward pass (each weight read
    once per pass: on a loaded CPU that is most of the time)."""
    kv = llm.engine.scheduler.kv
    out: list[torch.Tensor] = []
    for start in range(0, len(seqs), per_step):
        batch = seqs[start : start + per_step]
        names = [f"reference-{i}" for i in range(len(batch))]
        try:
            chunks = []
            for name, ids in zip(names, batch, strict=True):
                assert kv.allocate(name, len(ids))  # blocks of its own: nothing cached is overwritten
                chunks.append(SeqChunk(ids, 0, kv.block_table(name), False, SamplingSpec(temperature=0.0)))
            logits = torch.log_softmax(llm.engine.runner.logits_for(chunks).float(), dim=-1)
        finally:
            for name in names:
                kv.free(name)
        out += list(logits.split([len(ids) for ids in batch]))
    return out


def continuation_logprobs(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Per (context, continuation): the sum of the continuation tokens' logprobs after the context
    (a loglikelihood request)."""
    refs = teacher_forced_many(llm, [ctx + cont for ctx, cont in pairs])
    return [
        sum(float(ref[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        for ref, (ctx, cont) in zip(refs, pairs, strict=True)
    ]
