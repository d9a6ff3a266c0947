"""The prefix cache's changes as events for routers outside the process (vLLM's KV-cache events): a
full block cached, a cached block evicted, the whole cache cleared. The block pool records them on
the engine thread into a KVEventLog that a publisher thread drains (engine/kv_event_publisher.py).
Recording is an append, never a wait; with events off the pool holds no log and records nothing.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from tailserve.engine.block_keys import BlockKey, ExtraKeys


class Stored(NamedTuple):
    """A full block entered the prefix cache: its key, its parent's key (None: a prompt's first
    block), its tokens and extra keys (the cache salt of a first block): what the key hashes."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    extra: ExtraKeys


class Removed(NamedTuple):
    """A block's entry left the prefix cache (evicted for reuse, or displaced)."""

    key: BlockKey


class Cleared(NamedTuple):
    """Every entry left the prefix cache at once (a flush, or events dropped: forget them all)."""


KVEvent = Stored | Removed | Cleared


class KVEventLog:
    """Events not yet published, in order. One thread records (the engine's), one takes (the
    publisher's): deque appends and pops are atomic, so neither waits on the other."""

    def __init__(self, max_pending: int) -> None:
        self._pending: deque[KVEvent] = deque()
        self._max_pending = max_pending
        self.wake = threading.Event()  # set when something was recorded
        self.overflows = 0  # times the backlog was dropped for a Cleared
        self.recorded = 0  # events recorded so far (counted after each is queued)

    def record(self, event: KVEvent) -> None:
        """Queue one event. A backlog past `max_pending` (the publisher stalled) is dropped and
        replaced by Cleared: a router then forgets blocks it would have learned, never keeps ones
        that are gone."""
        if len(self._pending) >= self._max_pending:
            self._pending.clear()
            self._pending.append(Cleared())
            self.overflows += 1
        self._pending.append(event)
        self.recorded += 1
        self.wake.set()

    def take(self) -> tuple[list[KVEvent], int]:
        """Every event recorded so far, oldest first, removed from the log; and how many events had
        been recorded before the taking began (each of those is in the list, or was dropped for a
        Cleared that is)."""
        upto = self.recorded  # counted after the append: all `upto` events are queued or dropped
        out: list[KVEvent] = []
        try:
            while True:
                out.append(self._pending.popleft())
        except IndexError:
            return out, upto
