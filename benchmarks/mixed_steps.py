"""What a step that carries prompt tokens costs the streams it carries, in process (no HTTP), and
whether a core of its own for prefill would keep decode steps steady. Never beside another measurement.

    .venv/bin/python benchmarks/mixed_steps.py mixed --decodes 2 --tokens 16 64 256   # ~1 min
    .venv/bin/python benchmarks/mixed_steps.py split --decodes 2 8 16 --tokens 256    # ~3 min

- `mixed`: N streams decode on an engine at --threads (the server's 2 by default); each round a fresh
  prompt of T tokens joins, and the step that carries it (all T tokens and the N decodes) is timed,
  then three decode-only steps. Medians over rounds: what every running stream pays for a prompt.
  First come first served, so no prefill cap splits the prompt.
- `split`: two engines in one process, one compute thread each (the kernels run on the calling
  thread): N streams decode on one, while a second Python thread prefills T-token prompts on the
  other, back to back. The decode steps alone and beside the prefill, and the prefill alone and
  beside the decodes: the interference (GIL, memory) a prefill lane on the other core would cause.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from machine import git_commit, machine_line
from step_timer import engine_for, prompt_ids

from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams

DECODE_TOKENS = 1900  # a stream's answer: longer than any run, inside the 2,048-token context


def start_streams(engine: LLMEngine, n: int) -> None:
    """`n` streams of 64-token prompts, prefilled, all decoding from the next step on."""
    for i in range(n):
        params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
        engine.add_request(f"d{i}-{time.monotonic_ns()}", prompt_ids(engine, 64, i), params)
    while engine.last_plan is None or engine.last_plan.num_decodes < n:
        engine.step()


def step_ms(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return 1000 * (time.perf_counter() - start)


def prefill_ms(engine: LLMEngine, tokens: int, salt: int) -> float:
    """Milliseconds to prefill one fresh `tokens`-token prompt (to its first token) on an idle engine."""
    engine.add_request(
        f"p{salt}-{time.monotonic_ns()}", prompt_ids(engine, tokens, salt), SamplingParams(max_tokens=1)
    )
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (time.perf_counter() - start)


def prefill_until(stop: threading.Event, engine: LLMEngine, tokens: int, out: list[float]) -> None:
    """Prefill fresh prompts back to back until `stop`, each one's milliseconds into `out`."""
    salt = 100
    while not stop.is_set():
        out.append(prefill_ms(engine, tokens, salt))
        salt += 1


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def run_mixed(args: argparse.Namespace) -> list[str]:
    lines = [
        "| decodes | prompt tokens | step with the prompt, ms | decode-only step, ms | rounds |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in args.decodes:
        for tokens in args.tokens:
            engine = engine_for(
                args.model, n + 1, tokens + n, args.threads, args.weight_format, policy="fcfs"
            )
            start_streams(engine, n)
            mixed, decode = [], []
            for r in range(args.warmup + args.rounds):
                engine.add_request(f"p{r}", prompt_ids(engine, tokens, 100 + r), SamplingParams(max_tokens=1))
                took = step_ms(engine)
                assert engine.last_plan is not None and engine.last_plan.num_prefill_tokens == tokens, (
                    "the prompt was split"
                )
                after = [step_ms(engine) for _ in range(3)]
                if r >= args.warmup:
                    mixed.append(took)
                    decode += after
            engine.abort_all()
            lines.append(
                f"| {n} | {tokens} | {statistics.median(mixed):.1f} | {statistics.median(decode):.1f} | {args.rounds} |"
            )
            print(lines[-1], flush=True)
    return lines


def run_split(args: argparse.Namespace) -> list[str]:
    lines = [
        "| decodes | prompt tokens | decode step alone: median / P99 ms | beside prefill: median / P99 ms | prefill alone ms | beside decodes ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in args.decodes:
        for tokens in args.tokens:
            decoder = engine_for(args.model, max(n, 16), 256, 1, args.weight_format)
            prefiller = engine_for(args.model, 16, max(tokens, 256), 1, args.weight_format)
            start_streams(decoder, n)
            alone = [step_ms(decoder) for _ in range(args.steps)]
            stop, beside_prefill = threading.Event(), list[float]()
            worker = threading.Thread(target=prefill_until, args=(stop, prefiller, tokens, beside_prefill))
            worker.start()
            time.sleep(0.5)
            beside = [step_ms(decoder) for _ in range(args.steps)]
            stop.set()
            worker.join()
            prefill_alone = [prefill_ms(prefiller, tokens, 900 + i) for i in range(8)]
            decoder.abort_all()
            lines.append(
                f"| {n} | {tokens} | {statistics.median(alone):.1f} / {percentile(alone, 99):.1f} | "
                f"{statistics.median(beside):.1f} / {percentile(beside, 99):.1f} | "
                f"{statistics.median(prefill_alone):.1f} | {statistics.median(beside_prefill):.1f} ({len(beside_prefill)} prompts) |"
            )
            print(lines[-1], flush=True)
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mixed = sub.add_parser("mixed", help="the step that carries a prompt, beside N decodes")
    mixed.add_argument("--threads", type=int, default=2)
    mixed.add_argument("--rounds", type=int, default=20)
    mixed.add_argument("--warmup", type=int, default=3)
    split = sub.add_parser("split", help="decode on one core while the other prefills")
    split.add_argument("--steps", type=int, default=300, help="timed decode steps, alone and beside")
    for p in (mixed, split):
        p.add_argument("--decodes", type=int, nargs="+", default=[2])
        p.add_argument("--tokens", type=int, nargs="+", default=[256])
        p.add_argument("--model", default="default")
        p.add_argument("--weight-format", default="int4")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# `benchmarks/mixed_steps.py {args.command}` at {stamp} on {machine_line()}, commit {git_commit()}",
        flush=True,
    )
    lines = run_mixed(args) if args.command == "mixed" else run_split(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
