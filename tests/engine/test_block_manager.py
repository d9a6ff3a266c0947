"""Block manager invariants under random allocate / match / commit / fork / free sequences (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.engine.block_keys import BlockKeys, sha256_cbor
from tailserve.engine.block_manager import BlockPool, KVCacheManager

BLOCK = 4
NUM_BLOCKS = 24

ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "grow", "commit", "fork", "free"]),
        st.integers(0, 5),  # sequence slot
        st.integers(1, 40),  # token count
        st.integers(0, 2),  # which of a few prompts (to make prefix hits likely)
        st.sampled_from([None, "tenant-a", "tenant-b"]),  # cache_salt
    ),
    max_size=60,
)


def _one_bit_keys(value: object) -> bytes:
    """A hash with two possible keys: blocks collide all the time."""
    return bytes([sha256_cbor(value)[0] & 1])


KEYS = {"sha256_cbor": BlockKeys.from_seed("0"), "two keys": BlockKeys(b"root", _one_bit_keys)}


@dataclass
class _Seq:
    """The test's model of one sequence: its tokens and its salt."""

    tokens: list[int]
    salt: str | None


def _check_invariants(kv: KVCacheManager, live: dict[str, _Seq]) -> None:
    pool = kv.pool
    refs = [0] * pool.num_blocks
    for seq_id in live:
        for b in kv.block_table(seq_id):
            refs[b] += 1
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], "ref count equals the number of tables holding it"
    assert pool.num_free == sum(1 for r in refs if r == 0), "free exactly when unreferenced"
    for key, b in pool._cached.items():
        entry = pool.blocks[b].cached
        assert entry is not None and (entry.key, entry.block_id) == (key, b), "the key map and blocks agree"
    assert len(pool._cached) == sum(1 for block in pool.blocks if block.cached is not None)


