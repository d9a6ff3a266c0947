"""Placement policies: given the candidate replicas and their loads, pick one and say why.

Policies are pure choices over values (no I/O, no clock), so each is unit-tested on constructed
loads. Only `PrefixAffinity` keeps state: which replica last served each prompt-prefix block (under
each cache_salt, as the replicas cache them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """A healthy replica the request may go to, with its current load score (in requests)."""

    url: str
    load: float


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at: the session key (`user` / X-Session-Id), the prompt text and the
    request's `cache_salt` (prompts under different salts share no cached block on a replica)."""

    session_key: str | None
    prompt_text: str
    cache_salt: str | None = None


@dataclass(frozen=True)
class Decision:
    """The chosen replica and the reason label for `tailserve_router_decisions_total`."""

    url: str
    reason: str


class Policy(Protocol):
    """Chooses a replica for a request; `record` learns where a request was actually served."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...

    def record(self, request: RouteRequest, url: str) -> None: ...


class RoundRobin:
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The next candidate in rotation."""
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(chosen.url, "round_robin")

    def record(self, request: RouteRequest, url: str) -> None:
        """Nothing to learn."""


def _stable_hash(*parts: str) -> int:
    """A hash that is the same in every process (several routers agree on placements)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionHash:
    """The naive baseline: the same session key always goes to the same replica.

    Rendezvous hashing, so a replica leaving moves only its own keys. Requests without a key
    are spread round robin.
    """

    name = "hash"

    def __init__(self) -> None:
        self._fallback = RoundRobin()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The candidate with the highest hash of (key, url)."""
        if request.session_key is None:
            return Decision(self._fallback.choose(request, candidates).url, "no_key")
        key = request.session_key
        chosen = max(candidates, key=lambda c: _stable_hash(key, c.url))
        return Decision(chosen.url, "session_key")

    def record(self, request: RouteRequest, url: str) -> None:
        """Nothing to learn."""


class LeastLoad:
    """The candidate with the lowest load score; ties rotate so idle replicas share the work."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The least loaded candidate."""
        return Decision(self.least_loaded(candidates).url, "least_load")

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """The lowest load; among equals, the next one in rotation."""
        lowest = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load <= lowest + 1e-9]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def record(self, request: RouteRequest, url: str) -> None:
        """Nothing to learn."""


def prefix_block_hashes(text: str, block_chars: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the text's full `block_chars` blocks: hash i identifies text[: (i+1)*block]
    under `cache_salt` (the chain starts from the salt, as a replica's block keys do)."""
    hashes: list[int] = []
    previous = 0 if cache_salt is None else _stable_hash("cache_salt", cache_salt)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = _stable_hash(str(previous), text[start : start + block_chars])
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    """Send a request where its prompt prefix is likely cached, unless that replica is too busy.

    A bounded LRU map from prefix-block hashes to the replicas that last served them (a shared
    system prompt is cached on several). Among candidates whose load is within `load_bound` of
    the least loaded, the one holding the longest prefix wins; with no such match, least load.
    """

    name = "prefix"
    REPLICAS_PER_BLOCK = 4

    def __init__(self, block_chars: int, load_bound: float, max_blocks: int) -> None:
        self._block_chars = block_chars
        self._load_bound = load_bound
        self._max_blocks = max_blocks
        self._holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._least_load = LeastLoad()

    def matched_blocks(self, request: RouteRequest) -> dict[str, int]:
        """How many leading prefix blocks each replica holds for this prompt."""
        depth: dict[str, int] = {}
        blocks = prefix_block_hashes(request.prompt_text, self._block_chars, request.cache_salt)
        for i, block in enumerate(blocks):
            holders = self._holders.get(block)
            if not holders:
                break
            for url in holders:
                if depth.get(url, 0) == i:  # only a contiguous run from the start counts
                    depth[url] = i + 1
        return depth

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """The deepest prefix match among candidates not overloaded; else least load."""
        depth = self.matched_blocks(request)
        lowest = min(c.load for c in candidates)
        within = [c for c in candidates if c.load <= lowest + self._load_bound]
        best = max(within, key=lambda c: (depth.get(c.url, 0), -c.load))
        if depth.get(best.url, 0) > 0:
            return Decision(best.url, "prefix_hit")
        reason = "prefix_overloaded" if any(depth.get(c.url, 0) for c in candidates) else "prefix_miss"
        return Decision(self._least_load.least_loaded(candidates).url, reason)

    def record(self, request: RouteRequest, url: str) -> None:
        """Remember that `url` now holds every full block of this prompt."""
        for block in prefix_block_hashes(request.prompt_text, self._block_chars, request.cache_salt):
            holders = tuple(u for u in self._holders.get(block, ()) if u != url) + (url,)
            self._holders[block] = holders[-self.REPLICAS_PER_BLOCK :]
            self._holders.move_to_end(block)
        while len(self._holders) > self._max_blocks:
            self._holders.popitem(last=False)


def make_policy(
    name: str, block_chars: int = 256, load_bound: float = 4.0, max_blocks: int = 200_000
) -> Policy:
    """The policy called `name` (one of config.POLICIES)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "hash":
        return SessionHash()
    if name == "least_load":
        return LeastLoad()
    if name == "prefix":
        return PrefixAffinity(block_chars, load_bound, max_blocks)
    raise ValueError(f"unknown policy {name!r}")
