"""Tensor parallelism's shard arithmetic: which slice of each weight a rank keeps, and what a shard
needs from its process group (`ShardComm`, which executor.parallel.TensorParallel provides). The split
rule itself is model/tp_split.py (torch-free: the planner reads it too). Starts no process.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from tailserve.errors import ConfigError
from tailserve.model.tp_split import TensorParallelSplit, tensor_parallel_split
from tailserve.weights.arch import ArchConfig
from tailserve.weights.formats import INT4_GROUP, Int4Groups, Int8Groups


class ShardComm(Protocol):
    """One rank's view of the group, as the model built on its shard uses it."""

    local_arch: ArchConfig

    def keep(self, name: str, t: torch.Tensor) -> torch.Tensor: ...
    def keep_int4(self, name: str, groups: Int4Groups) -> Int4Groups: ...
    def keep_int8_rows(self, name: str, groups: Int8Groups) -> Int8Groups: ...
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...
    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor: ...
    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor: ...


def check_shardable(arch: ArchConfig, size: int, weight_format: str) -> TensorParallelSplit:
    """The split for `size` ranks, or a ConfigError before anything starts."""
    split = tensor_parallel_split(arch.num_heads, arch.num_kv_heads, size)
    if arch.intermediate_size % size:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not divide the MLP width {arch.intermediate_size}"
        )
    if weight_format == "int4" and size > 1:
        # Row-parallel int4 weights split along K on the 32-wide groups.
        for what, width in (
            ("o_proj input", split.heads_per_rank * arch.head_dim),
            ("down_proj input", arch.intermediate_size // size),
        ):
            if width % INT4_GROUP:
                raise ConfigError(
                    f"int4 weights shard on {INT4_GROUP}-wide groups, but the {what} per rank is {width} "
                    f"at --tensor-parallel-size {size}; use another size or --weight-format bf16"
                )
    return split


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """Rows of the embedding and LM head a rank holds: ceil(V / N) each, the last one shorter."""
    per = -(-vocab_size // size)
    start = min(vocab_size, rank * per)
    return start, min(vocab_size, start + per)


def local_arch(arch: ArchConfig, split: TensorParallelSplit, rank: int) -> ArchConfig:
    """The shapes one rank's shard has: its heads, KV heads, MLP width and vocabulary rows."""
    start, stop = vocab_range(arch.vocab_size, split.size, rank)
    return dataclasses.replace(
        arch,
        num_heads=split.heads_per_rank,
        num_kv_heads=split.kv_heads_per_rank,
        intermediate_size=arch.intermediate_size // split.size,
        head_dim=arch.head_dim,
        vocab_size=stop - start,
    )


def shard_range(
    name: str, arch: ArchConfig, split: TensorParallelSplit, rank: int
) -> tuple[int, int, int] | None:
    """(axis, start, stop) of a Hugging Face-named tensor a rank keeps; None: every rank keeps it all."""
    hd, size = arch.head_dim, split.size
    heads, kv = split.heads(rank), split.kv_heads(rank)
    inter = arch.intermediate_size // size
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return 0, heads.start * hd, heads.stop * hd
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")) or name.endswith(
        ("self_attn.v_proj.weight", "self_attn.v_proj.bias")
    ):
        return 0, kv.start * hd, kv.stop * hd
    if name.endswith("self_attn.o_proj.weight"):
        return 1, heads.start * hd, heads.stop * hd
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return 0, rank * inter, (rank + 1) * inter
    if name.endswith("mlp.down_proj.weight"):
        return 1, rank * inter, (rank + 1) * inter
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, *vocab_range(arch.vocab_size, size, rank))
    return None


def shard_tensor(t: torch.Tensor, where: tuple[int, int, int] | None) -> torch.Tensor:
    """A rank's own copy of its slice (the full tensor can then be freed)."""
    if where is None:
        return t
    axis, start, stop = where
    part = t.narrow(axis, start, stop - start)
    return part if part.is_meta else part.contiguous().clone()


def shard_int4(groups: Int4Groups, where: tuple[int, int, int] | None) -> Int4Groups:
    """Int4 groups cut on group boundaries: rows for column-parallel, 32-wide K runs for row-parallel."""
    if where is None:
        return groups
    axis, start, stop = where
    if axis == 0:
        rows = slice(start, stop)
        return Int4Groups(
            np.ascontiguousarray(groups.codes[rows]),
            np.ascontiguousarray(groups.scale[rows]),
            np.ascontiguousarray(groups.zero[rows]),
        )
    if start % INT4_GROUP or stop % INT4_GROUP:
        raise ConfigError(f"int4 groups split along K at {start}..{stop}: not on {INT4_GROUP}-wide groups")
    g = slice(start // INT4_GROUP, stop // INT4_GROUP)
    return Int4Groups(
        np.ascontiguousarray(groups.codes[:, start:stop]),
        np.ascontiguousarray(groups.scale[:, g]),
        np.ascontiguousarray(groups.zero[:, g]),
    )


def shard_int8_rows(groups: Int8Groups, where: tuple[int, int, int] | None) -> Int8Groups:
    """Q8_0 groups of the LM head cut along the vocabulary (rows)."""
    if where is None:
        return groups
    _, start, stop = where
    return Int8Groups(groups.codes[start:stop].clone(), groups.scale[start:stop].clone())
