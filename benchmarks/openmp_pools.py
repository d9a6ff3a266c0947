"""What a step costs on the thread that loaded the model, on a new thread while the loading thread's
OpenMP pool is alive (the server's engine thread before `openmp.release_pool`), and on a new thread
after the loading thread released it (the server now).

    .venv/bin/python benchmarks/openmp_pools.py --threads 2 --rounds 3

An in-process engine (default model, prefix caching off, 256-token step budget) runs, in each
place, a 375-token prompt (two chunks: the long-tail workload's long prompt at x0.25) and a
64-token decode of one sequence. Rounds interleave the three places; the table gives each one's
median over all rounds and its ratio to the loading thread. Never run beside another measurement.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable

from machine import git_commit, machine_line

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
from tailserve.model import openmp

PLACES = ("loading thread", "new thread, loader's pool alive", "new thread, loader's pool released")


def measure(engine: LLMEngine, reps: int, prompt_tokens: int, rng: random.Random) -> tuple[float, float]:
    """Median seconds of a whole prompt (max_tokens 1) and of one decode step, over `reps` each."""

    def run(tokens: int, max_tokens: int) -> tuple[float, int]:
        engine.add_request(
            f"r{rng.random()}",
            [rng.randrange(1000, 20000) for _ in range(tokens)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        )
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return time.perf_counter() - t0, steps

    run(prompt_tokens, 1)  # this thread's pool and scratch warmed up
    prompt = statistics.median(run(prompt_tokens, 1)[0] for _ in range(reps))
    decodes = []
    for _ in range(max(1, reps // 4)):
        seconds, steps = run(8, 65)
        decodes.append(seconds / steps)
    return prompt, statistics.median(decodes)


def on_new_thread(fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    box: list[tuple[float, float]] = []
    worker = threading.Thread(target=lambda: box.append(fn()))
    worker.start()
    worker.join()
    return box[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=12, help="prompts per place and round")
    p.add_argument("--prompt-tokens", type=int, default=375)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.reps < 1 or args.prompt_tokens < 1:
        p.error("--rounds, --reps and --prompt-tokens must be at least 1")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(num_threads=args.threads),
            cache=CacheConfig(enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )
    rng = random.Random(0)
    results: dict[str, list[tuple[float, float]]] = {place: [] for place in PLACES}

    def here() -> tuple[float, float]:
        return measure(engine, args.reps, args.prompt_tokens, rng)

    for _ in range(args.rounds):
        results[PLACES[0]].append(here())  # also (re)creates the loading thread's pool
        results[PLACES[1]].append(on_new_thread(here))
        released = openmp.release_pool()
        results[PLACES[2]].append(on_new_thread(here))
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(f"# {' '.join(sys.argv)} at {stamp} on {machine_line()}, commit {git_commit()}")
    print(f"# {args.threads} threads, {args.rounds} rounds x {args.reps} prompts; pool released: {released}")
    base_p = statistics.median(p for p, _ in results[PLACES[0]])
    base_d = statistics.median(d for _, d in results[PLACES[0]])
    print(f"| where the steps run | {args.prompt_tokens}-token prompt | ratio | decode step | ratio |")
    print("|---|---:|---:|---:|---:|")
    for place in PLACES:
        prompt = statistics.median(p for p, _ in results[place])
        decode = statistics.median(d for _, d in results[place])
        print(
            f"| {place} | {prompt * 1000:.1f} ms | {prompt / base_p:.2f} | {decode * 1000:.2f} ms | "
            f"{decode / base_d:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