@pytest.mark.parametrize("keys", KEYS.values(), ids=KEYS.keys())
@settings(max_examples=150, deadline=None)
@given(operations=ops)
def test_invariants_hold_hits_are_exact_and_everything_returns(
    keys: BlockKeys, operations: list[tuple[str, int, int, int, str | None]]
) -> None:
    """Whatever the hash function, a hit reuses only blocks computed for the same salt and the same
    whole prefix (`computed_for` models what each block's KV was computed from)."""
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, keys=keys)
    prompts = [[7] * 40, [7] * 20 + [9] * 20, list(range(40))]
    live: dict[str, _Seq] = {}
    computed_for: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    for op, slot, n, which, salt in operations:
        sid = f"s{slot}"
        seq = live.get(sid)
        if op == "start" and seq is None:
            tokens = prompts[which][:n]
            peek = kv.cached_prefix_tokens(tokens, salt)
            cached = kv.match_prefix(sid, tokens, salt)
            assert peek == cached  # the read-only count admission uses agrees with the real lookup
            assert cached % BLOCK == 0 and cached < len(tokens)
            table = kv.block_table(sid)
            assert table[: cached // BLOCK] == table
            for i, b in enumerate(table):
                assert computed_for[b] == (salt, tuple(tokens[: (i + 1) * BLOCK])), "a wrong block reused"
            live[sid] = _Seq(tokens, salt)
        elif op == "grow" and seq is not None:
            want = min(len(seq.tokens) + n, 80)
            before = list(kv.block_table(sid))
            free_before = kv.num_free_blocks
            if kv.allocate(sid, want):
                assert len(kv.block_table(sid)) * BLOCK >= want
                seq.tokens = (seq.tokens + [3] * n)[:want]
            else:
                assert kv.block_table(sid) == before and kv.num_free_blocks == free_before
        elif op == "commit" and seq is not None:
            table = kv.block_table(sid)
            computed = min(len(seq.tokens), len(table) * BLOCK)
            kv.commit(sid, seq.tokens, computed)
            for i in range(computed // BLOCK):  # (shared blocks: the same prefix, the same KV)
                computed_for[table[i]] = (seq.salt, tuple(seq.tokens[: (i + 1) * BLOCK]))
        elif op == "fork" and seq is not None:
            child = f"{sid}-c{n}"
            if child not in live:
                tokens = seq.tokens[: len(kv.block_table(sid)) * BLOCK]
                try:
                    kv.fork(sid, child, len(tokens))
                except MemoryError:
                    continue
                live[child] = _Seq(tokens, seq.salt)
        elif op == "free":
            for s in [s for s in live if s == sid or s.startswith(sid + "-")]:
                kv.free(s)
                del live[s]
        _check_invariants(kv, live)
    for s in list(live):
        kv.free(s)
    assert kv.num_free_blocks == NUM_BLOCKS


def test_prefix_hit_reuses_blocks_and_lru_evicts_oldest_first() -> None:
    kv = KVCacheManager(6, BLOCK)
    a = list(range(13))  # 3 full blocks + 1 token
    assert kv.match_prefix("a", a) == 0
    assert kv.allocate("a", len(a))
    kv.commit("a", a, len(a))
    table_a = list(kv.block_table("a"))
    kv.free("a")
    assert kv.num_free_blocks == 6  # cached but free
    assert kv.match_prefix("b", a) == 12
    assert kv.block_table("b") == table_a[:3]
    kv.free("b")
    # Fill the pool with unrelated tokens: the cached blocks get evicted, the pool stays whole.
    assert kv.match_prefix("c", [99] * 24) == 0
    assert kv.allocate("c", 24)
    kv.free("c")
    assert kv.match_prefix("d", a) == 0
    kv.free("d")
    assert kv.num_free_blocks == 6


def test_cached_prefix_count_reads_without_changing_anything() -> None:
    kv = KVCacheManager(6, BLOCK)
    a = list(range(13))  # 3 full blocks + 1 token
    kv.match_prefix("a", a)
    kv.allocate("a", len(a))
    kv.commit("a", a, len(a))
    kv.free("a")
    queries, hits = kv.prefix_queries, kv.prefix_hits
    assert kv.cached_prefix_tokens(a) == 12
    assert kv.cached_prefix_tokens(a[:9] + [77] * 4) == 8  # two full blocks shared
    assert kv.cached_prefix_tokens(a[:4]) == 0  # the last token is always computed
    assert kv.cached_prefix_tokens([5] * 13) == 0
    assert (kv.prefix_queries, kv.prefix_hits) == (queries, hits)
    assert not kv.has("a") and kv.num_free_blocks == 6
    assert KVCacheManager(6, BLOCK, enable_prefix_caching=False).cached_prefix_tokens(a) == 0


def test_pool_refuses_double_release_and_overdraw() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError):
        pool.release(blocks)


def _compute(kv: KVCacheManager, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
    """Start a sequence, hold blocks for all its tokens and register them as computed; its hit."""
    cached = kv.match_prefix(seq_id, tokens, salt)
    assert kv.allocate(seq_id, len(tokens))
    kv.commit(seq_id, tokens, len(tokens))
    return cached


def test_a_forced_key_collision_reuses_no_block_and_is_counted() -> None:
    kv = KVCacheManager(8, BLOCK, keys=BlockKeys(b"root", lambda _: b"one key for every block"))
    a, b = list(range(9)), list(range(100, 109))
    _compute(kv, "a", a)
    kv.free("a")
    assert kv.cached_prefix_tokens(b) == 0 and kv.prefix_collisions == 0  # the read-only count counts nothing
    assert kv.match_prefix("b", b) == 0
    assert kv.block_table("b") == [] and kv.prefix_collisions == 1
    assert kv.allocate("b", len(b)) and kv.num_free_blocks == 8 - 3
    kv.free("b")
    # Its own first block still hits; the blocks after it were never cached (their key was taken).
    assert kv.match_prefix("a again", a) == BLOCK


def test_salts_never_share_blocks_and_the_same_salt_does() -> None:
    kv = KVCacheManager(16, BLOCK)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert _compute(kv, "a", prompt, "tenant-a") == 0
    kv.free("a")
    assert kv.match_prefix("b", prompt, "tenant-b") == 0
    assert kv.match_prefix("none", prompt) == 0
    assert kv.match_prefix("a2", prompt, "tenant-a") == 12
    assert kv.prefix_collisions == 0
    kv.free("b")
    kv.free("none")
    assert _compute(kv, "b", prompt, "tenant-b") == 0  # computed again, in blocks of its own
    assert kv.match_prefix("b2", prompt, "tenant-b") == 12
    assert not set(kv.block_table("b2")) & set(kv.block_table("a2"))


def test_a_key_blind_to_the_salt_still_never_shares_a_block_across_salts() -> None:
    """Keys that ignore the extra keys make salted prefixes collide; the first block's stored salt and
    each block's parent entry still keep them apart, also after the first block is evicted and cached
    again under the other salt while a later block of the first salt stays (held by a sequence)."""
    kv = KVCacheManager(6, BLOCK, keys=BlockKeys(b"root", lambda value: sha256_cbor(value[:2])))
    prompt = list(range(9))  # 2 full blocks + 1 token
    kv.match_prefix("a1", prompt, "a")
    kv.match_prefix("a2", prompt, "a")
    assert kv.allocate("a1", 9) and kv.allocate("a2", 9)
    kv.commit("a1", prompt, 4)  # a1 caches block 0
    kv.commit("a2", prompt, 9)  # a2 finds it there and caches block 1 after it
    kv.free("a1")
    assert _compute(kv, "filler", list(range(50, 59))) == 0  # evicts a1's block 0, not a2's block 1
    kv.free("filler")
    assert kv.match_prefix("b1", prompt, "b") == 0 and kv.prefix_collisions == 0  # block 0 is gone
    assert kv.allocate("b1", 9)
    kv.commit("b1", prompt, 9)  # caches block 0 under salt b; block 1's key is a2's (in use)
    assert kv.match_prefix("b2", prompt, "b") == BLOCK  # salt b's block 0 only, never a2's block 1
    assert kv.match_prefix("a3", prompt, "a") == 0 and kv.prefix_collisions == 1  # b's block 0 is not a's


def test_no_key_is_computed_with_prefix_caching_off() -> None:
    def refuse(value: object) -> bytes:
        raise AssertionError("hashed a block with prefix caching off")

    kv = KVCacheManager(4, BLOCK, enable_prefix_caching=False, keys=BlockKeys(b"root", refuse))
    assert _compute(kv, "a", list(range(13))) == 0
    assert kv.cached_prefix_tokens(list(range(13))) == 0
