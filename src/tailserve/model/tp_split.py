"""The tensor-parallel split rule: which heads, KV heads and widths each of N ranks holds.

One function decides it for both `tailserve plan --gpus N` and the runtime (`model.parallel`), so
the plan and the server can never disagree. Pure arithmetic: imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.errors import ConfigError


@dataclass(frozen=True)
class TensorParallelSplit:
    """Per-rank shard of the attention heads and the MLP width at tensor-parallel size `size`.

    KV heads split evenly when `num_kv_heads % size == 0`; otherwise (`size % num_kv_heads == 0`)
    each rank keeps one KV head, replicated on the `size // num_kv_heads` ranks of its group.
    """

    size: int
    num_heads: int
    num_kv_heads: int
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replicated: bool

    def heads(self, rank: int) -> range:
        """The query heads rank `rank` holds (global indices)."""
        return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank `rank` holds; with replication, the one its query heads read."""
        if self.kv_replicated:
            first = rank * self.num_kv_heads // self.size
            return range(first, first + 1)
        return range(rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank)

    def describe(self) -> str:
        """One line for the start-up log and the plan report."""
        how = (
            f"replicated: each KV head on {self.size // self.num_kv_heads} ranks"
            if self.kv_replicated
            else "split"
        )
        return (
            f"tensor parallel {self.size}: {self.heads_per_rank} of {self.num_heads} query heads and "
            f"{self.kv_heads_per_rank} of {self.num_kv_heads} KV heads per rank (KV heads {how})"
        )


def tensor_parallel_split(num_heads: int, num_kv_heads: int, size: int) -> TensorParallelSplit:
    """The split at `size` ranks, or a ConfigError saying why this model cannot run at that size."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be at least 1, got {size}")
    if num_heads % size:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not divide the model's {num_heads} query heads; "
            f"use one of {', '.join(str(n) for n in divisors(num_heads))}"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {size} neither divides the model's {num_kv_heads} KV heads nor is "
            "a multiple of them, so they can be neither split nor replicated evenly"
        )
    replicated = num_kv_heads % size != 0
    return TensorParallelSplit(
        size=size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        heads_per_rank=num_heads // size,
        kv_heads_per_rank=1 if replicated else num_kv_heads // size,
        kv_replicated=replicated,
    )


def divisors(n: int) -> list[int]:
    """Every positive divisor of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def allreduce_bytes_per_token(num_layers: int, hidden_size: int, size: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends per token per step: a ring all-reduce moves 2 (N-1)/N of the tensor.

    Each layer all-reduces twice (after o and after down) and the vocab-parallel embedding once,
    every one a hidden-wide row per token (float32 on the CPU path). Zero at size 1.
    """
    if size <= 1:
        return 0
    tensors = 2 * num_layers + 1
    return tensors * hidden_size * element_bytes * 2 * (size - 1) // size
