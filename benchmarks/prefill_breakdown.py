"""Where one prompt's prefill step goes, in process: the step of a fresh P-token prompt (`fcfs`, so
nothing splits it) with every call into the fused C kernels timed from Python, summed per kernel and
grouped as int4 matmuls / prompt attention / SiLU x up / norms / RoPE + KV write, the rest being the
step's Python, torch ops and the LM head. The median step of --repeats (its first run dropped) and
each group's median. Never run beside another measurement.

    .venv/bin/python benchmarks/prefill_breakdown.py --tokens 1600 4000 --threads 2   # ~1 min
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from machine import git_commit, machine_line
from step_timer import prompt_ids

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import SamplingParams

GROUPS = {
    "int4 matmuls": (
        "ts_q4_prefill_matmul",
        "ts_q4_prefill_silu_matmul",
        "ts_q4_matmul",
        "ts_q8_matmul",
        "ts_q4a8_prefill_matmul",
    ),
    "prompt attention": ("ts_paged_prompt_attention", "ts_paged_decode_attention"),
    "SiLU x up": ("ts_silu_mul",),
    "norms": ("ts_rms_norm", "ts_add_rms_norm"),
    "RoPE + KV write": ("ts_rope_write_kv",),
}


def timed(spent: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        spent[name] += time.perf_counter() - start
        return out

    return call


def instrument(spent: dict[str, float]) -> None:
    """Every loaded kernel library's functions of GROUPS replaced by timed wrappers."""
    names = [n for group in GROUPS.values() for n in group]
    for lib in [o for o in gc.get_objects() if type(o) is ctypes.CDLL and "cpu_kernels" in str(o._name)]:
        for name in names:
            if hasattr(lib, name):
                setattr(lib, name, timed(spent, name, getattr(lib, name)))


def engine(tokens: int, threads: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                model="default", weight_format="int4", max_model_len=tokens + 64, num_threads=threads
            ),
            cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=tokens, policy="fcfs"),
        )
    )


def breakdown(tokens: int, threads: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the step and of each group over `repeats` steps (a warm-up dropped)."""
    eng = engine(tokens, threads)
    spent: dict[str, float] = defaultdict(float)
    instrument(spent)
    rounds: list[dict[str, float]] = []
    for r in range(repeats + 1):
        spent.clear()
        eng.add_request(f"p{tokens}-{r}", prompt_ids(eng, tokens, 1000 + r), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        eng.step()
        total = 1000 * (time.perf_counter() - start)
        assert not eng.has_unfinished(), "the prompt took more than one step"
        row = {group: 1000 * sum(spent[n] for n in names) for group, names in GROUPS.items()}
        row["the rest"] = total - sum(row.values())
        row["step"] = total
        if r:
            rounds.append(row)
    return {key: statistics.median(row[key] for row in rounds) for key in rounds[0]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1600, 4000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# `benchmarks/prefill_breakdown.py --threads {args.threads}` at {stamp} on {machine_line()}, commit {git_commit()}"
    )
    keys = ["step", *GROUPS, "the rest"]
    print(f"\n| prompt | {' | '.join(keys)} |\n| ---: |{' ---: |' * len(keys)}")
    for tokens in args.tokens:
        row = breakdown(tokens, args.threads, args.repeats)
        cells = " | ".join(f"{row[k]:.1f}" for k in keys)
        print(f"| {tokens} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
