"""KV-cache events as a router outside the process sees them: subscribe to the ZMQ stream, decode it
with msgspec structs written here from vLLM's published format (not tailserve's), fill gaps from the
replay socket, and check that the blocks stored minus the blocks removed are exactly the engine's
prefix cache after each round of a workload that evicts, and after a flush. Each stored block's hash
is rebuilt from its parent and tokens as an external router would (sha256_cbor after the seed's root).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tailserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.engine.block_keys import BlockKeys
from tailserve.errors import ConfigError

BLOCK_SIZE = 16
SEED = "42"  # vLLM's PYTHONHASHSEED: routers rebuild the same keys
KV_BYTES_PER_TOKEN = 512  # dummy:tiny
NUM_BLOCKS = 24
SYNC_TIMEOUT_S = 30.0  # a hang guard for the publisher thread, not a performance bound


# ----- the wire format, from vLLM's docs (vllm/distributed/kv_events.py, examples/online_serving) ---
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's encoding since its PR #42892: each event a map tagged under "type" (the batch still an array).
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(EventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


DECODERS = {"array": msgspec.msgpack.Decoder(KVEventBatch), "map": msgspec.msgpack.Decoder(MapKVEventBatch)}
Stored = BlockStored | MapBlockStored


@dataclass
class RouterView:
    """What a router learns from the stream: the blocks cached now, and every batch by sequence number."""

    endpoint: str
    replay_endpoint: str
    encoding: str
    ctx: zmq.Context[zmq.Socket[bytes]] = field(default_factory=zmq.Context)
    batches: dict[int, bytes] = field(default_factory=dict)
    applied: int = 0  # batches applied to `blocks`, in order
    blocks: dict[int | bytes, Stored] = field(default_factory=dict)  # hash -> the event storing it
    removed: int = 0
    cleared: int = 0
    replayed: int = 0  # batches filled in from the replay socket

    def __post_init__(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(self.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the replay socket for every kept batch from `start`, as a router does after a gap."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(int(SYNC_TIMEOUT_S * 1000)), "replay never answered"
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b"" and len(seq) == 8
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert topic == payload == b""
                    return out
                assert topic == b"kv@test@dummy"
                out.append((number, payload))
        finally:
            dealer.close(linger=0)

    def receive(self) -> None:
        """Everything the PUB socket has sent so far; the next batch to apply, when PUB has not
        brought it (the subscription was late, or a gap), is asked from the replay socket; a batch
        both sent must be the same bytes."""
        while self.sub.poll(20):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"kv@test@dummy" and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = payload
        if self.applied not in self.batches:  # a late subscription or a gap: ask for it
            for number, payload in self.replay(self.applied):
                assert self.batches.setdefault(number, payload) == payload
                self.replayed += 1
        while self.applied in self.batches:
            self._apply(DECODERS[self.encoding].decode(self.batches[self.applied]))
            self.applied += 1

    def _apply(self, batch: KVEventBatch | MapKVEventBatch) -> None:
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            if isinstance(event, BlockStored | MapBlockStored):
                assert event.block_size == BLOCK_SIZE and event.medium == "GPU" and event.lora_id is None
                assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
                for h in event.block_hashes:
                    assert h not in self.blocks, "stored twice without a removal"
                    self.blocks[h] = event
            elif isinstance(event, BlockRemoved | MapBlockRemoved):
                assert event.medium == "GPU"
                for h in event.block_hashes:
                    assert self.blocks.pop(h, None) is not None, "removed a block never stored"
                self.removed += len(event.block_hashes)
            else:
                self.blocks.clear()
                self.cleared += 1

    def sync_with(self, expected: set[int | bytes]) -> None:
        """Receive until the view equals the engine's cache (the engine is idle: it changes no more)."""
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while set(self.blocks) != expected and time.monotonic() < deadline:
            self.receive()
        assert set(self.blocks) == expected


def _llm(tmp_path: Path, int_block_hashes: bool, encoding: str) -> LLM:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/kv-events",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv@test@dummy",  # llm-d's kv@<pod>@<model>
        int_block_hashes=int_block_hashes,
        event_encoding=encoding,
    )
    return LLM(
        config=EngineConfig(
            model=ModelConfig(
                model="dummy:tiny", weight_format="fp32", device="cpu", max_model_len=256, num_threads=1
            ),
            cache=CacheConfig(
                kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
                block_size=BLOCK_SIZE,
                prefix_cache_seed=SEED,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4),
            kv_events=events,
        )
    )


@pytest.fixture(params=[(False, "array"), (True, "array"), (True, "map")], ids=["bytes", "int", "int-map"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LLM, bool, str]]:
    as_int, encoding = request.param
    llm = _llm(tmp_path, as_int, encoding)
    try:
        yield llm, as_int, encoding
    finally:
        llm.close()


