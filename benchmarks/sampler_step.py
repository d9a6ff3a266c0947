"""Microbenchmark of model/sampler.py alone: milliseconds per step for R rows over a 49152-token vocab.

Single process, one thread (the sampler's own cost, not the model's). Run:
`python benchmarks/sampler_step.py` (prints one line per configuration).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tailserve.model.sampler import SamplingSpec, sample

VOCAB = 49152


def _specs(rows: int, make: Callable[[torch.Generator], SamplingSpec]) -> list[SamplingSpec]:
    return [make(torch.Generator().manual_seed(i)) for i in range(rows)]


def time_ms(rows: int, make: Callable[[torch.Generator], SamplingSpec], reps: int = 40) -> float:
    """Best-of-`reps` milliseconds of one `sample` call over `rows` rows of random logits (the best
    run, since other work on a shared machine only ever adds time)."""
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    specs = _specs(rows, make)
    sample(logits, specs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sample(logits, specs)
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[0]


CONFIGS: dict[str, Callable[[torch.Generator], SamplingSpec]] = {
    "greedy": lambda g: SamplingSpec(),
    "temperature 0.8": lambda g: SamplingSpec(0.8, 1.0, 0, g),
    "temperature 0.8 top_k 50": lambda g: SamplingSpec(0.8, 1.0, 50, g),
    "temperature 0.8 top_p 0.9": lambda g: SamplingSpec(0.8, 0.9, 0, g),
    "temperature 0.8 min_p 0.05": lambda g: SamplingSpec(0.8, 1.0, 0, g, min_p=0.05),
    "penalties + logit_bias, greedy": lambda g: SamplingSpec(
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={5: 2.0, 7: -100.0},
        token_ids=list(range(0, 4000, 7)),
        num_prompt_tokens=300,
    ),
}


def main() -> None:
    torch.set_num_threads(1)
    for name, make in CONFIGS.items():
        cells = [f"{rows} rows {time_ms(rows, make):7.2f} ms" for rows in (1, 16)]
        print(f"{name:28s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
