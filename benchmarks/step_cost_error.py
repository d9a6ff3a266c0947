"""How far the step timer's prediction of each step is from the step (issue 40 item 2): the engine in
process, in real time, serving Poisson arrivals of the chat-scaled lengths (prompts of 512-2,048
tokens, answers of 64-256), no HTTP. Before each step is recorded, the timer (fed every earlier step)
predicts it three ways; the error is (predicted - measured) / measured:

- `pairs`: decode step + c + a x prompt tokens + b x query-key pairs (the fit the wait model uses;
  c, a prompt step's fixed cost, is 0 before 2026-12-07's fit);
- `single`: decode step + one price per prompt token (what it used before, and its fallback);
- `decode`: for steps without prompt tokens, the decode-step average (rows are not in it);
- `idle_step` and `idle_as_budget_steps`: the steps with no decode that carry more prompt tokens
  than the step budget (--prefill-step-tokens), priced as the one step they are (`pairs`, what the
  wait model predicts for the first prompt in line on an idle engine) and as budget-sized steps
  (what it predicted before);
- `lane_chunk` and `main_prompt`: the other prompt steps (`pairs`) split by where they ran: chunks
  on the prefill lane's half of the threads beside decoding streams (predicted by the lane's own
  timer, which only they feed), or steps on all threads with nothing decoding.
- `decode_all_threads` and `decode_beside_lane`: decode-only steps as the TPOT price sees them
  (`DecodeTimer`: from one step's start to the next's, fitted on rows and context), on all threads
  and beside a lane chunk, each predicted before the timer learns it.

    .venv/bin/python benchmarks/step_cost_error.py --rate 0.5 --requests 60 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from machine import git_commit, machine_line

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
from tailserve.engine.stats import StepTimer


def predictions(timer: StepTimer, plan: Any) -> dict[str, float]:
    """What the timer, as it stands before `plan` is recorded, predicts the step takes."""
    tokens = int(plan.num_prefill_tokens)
    decode_s, _ = timer.coefficients()
    if tokens == 0:
        return {"decode": decode_s}
    if plan.num_decodes == 0 and tokens > timer.budget_tokens:
        pairs_ = int(plan.prompt_pairs)
        return {
            "idle_step": timer.estimate_s(tokens, 0, tokens, pairs_),
            "idle_as_budget_steps": timer.estimate_s(tokens, 0, timer.budget_tokens, pairs_),
        }
    single = decode_s + tokens * (timer._per_token_s or 0.0)
    pair_price = timer._pair_price
    pairs = (
        single
        if pair_price is None
        else decode_s + pair_price[0] + tokens * pair_price[1] + plan.prompt_pairs * pair_price[2]
    )
    return {"pairs": pairs, "single": single}


def run(
    rate: float,
    requests: int,
    threads: int,
    seed: int,
    idle: list[tuple[int, float, float, float]],
    prefill_step_tokens: int = SchedulerConfig.prefill_step_tokens,
) -> dict[str, list[float]]:
    """Serve the arrivals and return each model's errors; `idle` gets (prompt tokens, measured ms,
    one-step and budget-steps predictions in ms) of every long step with no decode."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model="default", num_threads=threads),
            cache=CacheConfig(enable_prefix_caching=False),
            scheduler=SchedulerConfig(prefill_step_tokens=prefill_step_tokens),
        )
    )
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, requests))
    prompts = rng.integers(512, 2049, requests)
    outputs = rng.integers(64, 257, requests)
    vocab = engine.arch.vocab_size
    errors: dict[str, list[float]] = {
        "pairs": [],
        "single": [],
        "decode": [],
        "idle_step": [],
        "idle_as_budget_steps": [],
        "lane_chunk": [],
        "main_prompt": [],
        "decode_all_threads": [],
        "decode_beside_lane": [],
    }

    def judge(timer: StepTimer, lane: bool) -> None:
        """Score `timer`'s prediction of each step it is about to record (the engine's steps' timer,
        or the prefill lane's, which only its chunks feed)."""
        record = timer.record

        def judged(plan: Any, seconds: float) -> None:
            if engine.scheduler.timer.steps > 20:  # after the warm-up request's steps
                predicted_s = predictions(timer, plan)
                for name, predicted in predicted_s.items():
                    errors[name].append((predicted - seconds) / seconds)
                if "pairs" in predicted_s:
                    where = "lane_chunk" if lane else "main_prompt"
                    errors[where].append((predicted_s["pairs"] - seconds) / seconds)
                if "idle_step" in predicted_s:
                    idle.append(
                        (
                            int(plan.num_prefill_tokens),
                            round(1e3 * seconds, 1),
                            round(1e3 * predicted_s["idle_step"], 1),
                            round(1e3 * predicted_s["idle_as_budget_steps"], 1),
                        )
                    )
            record(plan, seconds)

        timer.record = judged  # type: ignore[method-assign]

    judge(engine.scheduler.timer, lane=False)
    judge(engine.scheduler.lane_timer, lane=True)
    decode_timer = engine.scheduler.decode_timer
    learn_decode = decode_timer.record

    def judged_decode(rows: int, context: int, seconds: float, beside_lane: bool) -> None:
        predicted = decode_timer.estimate_s(rows, context, beside_lane)
        if predicted is not None and engine.scheduler.timer.steps > 20:
            errors["decode_beside_lane" if beside_lane else "decode_all_threads"].append(
                (predicted - seconds) / seconds
            )
        learn_decode(rows, context, seconds, beside_lane)

    decode_timer.record = judged_decode  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    engine.add_request("warm-up", [(j * 31) % (vocab - 3) + 3 for j in range(600)], greedy)
    while engine.has_unfinished():
        engine.step()
    t0, i = time.monotonic(), 0
    while i < requests or engine.has_unfinished():
        while i < requests and times[i] <= time.monotonic() - t0:
            ids = [(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(int(prompts[i]))]
            params = SamplingParams(max_tokens=int(outputs[i]), ignore_eos=True, temperature=0.0)
            engine.add_request(f"r{i}", ids, params)
            i += 1
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        engine.step()
    return errors


def summary(errors: Sequence[float]) -> dict[str, float]:
    if not errors:
        return {"steps": 0}
    absolute = sorted(abs(e) for e in errors)
    return {
        "steps": len(errors),
        "median_error": statistics.median(errors),
        "median_abs_error": statistics.median(absolute),
        "p90_abs_error": absolute[int(0.9 * (len(absolute) - 1))],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefill-step-tokens",
        type=int,
        default=SchedulerConfig.prefill_step_tokens,
        help="the server's flag",
    )
    args = p.parse_args(argv)
    idle: list[tuple[int, float, float, float]] = []
    errors = run(args.rate, args.requests, args.threads, args.seed, idle, args.prefill_step_tokens)
    report = {
        "machine": machine_line(),
        "commit": git_commit(),
        "rate": args.rate,
        "requests": args.requests,
        "threads": args.threads,
        "prefill_step_tokens": args.prefill_step_tokens,
        **{name: summary(e) for name, e in errors.items()},
        "idle_steps_tokens_ms_predicted_ms_as_budget_steps_ms": idle,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