def _external(key: bytes, as_int: bool) -> int | bytes:
    return int.from_bytes(key[-8:], "big") if as_int else key


def _engine_cache(llm: LLM, as_int: bool) -> set[int | bytes]:
    return {_external(k, as_int) for k in llm.engine.scheduler.kv.pool.cached_keys()}


def _prompt(first: int, length: int) -> list[int]:
    return [(first + 7 * i) % 500 + 3 for i in range(length)]


def test_stream_tracks_the_prefix_cache_through_evictions_and_a_flush(
    engine: tuple[LLM, bool, str], tmp_path: Path
) -> None:
    llm, as_int, encoding = engine
    assert llm.engine.runner.num_blocks == NUM_BLOCKS
    shared = _prompt(1, 3 * BLOCK_SIZE)
    # (prompts, cache_salt) per round
    rounds: list[tuple[list[list[int]], str | None]] = [
        ([shared + _prompt(100 + i, 20) for i in range(3)], None),  # a shared prefix, cached once
        ([_prompt(200 + i, 90) for i in range(5)], None),  # 6 blocks each: the pool must evict
        ([shared + _prompt(300, 40), _prompt(400, 120)], None),
        ([shared + _prompt(600, 20)], "tenant-a"),  # salted: its first block carries the salt
    ]
    llm.generate(rounds[0][0], _params(None))
    # The router subscribes late, after the first round's batches have left the PUB socket (the
    # publisher thread sends them in its own time): what it missed comes from the replay socket.
    publisher = llm.engine.kv_events
    assert publisher is not None and publisher.flush(SYNC_TIMEOUT_S)
    assert publisher.published > 0
    view = RouterView(f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay", encoding)
    try:
        view.sync_with(_engine_cache(llm, as_int))
        assert view.replayed > 0
        for prompts, salt in rounds[1:]:
            llm.generate(prompts, _params(salt))
            view.sync_with(_engine_cache(llm, as_int))
        assert view.removed > 0, "the workload never evicted"
        _check_keys_rebuild(view, rounds, as_int)

        # A flush empties the cache: one AllBlocksCleared, then new blocks as they come.
        assert llm.engine.scheduler.kv.clear_prefix_cache()
        view.sync_with(set())
        assert view.cleared == 1
        llm.generate([shared + _prompt(500, 10)], _params(None))
        view.sync_with(_engine_cache(llm, as_int))
        assert len(view.blocks) >= 3

        # Everything kept for replay from 0 is what PUB sent, batch for batch.
        replayed = dict(view.replay(0))
        assert sorted(replayed) == list(range(view.applied))
        assert all(view.batches[n] == payload for n, payload in replayed.items())
    finally:
        view.close()


def _params(cache_salt: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=cache_salt)


def _check_keys_rebuild(
    view: RouterView, rounds: list[tuple[list[list[int]], str | None]], as_int: bool
) -> None:
    """A router rebuilds each prompt block's key from its parent, tokens and extra keys (the first
    block's parent is the seed's root, its extra keys the salt) and finds the hash an event carries,
    with the event's own parent, tokens and extra keys."""
    keys = BlockKeys.from_seed(SEED)
    full_keys: dict[int | bytes, bytes] = {}  # external hash -> 32-byte key, from the prompts
    for prompts, salt in rounds:
        for prompt in prompts:
            parent = None
            for i in range(len(prompt) // BLOCK_SIZE):
                extra = (salt,) if salt and i == 0 else None
                parent = keys.key(parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], extra)
                full_keys[_external(parent, as_int)] = parent
    rebuilt, salted = 0, 0
    for h, event in view.blocks.items():
        i = event.block_hashes.index(h)
        parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
        extra = event.extra_keys[i] if event.extra_keys else None
        if parent is not None and parent not in full_keys:
            continue  # an output block after the prompt: its tokens came from the model
        key = keys.key(
            None if parent is None else full_keys[parent],
            event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE],
            extra,
        )
        assert _external(key, as_int) == h
        rebuilt += 1
        salted += extra == ("tenant-a",)
    assert rebuilt >= 6 and salted == 1


def test_events_are_off_by_default_and_the_flag_takes_vllm_json() -> None:
    assert not EngineConfig().kv_events.enabled
    vllm_json = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 1000, '
        '"max_queue_size": 1000, "topic": "kv@pod@model"}'
    )
    config = KVEventsConfig.from_json(vllm_json)
    assert config.enabled and config.replay_endpoint == "tcp://*:5558" and config.buffer_steps == 100
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad in ('{"endpoint": 5}', '{"buffer_steps": true}', '{"color": "red"}', "[1]", "{"):
        with pytest.raises(ConfigError, match="--kv-events-config"):
            KVEventsConfig.from_json(bad)
