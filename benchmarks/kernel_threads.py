"""Engine steps at 1 thread vs N threads, in-process on the default model (the fused CPU kernels split
their matmuls and decode attention over `--num-threads`; torch's ops follow the same count).

Per thread count: a decode step of 1 stream and of R streams, and a prefill step of one P-token
prompt. The thread counts alternate round by round (A B A B ...), so the machine's drift falls on
both; each figure is the median over rounds of each round's median, with the per-round medians shown.

Run on an idle machine: `python benchmarks/kernel_threads.py` (`--rounds 1 --steps 3` smoke-runs it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from feature_step_cost import timed_decode_steps

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams
from tailserve.model import cpu_kernels


def decode_steps_ms(engine: LLMEngine, rows: int, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each step once `rows` requests all decode (64-token prompts)."""
    for i in range(rows):
        prompt = [(i * 37 + j) % 1000 + 100 for j in range(64)]
        engine.add_request(
            f"d{rows}-{i}", prompt, SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True)
        )
    return timed_decode_steps(engine, rows, warmup, steps)


def prefill_step_ms(engine: LLMEngine, tokens: int, repeats: int) -> list[float]:
    """Milliseconds of the one step that prefills a fresh `tokens`-token prompt (prefix caching off)."""
    times = []
    for r in range(repeats):
        prompt = [(r * 101 + j * 7) % 5000 + 100 for j in range(tokens)]
        engine.add_request(f"p{tokens}-{r}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
        while engine.has_unfinished():
            engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to compare")
    ap.add_argument("--rows", type=int, default=16, help="streams of the batched decode step")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the prefill step")
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the thread counts")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per figure and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    config = EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=2048),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=max(args.rows, 16), max_num_batched_tokens=max(2048, args.prompt)
        ),
    )
    engine = LLMEngine(config)
    print(
        f"{engine.model_name}, weight format {engine.weight_format}, threads {args.threads}, {args.rounds} rounds"
    )
    figures = ("1 stream", f"{args.rows} streams", f"prefill {args.prompt}")
    rounds: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        order = args.threads if rnd % 2 == 0 else list(reversed(args.threads))
        for n in order:
            torch.set_num_threads(n)
            got = cpu_kernels.sync_threads()
            samples = {
                figures[0]: decode_steps_ms(engine, 1, args.steps, args.warmup),
                figures[1]: decode_steps_ms(engine, args.rows, args.steps, args.warmup),
                figures[2]: prefill_step_ms(engine, args.prompt, max(3, args.steps // 6))[1:],
            }
            for name, values in samples.items():
                rounds.setdefault((n, name), []).append(statistics.median(values))
            print(
                f"round {rnd + 1} threads {n} (kernels {got}): "
                + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in samples.items()),
                flush=True,
            )
    base = args.threads[0]
    print(
        f"\n| figure | {' | '.join(f'{n} thread(s) ms' for n in args.threads)} | "
        + " | ".join(f"{base}/{n}" for n in args.threads[1:])
        + " |"
    )
    print("| --- |" + " ---: |" * (2 * len(args.threads) - 1))
    for name in figures:
        med = {n: statistics.median(rounds[(n, name)]) for n in args.threads}
        cells = [f"{med[n]:.1f} ({', '.join(f'{v:.1f}' for v in rounds[(n, name)])})" for n in args.threads]
        ratios = [f"{med[base] / med[n]:.2f}x" for n in args.threads[1:]]
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main()
