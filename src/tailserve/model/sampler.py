"""Token sampling: greedy, temperature, top-k, top-p, each row with its own generator.

A row's draw depends only on its own logits and generator, so the same seed gives the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingSpec:
    """The per-row sampling settings the model runner needs (no stop logic: that is the engine's)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    """One token id per row of `logits` [R, vocab] (float32)."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, spec in enumerate(specs):
        if spec.temperature == 0.0:
            out.append(int(greedy[i]))
        else:
            out.append(_sample_row(logits[i], spec))
    return out


def _sample_row(row: torch.Tensor, spec: SamplingSpec) -> int:
    row = row / spec.temperature
    if spec.top_k > 0 and spec.top_k < row.shape[-1]:
        kth = torch.topk(row, spec.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= spec.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    # Gumbel-style race via exponential noise: argmax(p / E) is a draw from p.
    noise = torch.empty_like(probs).exponential_(1.0, generator=spec.generator)
    return int(torch.argmax(probs / noise).item())
