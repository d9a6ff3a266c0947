"""Each policy's choice on constructed loads, and what the policies read of a request body."""

from __future__ import annotations

from collections import Counter

from tailserve.router.policies import (
    Candidate,
    Decision,
    LeastLoad,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    SessionHash,
    make_policy,
    prefix_block_hashes,
)
from tailserve.router.request_info import prompt_text, route_request

A, B, C = "http://a", "http://b", "http://c"


def _req(prompt: str = "", key: str | None = None, salt: str | None = None) -> RouteRequest:
    return RouteRequest(session_key=key, prompt_text=prompt, cache_salt=salt)


def test_round_robin_cycles_through_candidates() -> None:
    policy = RoundRobin()
    cands = [Candidate(A, 9), Candidate(B, 0), Candidate(C, 5)]
    assert [policy.choose(_req(), cands).url for _ in range(6)] == [A, B, C, A, B, C]


def test_hash_is_sticky_per_key_and_ignores_load() -> None:
    policy = SessionHash()
    cands = [Candidate(A, 100), Candidate(B, 0), Candidate(C, 0)]
    for key in ("alice", "bob", "carol"):
        chosen = {policy.choose(_req(key=key), cands).url for _ in range(5)}
        assert len(chosen) == 1
    assert policy.choose(_req(key="alice"), cands).reason == "session_key"
    assert policy.choose(_req(), cands).reason == "no_key"


def test_hash_spreads_keys_and_moves_only_the_lost_replicas_keys() -> None:
    policy = SessionHash()
    three = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 0)]
    keys = [f"user-{i}" for i in range(300)]
    before = {k: policy.choose(_req(key=k), three).url for k in keys}
    assert min(Counter(before.values()).values()) > 60  # roughly a third each
    after = {k: policy.choose(_req(key=k), three[:2]).url for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != C)


def test_least_load_picks_lowest_and_rotates_ties() -> None:
    policy = LeastLoad()
    assert policy.choose(_req(), [Candidate(A, 3), Candidate(B, 1.5), Candidate(C, 2)]).url == B
    tied = [Candidate(A, 1), Candidate(B, 1), Candidate(C, 4)]
    assert {policy.choose(_req(), tied).url for _ in range(4)} == {A, B}


def test_prefix_block_hashes_chain_full_blocks_only() -> None:
    assert prefix_block_hashes("abc", 4) == []
    one, two = prefix_block_hashes("abcdefgh", 4), prefix_block_hashes("abcdefghij", 4)
    assert len(one) == 2 and one == two
    # Same second block after a different first block: a different hash (it names the whole prefix).
    assert prefix_block_hashes("zzzzefgh", 4)[1] != one[1]


def test_prefix_prefers_the_replica_holding_the_longest_prefix() -> None:
    policy = PrefixAffinity(block_chars=4, load_bound=2.0, max_blocks=100)
    cands = [Candidate(A, 0), Candidate(B, 1), Candidate(C, 0)]
    first = policy.choose(_req("systemprompt-q1"), cands)
    assert first.reason == "prefix_miss"
    policy.record(_req("systemprompt-q1"), B)
    policy.record(_req("system-other"), C)  # shares only the first block "syst"
    decision = policy.choose(_req("systemprompt-q2"), cands)
    assert decision == type(decision)(B, "prefix_hit")
    assert policy.matched_blocks(_req("systemprompt-q2")) == {B: 3, C: 1}


def test_prefix_falls_back_to_least_load_beyond_the_bound() -> None:
    policy = PrefixAffinity(block_chars=4, load_bound=2.0, max_blocks=100)
    policy.record(_req("systemprompt"), A)
    assert policy.choose(_req("systemprompt!"), [Candidate(A, 2.0), Candidate(B, 0)]).url == A  # within bound
    decision = policy.choose(_req("systemprompt!"), [Candidate(A, 2.5), Candidate(B, 0), Candidate(C, 1)])
    assert (decision.url, decision.reason) == (B, "prefix_overloaded")


