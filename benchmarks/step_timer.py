"""Engine step timers on the in-process engine, and a worker that prints one round of them as JSON.

Imports only what every commit of tailserve has had (tailserve.config, the engine's LLMEngine and
SamplingParams), so `engine_steps.py commits` can run the worker against an older tree's source
(PYTHONPATH=that tree's src) and compare two commits in the same run.

    PYTHONPATH=src .venv/bin/python benchmarks/step_timer.py --rows 16 --prompt 1600
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams


def engine_for(
    model: str,
    rows: int,
    step_tokens: int,
    threads: int | None = None,
    weight_format: str = "auto",
    device: str = "cpu",
    policy: str = "slo",
    context: int = 0,
) -> LLMEngine:
    """An engine of `model` with room for `rows` streams and `step_tokens` a step, and for streams of
    `context` prompt tokens to decode a few hundred more; prefix caching off, so a repeated prompt is
    prefilled again. `policy` "fcfs": no prefill cap splits a prompt."""
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model=model,
                weight_format=weight_format,
                device=device,
                max_model_len=max(2048, step_tokens + 64, context + 256),
                num_threads=threads,
            ),
            cache=CacheConfig(kv_cache_memory_bytes=kv_bytes(rows, context), enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max(rows, 16), max_num_batched_tokens=max(2048, step_tokens), policy=policy
            ),
        )
    )


def kv_bytes(rows: int, context: int) -> int:
    """A KV pool that holds `rows` streams of `context` prompt tokens and the decode tokens
    `decode_steps_ms` asks of them, at up to 64 KiB a token (the default model takes 23 KiB): without
    room for all, the streams preempt each other and never all decode at once. At least 512 MiB."""
    tokens = rows * (context + 64 * rows + 128)
    return max(512 << 20, tokens * (64 << 10))


def timed_decode_steps(engine: LLMEngine, rows: int, warmup: int, steps: int) -> list[float]:
    """With `rows` requests added: prefill them all, then the milliseconds of each of `steps` steps
    in which all of them decode (after `warmup` untimed ones); aborts them after."""
    engine.last_plan = None
    while engine.last_plan is None or engine.last_plan.num_decodes < rows:  # prefill everyone first
        engine.step()
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        engine.step()
        if k >= warmup:
            times.append(1000 * (time.perf_counter() - start))
        assert engine.last_plan is not None and engine.last_plan.num_decodes == rows, "a stream ended early"
    engine.abort_all()
    return times


def prompt_ids(engine: LLMEngine, tokens: int, salt: int) -> list[int]:
    """`tokens` ids inside the model's vocabulary, a different sequence for each salt."""
    vocab = engine.arch.vocab_size
    return [(salt * 7919 + j * 31) % (vocab - 3) + 3 for j in range(tokens)]


def decode_steps_ms(engine: LLMEngine, rows: int, steps: int, warmup: int, context: int = 64) -> list[float]:
    """Milliseconds of each step once `rows` requests of `context`-token prompts all decode (the first
    ones decode while the later ones prefill, on the prefill lane at 2+ threads: tens of steps for a
    long prompt, so each gets room for them)."""
    room = engine.max_model_len - context
    for i in range(rows):
        prompt = prompt_ids(engine, context, i)
        params = SamplingParams(max_tokens=min(room, steps + warmup + 8 + 64 * rows), ignore_eos=True)
        engine.add_request(f"d{rows}-{i}-{time.monotonic_ns()}", prompt, params)
    return timed_decode_steps(engine, rows, warmup, steps)


def prefill_step_ms(engine: LLMEngine, tokens: int, repeats: int) -> list[float]:
    """Milliseconds of the one step that prefills a fresh `tokens`-token prompt, `repeats` times."""
    times = []
    for r in range(repeats):
        prompt = prompt_ids(engine, tokens, 1000 + r)
        engine.add_request(f"p{tokens}-{r}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
        while engine.has_unfinished():
            engine.step()
    return times


def one_round(
    engine: LLMEngine, rows: int, prompt: int, steps: int, warmup: int, context: int = 64
) -> dict[str, float]:
    """The medians of one round: a decode step of 1 stream and of `rows` (each stream's prompt
    `context` tokens), and a `prompt`-token prefill step (its first run dropped), in milliseconds."""
    at = "" if context == 64 else f" at {context} tokens"
    return {
        f"decode step, 1 stream{at}": statistics.median(decode_steps_ms(engine, 1, steps, warmup, context)),
        f"decode step, {rows} streams{at}": statistics.median(
            decode_steps_ms(engine, rows, steps, warmup, context)
        ),
        f"prefill step, {prompt} tokens": statistics.median(prefill_step_ms(engine, prompt, 4)[1:]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one round of engine step timings, as JSON")
    parser.add_argument("--model", default="default")
    parser.add_argument("--weight-format", default="int4")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1600)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens of each decoding stream")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--policy", default="slo", help="fcfs: no prefill cap splits the prompt (past 2,048 tokens)"
    )
    args = parser.parse_args(argv)
    import tailserve

    engine = engine_for(
        args.model,
        args.rows,
        args.prompt,
        args.threads,
        args.weight_format,
        policy=args.policy,
        context=args.context,
    )
    figures = one_round(engine, args.rows, args.prompt, args.steps, args.warmup, args.context)
    print(
        json.dumps({"source": tailserve.__file__, "weight_format": engine.weight_format, "figures": figures})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
