"""Block manager invariants under random allocate / match / commit / fork / free sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.engine.block_manager import BlockPool, KVCacheManager

BLOCK = 4
NUM_BLOCKS = 24

ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "grow", "commit", "fork", "free"]),
        st.integers(0, 5),  # sequence slot
        st.integers(1, 40),  # token count
        st.integers(0, 2),  # which of a few prompts (to make prefix hits likely)
    ),
    max_size=60,
)


def _check_invariants(kv: KVCacheManager, live: dict[str, list[int]]) -> None:
    pool = kv.pool
    refs = [0] * pool.num_blocks
    for seq_id in live:
        for b in kv.block_table(seq_id):
            refs[b] += 1
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], "ref count equals the number of tables holding it"
    assert pool.num_free == sum(1 for r in refs if r == 0), "free exactly when unreferenced"
    for h, b in pool._cached.items():
        assert pool.blocks[b].block_hash == h, "the hash map and the blocks agree"


@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_hold_and_everything_returns(operations: list[tuple[str, int, int, int]]) -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK)
    prompts = [[7] * 40, [7] * 20 + [9] * 20, list(range(40))]
    live: dict[str, list[int]] = {}
    for op, slot, n, which in operations:
        sid = f"s{slot}"
        if op == "start" and sid not in live:
            tokens = prompts[which][:n]
            peek = kv.cached_prefix_tokens(tokens)
            cached = kv.match_prefix(sid, tokens)
            assert peek == cached  # the read-only count admission uses agrees with the real lookup
            assert cached % BLOCK == 0 and cached < len(tokens)
            assert kv.block_table(sid)[: cached // BLOCK] == kv.block_table(sid)
            live[sid] = tokens
        elif op == "grow" and sid in live:
            want = min(len(live[sid]) + n, 80)
            before = list(kv.block_table(sid))
            free_before = kv.num_free_blocks
            if kv.allocate(sid, want):
                assert len(kv.block_table(sid)) * BLOCK >= want
                live[sid] = (live[sid] + [3] * n)[:want]
            else:
                assert kv.block_table(sid) == before and kv.num_free_blocks == free_before
        elif op == "commit" and sid in live:
            held = len(kv.block_table(sid)) * BLOCK
            kv.commit(sid, live[sid], min(len(live[sid]), held))
        elif op == "fork" and sid in live:
            child = f"{sid}-c{n}"
            if child not in live:
                tokens = live[sid][: len(kv.block_table(sid)) * BLOCK]
                try:
                    kv.fork(sid, child, len(tokens))
                except MemoryError:
                    continue
                live[child] = tokens
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
