"""How well the scheduler's step-cost model predicts the steps that carry prompt tokens, under the
rule of the code and under the rule before it (the whole step divided by all its tokens, decodes
and all, plus a decode step on top: the decodes charged twice).

    .venv/bin/python benchmarks/step_model.py --rate 2.3 --requests 300 --out bench-results/step-model

An in-process engine (no HTTP, every request admitted) serves Poisson arrivals of the long-tail chat
shapes at x0.25 (prompts lognormal around 50 tokens, 5% near 375, outputs 16-32). Every step's decode
rows, prompt tokens and seconds are logged. Then both rules replay the log: before each step that
carries at least StepTimer.PREFILL_HEAVY_TOKENS prompt tokens, the rule predicts it from the steps
before it, and the table gives the error of those predictions (predicted / actual - 1). A least-
squares fit of step time = fixed + per decode row + per prompt token over all steps is printed
beside, for the shape of the cost. Admission refuses a request when its predicted wait exceeds its
TTFT target: a biased prediction refuses requests that would have made it. Never run beside
another measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from machine import cpu_shares, cpu_times, git_commit, machine_line

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
from tailserve.engine.stats import StepTimer

Step = tuple[int, int, float]  # (decode rows, prompt tokens, seconds)


@dataclass
class _Plan:
    num_tokens: int
    num_prefill_tokens: int


class OldRule:
    """The rule before this benchmark's commit: a prompt token's price is the step over all its rows."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.decode_s: float | None = None
        self.per_token_s: float | None = None

    def record(self, decodes: int, prompt: int, seconds: float) -> None:
        if prompt == 0:
            self.decode_s = (
                seconds if self.decode_s is None else self.decode_s + self.alpha * (seconds - self.decode_s)
            )
        if decodes + prompt >= StepTimer.PREFILL_HEAVY_TOKENS:
            v = seconds / (decodes + prompt)
            self.per_token_s = (
                v if self.per_token_s is None else self.per_token_s + self.alpha * (v - self.per_token_s)
            )

    def predict(self, decodes: int, prompt: int) -> float | None:
        if self.decode_s is None or self.per_token_s is None:
            return None
        return (self.decode_s if decodes else 0.0) + prompt * self.per_token_s


def arrivals(rate: float, n: int, seed: int) -> list[tuple[float, int, int]]:
    """(send time s, prompt tokens, output tokens): the long-tail chat shapes at x0.25."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.05
        prompt = int(rng.gauss(375, 30)) if long else int(rng.lognormvariate(math.log(50), 0.5))
        out.append((t, max(prompt, 4), rng.randint(16, 32)))
    return out


def serve(args: argparse.Namespace) -> tuple[list[Step], float | None]:
    """Run the arrivals through an engine; every step's (decode rows, prompt tokens, seconds)."""
    config = EngineConfig(
        model=ModelConfig(num_threads=args.threads),
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.step_tokens,
            max_num_seqs=args.max_num_seqs,
            slo_ttft_s=0.55,
            slo_tpot_s=0.1,
        ),
    )
    engine = LLMEngine(config)
    timer = engine.scheduler.timer
    steps: list[Step] = []
    record = timer.record

    def logged(plan: _Plan, seconds: float) -> None:
        steps.append(
            (int(plan.num_tokens) - int(plan.num_prefill_tokens), int(plan.num_prefill_tokens), seconds)
        )
        record(plan, seconds)

    timer.record = logged  # type: ignore[method-assign]
    rng = random.Random(args.seed)

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    engine.add_request("warm", [rng.randrange(1000, 20000) for _ in range(300)], greedy(8))
    while engine.has_unfinished():
        engine.step()
    steps.clear()
    todo = arrivals(args.rate, args.requests, args.seed)
    before = cpu_times()
    t0, i = time.monotonic(), 0
    while i < len(todo) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(todo) and todo[i][0] <= now:
            _, prompt, output = todo[i]
            ids = [rng.randrange(1000, 20000) for _ in range(prompt)]
            engine.add_request(f"r{i}", ids, greedy(output))
            i += 1
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(0.001)
    return steps, (cpu_shares(before, cpu_times()) or {}).get("steal")


