"""Publishes the prefix cache's events in vLLM's wire format, so llm-d's KV-cache indexer and other
vLLM event consumers read tailserve unchanged: ZMQ PUB multipart [topic, 8-byte big-endian sequence
number, msgpack KVEventBatch], a batch as an array, its events as arrays tagged by class name (or, on
request, as maps tagged under "type", vLLM's encoding since mid-2026), and a ROUTER replay socket
answering a sequence number with every kept batch from it on.

It runs on its own thread and never blocks the engine: the engine only appends to the KVEventLog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from tailserve.config import KVEventsConfig
from tailserve.engine.block_keys import BlockKey
from tailserve.engine.kv_events import Cleared, KVEvent, KVEventLog, Removed, Stored

log = logging.getLogger("tailserve.kv_events")

# vLLM's name for the tier a block lives in; the engine's working KV pool is its "GPU" tier on any
# device (llm-d scores the other tiers as offloaded copies).
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message: nothing more
SHUTDOWN_TIMEOUT_S = 2.0
ExternalHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The events' base: encoded as [class name, field, field, ...]."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block; omitted when all None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The same events as tagged maps ({"type": "BlockStored", "block_hashes": ...}): vLLM's encoding
# since its PR #42892; llm-d, Dynamo and SGLang's router decode both.
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredMap(_MapEvent, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemovedMap(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None


class AllBlocksClearedMap(_MapEvent, tag="AllBlocksCleared"):
    pass


_AS_MAP: dict[type[KVCacheEvent], type[_MapEvent]] = {
    BlockStored: BlockStoredMap,
    BlockRemoved: BlockRemovedMap,
    AllBlocksCleared: AllBlocksClearedMap,
}


def as_map(event: KVCacheEvent) -> _MapEvent:
    """The event in map encoding, field for field."""
    return _AS_MAP[type(event)](**msgspec.structs.asdict(event))


def external_hash(key: BlockKey, as_int: bool) -> ExternalHash:
    """A block key as events carry it: its low 64 bits, big-endian (vLLM's default), or whole."""
    return int.from_bytes(key[-8:], "big") if as_int else key


def to_wire(events: Sequence[KVEvent], block_size: int, as_int: bool) -> list[KVCacheEvent]:
    """The recorded events as vLLM's: runs of stored blocks that chain (each the parent of the next)
    become one BlockStored, as vLLM reports a request's newly cached blocks; removals in a row one
    BlockRemoved."""
    out: list[KVCacheEvent] = []
    last_key: BlockKey | None = None  # key of the last block in out[-1] when it is a BlockStored
    for event in events:
        prev = out[-1] if out else None
        if isinstance(event, Stored):
            h = external_hash(event.key, as_int)
            if isinstance(prev, BlockStored) and last_key is not None and event.parent == last_key:
                prev.block_hashes.append(h)
                prev.token_ids.extend(event.token_ids)
                extra = prev.extra_keys or [None] * (len(prev.block_hashes) - 1)
                extra.append(event.extra)
                prev.extra_keys = extra if any(e is not None for e in extra) else None
            else:
                parent = None if event.parent is None else external_hash(event.parent, as_int)
                extra_keys: list[tuple[Any, ...] | None] | None = (
                    None if event.extra is None else [event.extra]
                )
                out.append(
                    BlockStored(
                        [h], parent, list(event.token_ids), block_size, None, MEDIUM, None, extra_keys
                    )
                )
            last_key = event.key
            continue
        last_key = None
        if isinstance(event, Removed):
            h = external_hash(event.key, as_int)
            if isinstance(prev, BlockRemoved):
                prev.block_hashes.append(h)
            else:
                out.append(BlockRemoved([h], MEDIUM))
        elif isinstance(event, Cleared):
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """A ZMQ PUB socket (and a ROUTER for replays) fed from a KVEventLog by a daemon thread; each
    wake-up publishes what was recorded since the last as one batch. Sockets are created here and
    used only by the thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.log = KVEventLog(config.max_queue_size)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            endpoint = config.endpoint
            # vLLM's rule: bind a wildcard or local address, connect to anything else.
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.published = 0  # batches sent so far; the next batch's sequence number
        self.handled = 0  # events recorded before the last batch was taken: all sent by now
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tailserve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events on %s (replay: %s)", config.endpoint, config.replay_endpoint)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every event recorded before this call has been sent on the PUB socket (or
        the thread failed to send it and logged why); False if `timeout_s` passed first."""
        target = self.log.recorded
        deadline = time.monotonic() + timeout_s
        while self.handled < target:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            self.log.wake.set()
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Publish what is still recorded, stop the thread, close the sockets (idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.log.wake.set()
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=int(SHUTDOWN_TIMEOUT_S * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            self.log.wake.wait(0.1)
            self.log.wake.clear()
            try:
                events, upto = self.log.take()
                try:
                    self._publish(events)
                finally:  # sent, or logged below as failed: either way no longer waited for
                    self.handled = upto
                self._serve_replays()
            except Exception:  # a bad send must not end event publishing; log and carry on
                log.exception("publishing KV-cache events failed")
            if stopping:
                return

    def _publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        wire: list[Any] = to_wire(events, self.block_size, self.config.int_block_hashes)
        if self.config.event_encoding == "map":
            wire = [as_map(event) for event in wire]
        payload = self._encoder.encode(KVEventBatch(time.time(), wire, 0))
        seq = self.published.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._buffer.append((self.published, payload))
        self.published += 1

    def _serve_replays(self) -> None:
        """Each request [identity, b"", start seq] gets every kept batch from `start` on as
        [topic, seq, payload] (what the PUB socket sent), then [b"", -1, b""]: vLLM's replay."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