def test_prefix_ignores_holders_that_are_not_candidates() -> None:
    policy = PrefixAffinity(block_chars=4, load_bound=2.0, max_blocks=100)
    policy.record(_req("systemprompt"), A)
    decision = policy.choose(_req("systemprompt"), [Candidate(B, 1), Candidate(C, 0)])
    assert (decision.url, decision.reason) == (C, "prefix_miss")


def test_prefix_map_is_bounded_lru() -> None:
    policy = PrefixAffinity(block_chars=4, load_bound=2.0, max_blocks=4)
    policy.record(_req("aaaabbbb"), A)
    policy.record(_req("ccccdddd"), B)
    policy.record(_req("eeee"), C)  # evicts the oldest block, "aaaa"
    assert policy.matched_blocks(_req("aaaabbbb")) == {}
    assert policy.matched_blocks(_req("ccccdddd")) == {B: 2}


def test_prefix_remembers_several_holders_of_a_shared_prompt() -> None:
    policy = PrefixAffinity(block_chars=4, load_bound=10.0, max_blocks=100)
    policy.record(_req("shared-x"), A)
    policy.record(_req("shared-y"), B)
    decision = policy.choose(_req("shared-z"), [Candidate(A, 3), Candidate(B, 1), Candidate(C, 0)])
    assert (decision.url, decision.reason) == (B, "prefix_hit")  # both hold "shar": the less loaded


def test_prefix_places_salted_prompts_by_salt() -> None:
    """Identical prompts under two cache_salts share no cached block on a replica, so each salt's
    requests follow the replica that served that salt, and an unseen salt (or none) goes by load."""
    policy = PrefixAffinity(block_chars=4, load_bound=2.0, max_blocks=100)
    cands = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 0.5)]
    policy.record(_req("systemprompt-q1", salt="tenant-a"), A)
    policy.record(_req("systemprompt-q1", salt="tenant-b"), B)
    for _ in range(3):
        assert policy.choose(_req("systemprompt-q2", salt="tenant-a"), cands) == Decision(A, "prefix_hit")
        assert policy.choose(_req("systemprompt-q2", salt="tenant-b"), cands) == Decision(B, "prefix_hit")
    assert policy.matched_blocks(_req("systemprompt-q2", salt="tenant-a")) == {A: 3}
    assert policy.choose(_req("systemprompt-q2", salt="tenant-c"), cands).reason == "prefix_miss"
    assert policy.choose(_req("systemprompt-q2"), cands).reason == "prefix_miss"
    assert prefix_block_hashes("abcdefgh", 4, "s") != prefix_block_hashes("abcdefgh", 4)


def test_make_policy_names() -> None:
    for name in ("round_robin", "hash", "least_load", "prefix"):
        assert make_policy(name).name == name


def test_prompt_text_of_completions_and_chat() -> None:
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    assert prompt_text({"prompt": [[7, 8], [9]]}) == "7,8,"
    chat = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    }
    text = prompt_text(chat)
    assert text.startswith("<|system|>\nsys\n") and text.endswith("<|user|>\nhi\n")
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "yo"}]}
    assert prompt_text(longer).startswith(text)  # a conversation's turns extend its prefix
    # The Responses API's instructions and input render as the same conversation: same placement.
    responses = {
        "instructions": "sys",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    }
    assert prompt_text(responses) == text
    assert prompt_text({"instructions": "sys", "input": "hi"}) == text


def test_session_key_from_user_then_header() -> None:
    assert route_request({"user": "u1"}, {"x-session-id": "s1"}).session_key == "u1"
    assert route_request({"prompt": "p"}, {"x-session-id": "s1"}).session_key == "s1"
    assert route_request({"prompt": "p"}, {}).session_key is None


def test_cache_salt_from_the_body() -> None:
    assert route_request({"prompt": "p", "cache_salt": "tenant-a"}, {}).cache_salt == "tenant-a"
    for bad in ("", 7, None):
        assert route_request({"prompt": "p", "cache_salt": bad}, {}).cache_salt is None
