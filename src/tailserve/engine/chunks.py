"""A request's part of one step as the runner takes it (its SeqChunk and SamplingSpec), and the
step's prompt scores put back on the request.

The one place a SamplingSpec is built from SamplingParams. It reads requests and never schedules.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence

import torch

from tailserve.engine.request import Request, SamplingParams, TokenLogprob
from tailserve.engine.scheduler import StepPlan
from tailserve.engine.structured import GrammarCache
from tailserve.executor.runner import SeqChunk
from tailserve.model.sampler import SamplingSpec, TokenScore

# The settings SamplingSpec takes from SamplingParams: the fields both have, under the same names and
# with the same defaults, copied by name. SamplingSpec lists them first, so they go in by position
# (a keyword dict per request per step costs twice as much); tests/engine/test_chunks.py holds both
# classes to this.
PARAMS_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingSpec) if f.name in SamplingParams.__dataclass_fields__
)
_params_settings = operator.attrgetter(*PARAMS_FIELDS)


def samples_next(req: Request, n: int) -> bool:
    """Running n more tokens reaches the request's last known token: the step samples its next one."""
    return req.num_computed_tokens + n == len(req.token_ids)


def step_chunks(plan: StepPlan, eos_ids: Iterable[int], grammars: GrammarCache) -> list[SeqChunk]:
    """The plan's chunks in its order; the requests that sample under a grammar this step get their
    allowed-token bitmask (one tensor for all)."""
    sampling = {
        i: g
        for i, (req, n) in enumerate(plan.scheduled)
        if (g := req.grammar) is not None and samples_next(req, n)
    }
    masks = dict(zip(sampling, grammars.bitmask(list(sampling.values())), strict=True)) if sampling else {}
    return [
        seq_chunk(req, n, table, i < plan.num_decodes, eos_ids, masks.get(i))
        for i, ((req, n), table) in enumerate(zip(plan.scheduled, plan.block_tables, strict=True))
    ]


def seq_chunk(
    req: Request,
    n: int,
    block_table: list[int],
    decode: bool,
    eos_ids: Iterable[int],
    bitmask: torch.Tensor | None,
) -> SeqChunk:
    """The request's next n tokens as the runner runs them; `bitmask`: its grammar's allowed tokens."""
    c = req.num_computed_tokens
    # Scoring the prompt: each row up to the second-to-last prompt token predicts the next prompt token.
    targets = req.token_ids[c + 1 : min(c + n, req.num_prompt_tokens - 1) + 1] if req.scores_prompt else []
    return SeqChunk(
        token_ids=req.token_ids[c : c + n],
        start_pos=c,
        block_table=block_table,
        sample=samples_next(req, n),
        sampling=sampling_spec(req, eos_ids, bitmask),
        decode=decode,
        prompt_targets=targets,
        prompt_top=req.params.prompt_logprobs or 0,
    )


def sampling_spec(req: Request, eos_ids: Iterable[int], bitmask: torch.Tensor | None) -> SamplingSpec:
    """The sampler's view of a request this step: its SamplingParams' settings, plus what the engine
    adds (its generator, the tokens so far, banned tokens, the grammar's bitmask). End and stop tokens
    are banned until min_tokens (not under a grammar: once it is complete its end token may be the
    only one left)."""
    p = req.params
    banned: tuple[int, ...] = ()
    if req.num_output_tokens < p.min_tokens and req.grammar is None:
        banned = p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids))
    return SamplingSpec(
        *_params_settings(p),
        generator=req.generator,
        banned_token_ids=banned,
        token_ids=req.token_ids,
        num_prompt_tokens=req.num_prompt_tokens,
        token_bitmask=bitmask,
    )


def record_prompt_logprobs(
    scheduled: list[tuple[Request, int]],
    chunks: list[SeqChunk],
    prompt_scores: Sequence[list[TokenScore] | None],
) -> None:
    """Each chunk's prompt scores into its request: entry i scores prompt token i + 1; a chunk
    recomputed after preemption overwrites its own."""
    for (req, _), chunk, scores in zip(scheduled, chunks, prompt_scores, strict=True):
        c = chunk.start_pos
        if scores is None or c > len(req.prompt_logprobs):
            continue
        scored = zip(chunk.prompt_targets, scores, strict=True)
        req.prompt_logprobs[c:] = [TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in scored]
