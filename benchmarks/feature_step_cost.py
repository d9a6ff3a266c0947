"""What the per-request features cost a decode step: R streams decoding together on the in-process
engine (LLMEngine, the default model), plain vs every row asking for penalties + logprobs + a JSON
schema grammar. Prints the median step time of each and their ratio (issue 14's target: <= 1.25x).

Run on an idle machine: `python benchmarks/feature_step_cost.py` (`--steps 2 --warmup 1` smoke-runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import GrammarSpec, SamplingParams

# At least 100 integers: every row stays inside its grammar for the whole measurement.
SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
    "required": ["values"],
    "additionalProperties": False,
}


def params(featured: bool, seed: int, max_tokens: int) -> SamplingParams:
    """Plain: temperature sampling and nothing else. Featured: the same plus penalties, logprobs and a grammar."""
    if not featured:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=5,
        grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
    )


def decode_step_ms(engine: LLMEngine, featured: bool, rows: int, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each engine step once all `rows` requests decode together."""
    tok = engine.tokenizer
    for i in range(rows):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"List {i + 20} numbers as JSON."}])
        engine.add_request(f"{'f' if featured else 'p'}{i}", prompt, params(featured, i, warmup + steps + 64))
    return timed_decode_steps(engine, rows, warmup, steps)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per configuration")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--weight-format", default="auto", help="as `tailserve serve` (auto: what the gate picks)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    config = EngineConfig(
        model=ModelConfig(
            model=args.model, weight_format=args.weight_format, device=args.device, max_model_len=2048
        ),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20),
        scheduler=SchedulerConfig(max_num_seqs=max(args.rows, 16), max_num_batched_tokens=2048),
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(config)
    print(
        f"{engine.model_name}, {args.rows} streams, weight format {engine.weight_format}, "
        f"torch threads {torch.get_num_threads()}, {args.device}"
    )
    plain = decode_step_ms(engine, False, args.rows, args.warmup, args.steps)
    featured = decode_step_ms(engine, True, args.rows, args.warmup, args.steps)
    p, f = statistics.median(plain), statistics.median(featured)
    print(f"plain step     median {p:8.2f} ms  (min {min(plain):.2f})")
    print(
        f"featured step  median {f:8.2f} ms  (min {min(featured):.2f})  penalties + logprobs=5 + JSON schema"
    )
    print(f"ratio {f / p:.3f}x (target <= 1.25x)")


if __name__ == "__main__":
    main()
