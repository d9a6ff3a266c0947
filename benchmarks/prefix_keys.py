"""A/B of the prefix cache's block keys: the KV block manager before issue 38 (Python's hash of
(parent, tokens), no check on a hit) against now (sha256_cbor keys, each hit checked), same run.

Replays what the engine asks of the block manager per request of a prefix-heavy workload (admission's
three read-only lookups, the admitting match, chunked prefill commits, one commit per decode step,
free), with no model. The old manager is loaded from git (`--old-rev`). Rounds alternate A and B, so
drift on a shared machine lands in both. Run: `python benchmarks/prefix_keys.py` (about 30 s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailserve.engine.block_keys import BlockKeys
from tailserve.engine.block_manager import KVCacheManager

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
CHUNK = 256  # prompt tokens per step (--max-num-batched-tokens' default)
OLD_REV = "c363d56~1"  # the tree before the new keys


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt token ids, output tokens)."""

    name: str
    requests: list[tuple[list[int], int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p, _ in self.requests)


def shared_system_prompt(n: int, rng: random.Random) -> Workload:
    """A 1024-token system prompt, then 64-512 tokens of the user's own; 64 tokens out."""
    system = [rng.randrange(3, 49152) for _ in range(1024)]
    requests = []
    for _ in range(n):
        user = [rng.randrange(3, 49152) for _ in range(rng.randint(64, 512))]
        requests.append((system + user, 64))
    return Workload("shared system prompt (1024 + 64-512 tokens, 64 out)", requests)


def multi_turn(n: int, rng: random.Random, turns: int = 6) -> Workload:
    """Conversations of `turns` turns, each resending the history: 200 tokens of system prompt, 64-256
    new tokens a turn, 128 tokens out (which the next turn resends)."""
    requests = []
    for _ in range(n // turns):
        history = [rng.randrange(3, 49152) for _ in range(200)]
        for _ in range(turns):
            history = history + [rng.randrange(3, 49152) for _ in range(rng.randint(64, 256))]
            requests.append((list(history), 128))
            history = history + [rng.randrange(3, 49152) for _ in range(128)]
    return Workload(f"multi-turn chat ({turns} turns, history resent)", requests)


def old_manager_class(rev: str) -> Any:
    """KVCacheManager as it was at `rev` (engine/block_manager.py imports only the standard library)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:src/tailserve/engine/block_manager.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType("old_block_manager")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(source, f"{rev}:block_manager.py", "exec"), module.__dict__)
    return module.KVCacheManager


def serve_one(kv: Any, seq_id: str, prompt: Sequence[int], out_tokens: int) -> int:
    """The block manager calls of one request, in the engine's order; its cached prompt tokens."""
    for _ in range(3):  # server admission, AsyncEngine.generate, Scheduler.add
        kv.cached_prefix_tokens(prompt)
    done = cached = int(kv.match_prefix(seq_id, prompt))
    tokens = list(prompt)
    while done < len(tokens):  # chunked prefill
        done = min(done + CHUNK, len(tokens))
        kv.allocate(seq_id, done)
        kv.commit(seq_id, tokens, done)
    for t in range(out_tokens):  # decode: one token a step
        tokens.append(3 + t)
        kv.allocate(seq_id, len(tokens))
        kv.commit(seq_id, tokens, len(tokens))
    kv.free(seq_id)
    return cached


def run_once(make: Callable[[], Any], workload: Workload) -> tuple[float, int]:
    """Seconds for the whole workload on a fresh manager, and the cached prompt tokens it found."""
    kv = make()
    t0 = time.perf_counter()
    cached = sum(serve_one(kv, f"r{i}", p, o) for i, (p, o) in enumerate(workload.requests))
    return time.perf_counter() - t0, cached


def key_cost_ns_per_token(reps: int = 200_000) -> tuple[float, float]:
    """(ns per token of one sha256_cbor block key, of the old Python hash), 16-token blocks."""
    keys = BlockKeys.from_seed("0")
    tokens = tuple(random.Random(1).randrange(49152) for _ in range(BLOCK))
    parent = keys.key(None, tokens)
    t0 = time.perf_counter()
    for _ in range(reps):
        keys.key(parent, tokens)
    new = time.perf_counter() - t0
    old_parent = hash((None, tokens))
    t0 = time.perf_counter()
    for _ in range(reps):
        hash((old_parent, tuple(tokens)))
    old = time.perf_counter() - t0
    return new / reps / BLOCK * 1e9, old / reps / BLOCK * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per workload")
    parser.add_argument("--rounds", type=int, default=5, help="alternating A/B rounds")
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old block manager")
    args = parser.parse_args()
    old_cls = old_manager_class(args.old_rev)
    blocks = 20_000  # no eviction: every request finds what the ones before it cached
    makers: dict[str, Callable[[], Any]] = {
        "old keys (hash)": lambda: old_cls(blocks, BLOCK),
        "new keys (sha256_cbor)": lambda: KVCacheManager(blocks, BLOCK, keys=BlockKeys.from_seed("0")),
    }
    new_ns, old_ns = key_cost_ns_per_token()
    print(f"one block key: sha256_cbor {new_ns:.0f} ns/token, Python hash {old_ns:.0f} ns/token")
    rng = random.Random(0)
    for workload in (shared_system_prompt(args.requests, rng), multi_turn(args.requests, rng)):
        times: dict[str, list[float]] = {name: [] for name in makers}
        cached: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, make in makers.items():
                seconds, cached[name] = run_once(make, workload)
                times[name].append(seconds)
        n = len(workload.requests)
        print(f"\n{workload.name}: {n} requests, {workload.prompt_tokens / n:.0f} prompt tokens each")
        for name, t in times.items():
            per_request_us = statistics.median(t) / n * 1e6
            hit = cached[name] / workload.prompt_tokens
            print(f"  {name:24s} {per_request_us:8.1f} us/request (median of {len(t)}), {hit:.0%} cached")
        old, new = (statistics.median(t) for t in times.values())
        print(f"  new / old: {new / old:.2f}x, +{(new - old) / n * 1e6:.1f} us/request")


if __name__ == "__main__":
    main()
