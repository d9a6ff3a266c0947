"""The paged KV pool's bookkeeping: reference-counted blocks, prefix cache by chained block hashes, LRU.

A block is free when no sequence references it; a free block may still hold a cached prefix and is
reused by a later hit until it is evicted (least recently freed first). This module never touches
tensors: it hands out block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = int


def chain_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Hash of a full block given its parent's hash: equal hashes mean equal whole prefixes."""
    return hash((parent, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class SeqBlocks:
    """One sequence's block table and how many of its full blocks are registered in the prefix cache."""

    table: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)


class BlockPool:
    """Fixed set of blocks with reference counts, a hash -> block map and an LRU queue of free blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, least recently freed first; cached ones stay findable until popped.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks (evicting cached free blocks, LRU first); raises if fewer than n are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix-cache hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue (tail blocks first to go)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that this block holds the full prefix identified by block_hash."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached (here or in an identical block)
        block.block_hash = block_hash
        self._cached[block_hash] = block_id


class KVCacheManager:
    """Block tables per sequence over one BlockPool, with prefix-cache lookups and hit counters."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._seqs: dict[str, SeqBlocks] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._seqs[seq_id].table

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so the sequence can hold num_tokens tokens."""
        have = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Start a sequence, reusing cached full blocks of its prefix; returns the cached token count.

        At least the last token is always left to compute (its logits are needed).
        """
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already has blocks")
        seq = SeqBlocks()
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        parent: BlockHash | None = None
        for i in range(max_blocks):
            h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            self.pool.touch(block_id)
            seq.table.append(block_id)
            seq.hashes.append(h)
            parent = h
        self._seqs[seq_id] = seq
        return len(seq.table) * bs

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` match_prefix would find cached now, changing nothing
        (no LRU touch, no hit counters): what admission prices a prompt by. Safe to call from another
        thread than the step loop's: each lookup is one dict read, and a block evicted meanwhile only
        makes the count stale, as an estimate may be."""
        bs = self.block_size
        parent: BlockHash | None = None
        found = 0
        for i in range((len(token_ids) - 1) // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if self.pool.lookup(parent) is None:
                break
            found += bs
        return found

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Record one admitted request's prefix-cache lookup (tokens asked for, tokens found)."""
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the sequence's table to hold num_tokens tokens; False (and no change) if the pool is short."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.pool.num_free:
            return False
        seq = self._seqs.setdefault(seq_id, SeqBlocks())
        seq.table.extend(self.pool.allocate(need))
        return True

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full block whose KV is now computed, so later requests can reuse it."""
        seq = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(seq.table))
        parent = seq.hashes[-1] if seq.hashes else None
        for i in range(len(seq.hashes), full):
            h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            self.pool.register(seq.table[i], h)
            seq.hashes.append(h)
            parent = h

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Share the parent's full blocks with a new child; a partial tail block gets a private copy.

        Returns (source, destination) block ids whose KV the caller must copy, or None.
        """
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise KeyError(f"sequence {child_id} already has blocks")
        full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0 and len(parent.table) > full
        if partial and self.pool.num_free < 1:
            raise MemoryError("no free KV block for the forked tail")
        child = SeqBlocks(table=list(parent.table[:full]), hashes=list(parent.hashes[:full]))
        for block_id in child.table:
            self.pool.touch(block_id)
        copy = None
        if partial:
            (dst,) = self.pool.allocate(1)
            child.table.append(dst)
            copy = (parent.table[full], dst)
        self._seqs[child_id] = child
        return copy

    def free(self, seq_id: str) -> None:
        """Release every block the sequence holds (idempotent)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.release(seq.table)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
