"""Prefix-cache block keys in vLLM's `sha256_cbor` scheme, so that an external router can rebuild them.

A full block's key is SHA-256 over the canonical CBOR encoding of the array [parent key, [token ids],
extra keys]; the first block's parent is the root key, SHA-256 over the CBOR text of a seed (vLLM's
NONE_HASH from PYTHONHASHSEED), else 32 random bytes. Bytes in, bytes out: never touches blocks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

BlockKey = bytes  # a 32-byte SHA-256 digest
ExtraKeys = tuple[Any, ...] | None  # None (CBOR null) when a block has none, as vLLM
HashFn = Callable[[Any], BlockKey]


def sha256_cbor(value: Any) -> BlockKey:
    """SHA-256 of the canonical CBOR encoding (RFC 8949 §4.2.1): the same bytes in every language."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def first_block_extra(cache_salt: str | None) -> ExtraKeys:
    """The first block's extra keys: the salt, as vLLM; later blocks carry it through their parent."""
    return (cache_salt,) if cache_salt else None


@dataclass(frozen=True)
class BlockKeys:
    """How full blocks are keyed: the root (the first block's parent) and the hash function.

    Tests inject `hash_fn` to force collisions; serving always uses sha256_cbor."""

    root: BlockKey
    hash_fn: HashFn = sha256_cbor

    @classmethod
    def from_seed(cls, seed: str | None, hash_fn: HashFn = sha256_cbor) -> BlockKeys:
        """vLLM's root: hash_fn(seed) when a seed is set (keys reproducible across processes and by
        routers), else 32 random bytes (keys nobody outside this engine can predict)."""
        return cls(os.urandom(32) if seed is None else hash_fn(seed), hash_fn)

    def key(self, parent: BlockKey | None, token_ids: Sequence[int], extra: ExtraKeys = None) -> BlockKey:
        """The key of a full block after `parent` (None: the prompt's first block)."""
        return self.hash_fn((self.root if parent is None else parent, tuple(token_ids), extra))
