"""`tailserve serve --kv-events-config <vLLM's JSON>`: a prompt sent over HTTP shows up as BlockStored
events on the ZMQ stream, its blocks' tokens and keys as a router outside the process rebuilds them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import zmq

from tailserve.engine.block_keys import BlockKeys
from tests.engine.test_kv_events import DECODERS, BlockStored
from tests.server.harness import serve_process

SEED = "7"


def _replay_all(endpoint: str) -> list[bytes]:
    """Every batch the replay socket keeps, from sequence number 0."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = []
        while True:
            assert dealer.poll(30_000), "replay never answered"
            _, _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return payloads
            payloads.append(payload)
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_the_serve_flag_publishes_the_prompt_blocks(tmp_path: Path) -> None:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv@pod-0@dummy-tiny",
        "int_block_hashes": False,
    }
    args = ["--model", "dummy:tiny", "--kv-events-config", json.dumps(config), "--prefix-cache-seed", SEED]
    prompt = [(11 * i) % 400 + 5 for i in range(40)]
    with serve_process(args) as server:
        reply = httpx.post(
            f"{server.base}/v1/completions",
            json={"model": "dummy-tiny", "prompt": prompt, "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        stored: list[BlockStored] = []
        for _ in range(100):  # the publisher thread may not have sent the last batch yet
            batches = [DECODERS["array"].decode(p) for p in _replay_all(config["replay_endpoint"])]
            stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
            if any(e.token_ids[:16] == prompt[:16] for e in stored):
                break
            time.sleep(0.1)
    first = next(e for e in stored if e.token_ids[:16] == prompt[:16])
    keys = BlockKeys.from_seed(SEED)
    key0 = keys.key(None, prompt[:16])
    assert first.parent_block_hash is None and first.block_hashes[:2] == [key0, keys.key(key0, prompt[16:32])]
