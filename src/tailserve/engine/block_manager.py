"""The paged KV pool's bookkeeping: reference-counted blocks, a prefix cache of full blocks, LRU.

A full block is cached under its key (engine/block_keys.py) with the content the key was computed
from; a hit must match that content in full and follow the very entry its KV was computed after, so
a key collision is a miss (counted), never a wrong reuse. A free block keeps its cached content until
evicted (least recently freed first). With a KVEventLog, every entry cached, evicted or cleared is
recorded for routers outside the process. This module never touches tensors: it hands out block ids.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tailserve.engine.block_keys import BlockKey, BlockKeys, ExtraKeys, first_block_extra
from tailserve.engine.kv_events import Cleared, KVEventLog, Removed, Stored

ROOT_SERIAL = 0  # what a prompt's first block follows


# What a full block's key is computed from: (the parent's key, None for the root; token ids; extra keys).
# A plain tuple: a lookup builds one per block, and compares it in full.
BlockContent = tuple[BlockKey | None, tuple[int, ...], ExtraKeys]


@dataclass(frozen=True)
class CachedBlock:
    """A block's entry in the prefix cache. `serial` is unique to this entry and never reused; the
    next block of a prefix names it as `parent_serial`, so a prefix matches only through the very
    blocks its KV was computed after, whatever the hash function."""

    key: BlockKey
    content: BlockContent
    serial: int
    parent_serial: int
    block_id: int


class Link(NamedTuple):
    """One full block of a sequence: its key, and the serial of the cache entry holding its content
    (None: not cached, and then nothing after it is cached for this sequence)."""

    key: BlockKey | None
    serial: int | None


ROOT_LINK = Link(None, ROOT_SERIAL)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    cached: CachedBlock | None = None


@dataclass
class SeqBlocks:
    """One sequence's block table, the chain of its full blocks seen by the cache, and the first
    block's extra keys (its cache_salt)."""

    table: list[int] = field(default_factory=list)
    chain: list[Link] = field(default_factory=list)
    extra: ExtraKeys = None