def errors(steps: Sequence[Step]) -> dict[str, list[float]]:
    """Each rule's relative error on every prompt-heavy step, predicted from the steps before it."""
    new, old = StepTimer(budget_tokens=1 << 30), OldRule()
    out: dict[str, list[float]] = {"code": [], "before": []}
    for decodes, prompt, seconds in steps:
        if prompt >= StepTimer.PREFILL_HEAVY_TOKENS:
            step_s, per_token = new.coefficients()
            if step_s > 0 and per_token > 0:
                out["code"].append(new.estimate_s(prompt, decodes, per_step_tokens=prompt) / seconds - 1)
            if (guess := old.predict(decodes, prompt)) is not None:
                out["before"].append(guess / seconds - 1)
        new.record(_Plan(decodes + prompt, prompt), seconds)
        old.record(decodes, prompt, seconds)
    return out


def least_squares(steps: Sequence[Step]) -> tuple[float, float, float]:
    """(fixed s, s per decode row, s per prompt token) of the best linear fit, by the normal equations."""
    xs = [(1.0, float(d), float(p)) for d, p, _ in steps]
    ys = [s for _, _, s in steps]
    m = [[sum(a[i] * a[j] for a in xs) for j in range(3)] for i in range(3)]
    v = [sum(a[i] * y for a, y in zip(xs, ys, strict=True)) for i in range(3)]
    for c in range(3):  # Gauss-Jordan on the 3x3 system
        pivot = max(range(c, 3), key=lambda r: abs(m[r][c]))
        m[c], m[pivot], v[c], v[pivot] = m[pivot], m[c], v[pivot], v[c]
        if m[c][c] == 0:
            return math.nan, math.nan, math.nan
        for r in range(3):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
                v[r] -= f * v[c]
    return v[0] / m[0][0], v[1] / m[1][1], v[2] / m[2][2]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rate", type=float, default=2.3, help="arrivals per second")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-results/step-model"))
    args = p.parse_args(argv)
    if args.rate <= 0 or args.requests < 1:
        sys.exit("--rate must be positive and --requests at least 1")
    steps, steal = serve(args)
    errs = errors(steps)
    fixed, per_row, per_prompt = least_squares(steps)
    heavy = sum(1 for _, prompt, _ in steps if prompt >= StepTimer.PREFILL_HEAVY_TOKENS)
    lines = [
        f"# Step-cost model: predictions of the {heavy} steps with prompt tokens",
        "",
        f"- command: `{' '.join(['benchmarks/step_model.py', *(argv if argv is not None else sys.argv[1:])])}`",
        f"- machine: {machine_line()}; commit {git_commit()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- {args.requests} requests at {args.rate} req/s, {args.threads} threads, {len(steps)} steps, "
        f"steal {'n/a' if steal is None else f'{steal:.1%}'}",
        f"- least squares over every step: {fixed * 1000:.2f} ms + {per_row * 1000:.3f} ms per decode row "
        f"+ {per_prompt * 1000:.3f} ms per prompt token",
        "",
        "| rule | steps predicted | mean error | median error | mean abs error |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for rule, label in (("code", "code: decode step + prompt tokens x price beyond it"),
                        ("before", "before: the step over all its rows, plus a decode step")):  # fmt: skip
        e = errs[rule]
        if not e:
            lines.append(f"| {label} | 0 | n/a | n/a | n/a |")
            continue
        mean, med = statistics.fmean(e), statistics.median(e)
        mae = statistics.fmean(abs(x) for x in e)
        lines.append(f"| {label} | {len(e)} | {mean:+.1%} | {med:+.1%} | {mae:.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"args": {**vars(args), "out": str(args.out)}, "steps": steps})
    )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
