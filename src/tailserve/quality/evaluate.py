"""How close a weight format's logits stay to the fp32 reference, measured the way the server runs it.

Held-out text from the bundled corpus is run teacher-forced through a ModelRunner: the first half of
each window as prompt chunks (the prefill path), the rest one token at a time over the cached
context (the decode path), many windows per step. It only measures; deciding is quality_gate's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources

import torch

from tailserve.executor.runner import ModelRunner, SeqChunk
from tailserve.model.sampler import SamplingSpec
from tailserve.model.transformer import TransformerLM
from tailserve.weights.tokenizer import Tokenizer

_MAX_PREFILL_ROWS_PER_STEP = 512  # bounds the [rows, vocab] logits of one step
_BLOCK_SIZE = 16


@dataclass(frozen=True)
class EvalPlan:
    """What is measured: scored tokens, their window shape, and the greedy prompt set."""

    tokens: int = 4096  # teacher-forced positions scored (rounded to whole windows)
    window_tokens: int = 128  # positions per window: the first half prefilled, the rest decoded
    prefill_chunk_tokens: int = 32  # prompt chunk size (later chunks attend over a cached prefix)
    greedy_prompts: int = 16
    greedy_prompt_tokens: int = 32
    greedy_tokens: int = 32

    @property
    def num_windows(self) -> int:
        return max(1, round(self.tokens / self.window_tokens))

    @property
    def scored_tokens(self) -> int:
        return self.num_windows * self.window_tokens

    @property
    def prefill_tokens(self) -> int:
        """Positions of each window scored through the prefill path (the rest are decode rows)."""
        return self.window_tokens // 2

    @property
    def max_positions(self) -> int:
        return max(self.window_tokens, self.greedy_prompt_tokens + self.greedy_tokens) + 1


@dataclass(frozen=True)
class HeldOutText:
    """Token windows (window_tokens + 1 ids each) and greedy prompts cut from the bundled corpus.

    Windows start at evenly spaced offsets over the whole tokenized corpus (both works in it); the
    prompts start half a stride later, so no prompt is a scored window's prefix.
    """

    windows: list[list[int]]
    prompts: list[list[int]]

    @classmethod
    def from_corpus(cls, tokenizer: Tokenizer, plan: EvalPlan) -> HeldOutText:
        text = resources.files("tailserve.bench").joinpath("data/corpus.txt").read_text(encoding="utf-8")
        ids = tokenizer.encode(text)
        span = plan.window_tokens + 1
        stride = (len(ids) - span) // plan.num_windows
        windows = [ids[i * stride : i * stride + span] for i in range(plan.num_windows)]
        p_stride = (len(ids) - plan.greedy_prompt_tokens) // max(1, plan.greedy_prompts)
        first = p_stride // 2
        prompts = [
            ids[first + i * p_stride : first + i * p_stride + plan.greedy_prompt_tokens]
            for i in range(plan.greedy_prompts)
        ]
        return cls(windows, prompts)


@dataclass
class ModelTrace:
    """What one model does on the held-out text: per scored position, the NLL of the true next token
    and the argmax; per greedy prompt, its continuation. Row order is fixed by the plan."""

    prefill_nll: list[float] = field(default_factory=list)
    prefill_top1: list[int] = field(default_factory=list)
    decode_nll: list[float] = field(default_factory=list)
    decode_top1: list[int] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Agreement:
    """A candidate trace against the reference trace."""

    tokens: int
    top1: float
    ppl_ref: float
    ppl: float
    prefill_top1: float
    prefill_ppl_ratio: float
    decode_top1: float
    decode_ppl_ratio: float
    greedy_identical: float  # share of greedy continuations equal to the reference's
    greedy_prefix_tokens: float  # mean length of the prefix shared with the reference's continuation

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_ref


def trace_model(
    model: TransformerLM,
    text: HeldOutText,
    plan: EvalPlan,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> ModelTrace:
    """Run the held-out text through `model` on a small KV pool of its own, the way the server would
    (`kv_dtype` None: the KV cache in the model's activation dtype)."""
    blocks_per_seq = math.ceil(plan.max_positions / _BLOCK_SIZE)
    num_seqs = max(len(text.windows), len(text.prompts))
    num_blocks = num_seqs * blocks_per_seq
    if kv_dtype is None:
        runner = ModelRunner(model, num_blocks, _BLOCK_SIZE, device)
    else:
        runner = ModelRunner(model, num_blocks, _BLOCK_SIZE, device, kv_dtype=kv_dtype)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    trace = ModelTrace()
    _teacher_forced(runner, text.windows, tables, plan, trace)
    trace.greedy = _greedy(runner, text.prompts, tables, plan.greedy_tokens)
    return trace


def _teacher_forced(
    runner: ModelRunner, windows: list[list[int]], tables: list[list[int]], plan: EvalPlan, trace: ModelTrace
) -> None:
    spec = SamplingSpec(temperature=0.0)
    n = len(windows)
    dev = runner.device
    targets = torch.tensor(windows, dtype=torch.long, device=dev)[:, 1:]  # [windows, window_tokens]
    per_step = max(1, _MAX_PREFILL_ROWS_PER_STEP // plan.prefill_chunk_tokens)
    # Prefill rows: window by window, chunk by chunk, so a window's chunks stay contiguous per position.
    prefill_nll = torch.empty(n, plan.prefill_tokens, dtype=torch.float64)
    prefill_top1 = torch.empty(n, plan.prefill_tokens, dtype=torch.long)
    for start in range(0, plan.prefill_tokens, plan.prefill_chunk_tokens):
        end = min(start + plan.prefill_chunk_tokens, plan.prefill_tokens)
        for g in range(0, n, per_step):
            group = range(g, min(g + per_step, n))
            chunks = [SeqChunk(windows[i][start:end], start, tables[i], False, spec) for i in group]
            logits = runner.logits_for(chunks).view(len(group), end - start, -1)
            nll, top1 = _score(logits, targets[group.start : group.stop, start:end])
            prefill_nll[group.start : group.stop, start:end] = nll
            prefill_top1[group.start : group.stop, start:end] = top1
    # Decode rows: one token per window per step, every window in the same step.
    decode_len = plan.window_tokens - plan.prefill_tokens
    decode_nll = torch.empty(n, decode_len, dtype=torch.float64)
    decode_top1 = torch.empty(n, decode_len, dtype=torch.long)
    for j, pos in enumerate(range(plan.prefill_tokens, plan.window_tokens)):
        chunks = [SeqChunk([windows[i][pos]], pos, tables[i], False, spec, decode=True) for i in range(n)]
        logits = runner.logits_for(chunks).view(n, 1, -1)
        nll, top1 = _score(logits, targets[:, pos : pos + 1])
        decode_nll[:, j : j + 1] = nll
        decode_top1[:, j : j + 1] = top1
    trace.prefill_nll = prefill_nll.flatten().tolist()
    trace.prefill_top1 = prefill_top1.flatten().tolist()
    trace.decode_nll = decode_nll.flatten().tolist()
    trace.decode_top1 = decode_top1.flatten().tolist()


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[seqs, rows, vocab] logits and [seqs, rows] true next tokens -> (NLL, argmax), on the CPU."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return nll.double().cpu(), logits.argmax(dim=-1).cpu()


def _greedy(
    runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """Greedy continuations through `execute`: one prompt chunk each, then decode steps of all of them."""
    spec = SamplingSpec(temperature=0.0)
    first = runner.execute([SeqChunk(p, 0, tables[i], True, spec) for i, p in enumerate(prompts)])
    outs = [[int(t)] for t in first.tokens if t is not None]
    for step in range(1, num_tokens):
        chunks = [
            SeqChunk([out[-1]], len(p) + step - 1, tables[i], True, spec, decode=True)
            for i, (p, out) in enumerate(zip(prompts, outs, strict=True))
        ]
        for out, tok in zip(outs, runner.execute(chunks).tokens, strict=True):
            assert tok is not None
            out.append(tok)
    return outs


def compare(candidate: ModelTrace, reference: ModelTrace) -> Agreement:
    """Top-1 agreement, perplexities and greedy agreement of `candidate` against `reference`."""
    c_nll = candidate.prefill_nll + candidate.decode_nll
    r_nll = reference.prefill_nll + reference.decode_nll
    c_top = candidate.prefill_top1 + candidate.decode_top1
    r_top = reference.prefill_top1 + reference.decode_top1
    if len(c_nll) != len(r_nll) or len(candidate.greedy) != len(reference.greedy):
        raise ValueError("traces of different plans cannot be compared")
    prefixes = [_shared_prefix(c, r) for c, r in zip(candidate.greedy, reference.greedy, strict=True)]
    n_greedy = max(1, len(prefixes))
    return Agreement(
        tokens=len(c_nll),
        top1=_share_equal(c_top, r_top),
        ppl_ref=_ppl(r_nll),
        ppl=_ppl(c_nll),
        prefill_top1=_share_equal(candidate.prefill_top1, reference.prefill_top1),
        prefill_ppl_ratio=_ppl(candidate.prefill_nll) / _ppl(reference.prefill_nll),
        decode_top1=_share_equal(candidate.decode_top1, reference.decode_top1),
        decode_ppl_ratio=_ppl(candidate.decode_nll) / _ppl(reference.decode_nll),
        greedy_identical=sum(c == r for c, r in zip(candidate.greedy, reference.greedy, strict=True))
        / n_greedy,
        greedy_prefix_tokens=sum(prefixes) / n_greedy,
    )


def _ppl(nll: list[float]) -> float:
    return math.exp(math.fsum(nll) / max(1, len(nll)))


def _share_equal(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