class BlockPool:
    """Fixed set of blocks with reference counts, the cache entries by key and by content, and an LRU
    queue of free blocks."""

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        """`events`: where cache changes are recorded (None: nowhere, the default)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, least recently freed first; cached ones stay findable until popped.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, int] = {}  # key -> the block holding it
        # The same entries by content (compared in full): a lookup of a cached prefix hashes nothing
        # again, and finds exactly the entry its key names, a key being a function of the content.
        self._by_content: dict[BlockContent, CachedBlock] = {}
        self._serials = itertools.count(ROOT_SERIAL + 1)
        self.events = events

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
            self._uncache(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def _uncache(self, block: Block) -> None:
        if block.cached is not None:
            del self._cached[block.cached.key]
            del self._by_content[block.cached.content]
            if self.events is not None:
                self.events.record(Removed(block.cached.key))
            block.cached = None

    def cached_keys(self) -> list[BlockKey]:
        """The key of every block the prefix cache holds now (what the KV events describe)."""
        return list(self._cached)

    def clear_cache(self) -> int:
        """Forget every cached entry, blocks in use included (nothing after them is found again; their
        sequences keep their KV); returns how many entries there were. Recorded as one Cleared."""
        cleared = 0
        for block in self.blocks:
            if block.cached is not None:
                del self._cached[block.cached.key]
                del self._by_content[block.cached.content]
                block.cached = None
                cleared += 1
        if self.events is not None:
            self.events.record(Cleared())
        return cleared

    def _entry(self, key: BlockKey) -> CachedBlock | None:
        block_id = self._cached.get(key) if self.enable_prefix_caching else None
        # None also when another thread's eviction comes between the two reads.
        return self.blocks[block_id].cached if block_id is not None else None

    def find(self, content: BlockContent, parent_serial: int) -> CachedBlock | None:
        """The entry holding exactly this content after the entry `parent_serial`, else None (the same
        content after another entry: the block it followed was evicted and cached again)."""
        entry = self._by_content.get(content) if self.enable_prefix_caching else None
        return entry if entry is not None and entry.parent_serial == parent_serial else None

    def cached_key(self, content: BlockContent) -> BlockKey | None:
        """The key of this content when a block holds it (saves hashing it again)."""
        entry = self._by_content.get(content)
        return entry.key if entry is not None else None

    def collides(self, key: BlockKey, content: BlockContent) -> bool:
        """Whether `key` is cached with other content: a hash collision, never reused."""
        entry = self._entry(key)
        return entry is not None and entry.content != content

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

    def register(self, block_id: int, key: BlockKey, content: BlockContent, parent_serial: int) -> int | None:
        """Cache the block's content under `key`; returns the serial the sequence's next block follows:
        this entry's, or that of an entry already holding the same content. None when the key is held
        by other content still in use (a collision): nothing after this block is cached for the sequence."""
        if not self.enable_prefix_caching:
            return None
        held = self._entry(key)
        if held is not None:
            if held.content == content and held.parent_serial == parent_serial:
                return held.serial
            if self.blocks[held.block_id].ref_count > 0:
                return None
            self._uncache(self.blocks[held.block_id])  # a free block's stale or colliding entry gives way
        entry = CachedBlock(key, content, next(self._serials), parent_serial, block_id)
        self.blocks[block_id].cached = entry
        self._cached[key] = block_id
        self._by_content[content] = entry
        if self.events is not None:
            self.events.record(Stored(key, *content))
        return entry.serial


class KVCacheManager:
    """Block tables per sequence over one BlockPool, with prefix-cache lookups and hit counters."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        keys: BlockKeys | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        """`keys`: how full blocks are keyed (default: sha256_cbor after a random root); `events`:
        where the prefix cache's changes are recorded (None: nowhere)."""
        self.block_size = block_size
        self.num_blocks = num_blocks  # the pool's size, fixed
        self.pool = BlockPool(num_blocks, enable_prefix_caching, events)
        self.keys = keys or BlockKeys.from_seed(None)
        self._seqs: dict[str, SeqBlocks] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.prefix_collisions = 0  # lookups that met a key holding other content (never reused)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones among them: they are reused on demand)."""
        return self.pool.num_free

    def block_table(self, seq_id: str) -> list[int]:
        return self._seqs[seq_id].table

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so the sequence can hold num_tokens tokens."""
        have = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def _content(
        self, parent_key: BlockKey | None, token_ids: Sequence[int], i: int, first_extra: ExtraKeys
    ) -> BlockContent:
        """Full block i of `token_ids` after the block keyed `parent_key`: what its key is computed from."""
        bs = self.block_size
        return (parent_key, tuple(token_ids[i * bs : (i + 1) * bs]), first_extra if i == 0 else None)

    def _cached_run(
        self, token_ids: Sequence[int], first_extra: ExtraKeys
    ) -> tuple[list[CachedBlock], BlockContent | None]:
        """The cache entries holding the prompt's leading full blocks, at least its last token left to
        compute (its logits are needed), and the content of the first block not found (None: none)."""
        entries: list[CachedBlock] = []
        if not self.pool.enable_prefix_caching:
            return entries, None
        parent_key, parent_serial = None, ROOT_SERIAL
        for i in range((len(token_ids) - 1) // self.block_size):
            content = self._content(parent_key, token_ids, i, first_extra)
            entry = self.pool.find(content, parent_serial)
            if entry is None:
                return entries, content
            entries.append(entry)
            parent_key, parent_serial = entry.key, entry.serial
        return entries, None

    def match_prefix(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Start a sequence, reusing cached full blocks of its prefix (under its cache_salt: other salts'
        blocks are never found); returns the cached token count. The first block not found is hashed:
        its key held by other content is a collision, counted."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already has blocks")
        extra = first_block_extra(cache_salt)
        entries, missed = self._cached_run(token_ids, extra)
        if missed is not None and self.pool.collides(self.keys.key(*missed), missed):
            self.prefix_collisions += 1
        for entry in entries:
            self.pool.touch(entry.block_id)
        chain = [Link(entry.key, entry.serial) for entry in entries]
        self._seqs[seq_id] = SeqBlocks([entry.block_id for entry in entries], chain, extra)
        return len(entries) * self.block_size

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of `token_ids` match_prefix would find cached now, changing nothing
        (no LRU touch, no counters, no key computed): what admission prices a prompt by. Safe to call
        from another thread than the step loop's: each lookup reads one dict entry, a frozen one, and a
        block evicted meanwhile only makes the count stale, as an estimate may be."""
        entries, _ = self._cached_run(token_ids, first_block_extra(cache_salt))
        return len(entries) * self.block_size

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
        if not self.pool.enable_prefix_caching:
            return  # (no key is computed at all)
        seq = self._seqs[seq_id]
        full = min(num_computed // self.block_size, len(seq.table))
        parent = seq.chain[-1] if seq.chain else ROOT_LINK
        for i in range(len(seq.chain), full):
            content = self._content(parent.key, token_ids, i, seq.extra)
            key = self.pool.cached_key(content) or self.keys.key(*content)
            serial = None
            if parent.serial is not None:
                serial = self.pool.register(seq.table[i], key, content, parent.serial)
            parent = Link(key, serial)
            seq.chain.append(parent)

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
        child = SeqBlocks(list(parent.table[:full]), list(parent.chain[:full]), parent.extra)
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

    def clear_prefix_cache(self, force: bool = False) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache, vLLM's reset_prefix_cache). Refused (False,
        nothing changed) while a sequence holds blocks, unless forced: their KV stays theirs, only
        later requests stop finding it."""
        if self._seqs and not force:
            return False
        self.pool.clear_cache()
        return True

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
