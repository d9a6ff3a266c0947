"""Block keys are vLLM's sha256_cbor: SHA-256 over canonical CBOR bytes spelled out here by hand."""

from __future__ import annotations

import hashlib

from tailserve.engine.block_keys import BlockKeys, first_block_extra


def test_root_is_sha256_of_the_seed_as_cbor_text_and_random_without_a_seed() -> None:
    assert BlockKeys.from_seed("0").root == hashlib.sha256(b"\x610").digest()  # text(1) "0"
    assert BlockKeys.from_seed(None).root != BlockKeys.from_seed(None).root
    assert len(BlockKeys.from_seed(None).root) == 32


def test_block_key_is_sha256_of_the_canonical_cbor_array() -> None:
    keys = BlockKeys.from_seed("42")
    tokens = [1, 300, 70000]
    # array(3) [bytes(32) parent, array(3) [1, uint16 300, uint32 70000], null]
    cbor_tokens = b"\x83\x01\x19\x01\x2c\x1a\x00\x01\x11\x70"
    first = keys.key(None, tokens)
    assert first == hashlib.sha256(b"\x83\x58\x20" + keys.root + cbor_tokens + b"\xf6").digest()
    second = keys.key(first, tokens)
    assert second == hashlib.sha256(b"\x83\x58\x20" + first + cbor_tokens + b"\xf6").digest()
    # The salt rides on the first block only, as extra keys: array(1) [text(6) "tenant"].
    salted = keys.key(None, tokens, first_block_extra("tenant"))
    cbor_extra = b"\x81\x66tenant"
    assert salted == hashlib.sha256(b"\x83\x58\x20" + keys.root + cbor_tokens + cbor_extra).digest()
    assert first_block_extra(None) is None and first_block_extra("") is None
