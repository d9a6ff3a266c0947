"""Developer check, outside CI: decode tailserve's KV-cache events with vLLM's own classes, and rebuild
their block hashes with vLLM's own hash functions.

Run with tailserve's interpreter: `.venv/bin/python scripts/check_kv_events_vllm.py [VLLM_PYTHON]`
(default benchmarks/.venvs/vllm/bin/python). It runs dummy:tiny in-process with events on (each
encoding), collects every batch from the replay socket, then runs itself under vLLM's interpreter
with --decode to read them with vllm.distributed.kv_events and vllm.v1.core.kv_cache_utils. Exit 0
when every check that vLLM's version can make passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SEED = "1234"  # PYTHONHASHSEED for both sides
BLOCK = 16
REPO = Path(__file__).resolve().parents[1]


def capture_batches(workdir: Path, encoding: str) -> dict[str, object]:
    """Run the workload and read every batch back from the replay socket before closing."""
    import zmq

    from tailserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig
    from tailserve.engine import LLM, SamplingParams

    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{workdir}/{encoding}-pub",
        replay_endpoint=f"ipc://{workdir}/{encoding}-replay",
        int_block_hashes=False,
        event_encoding=encoding,
    )
    model = ModelConfig(
        model="dummy:tiny", weight_format="fp32", device="cpu", max_model_len=256, num_threads=1
    )
    cache = CacheConfig(kv_cache_memory_bytes=24 * BLOCK * 512, block_size=BLOCK, prefix_cache_seed=SEED)
    llm = LLM(config=EngineConfig(model=model, cache=cache, kv_events=events))
    prompts = [
        [(s + 7 * i) % 500 + 3 for i in range(n)] for s, n in [(1, 70), (1, 90), (200, 100), (300, 120)]
    ]
    salted = [(2 + 7 * i) % 500 + 3 for i in range(40)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    llm.generate(
        [salted], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_salt="tenant-a")
    )
    llm.engine.scheduler.kv.clear_prefix_cache()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{workdir}/{encoding}-replay")
    batches: list[str] = []
    expected = 3  # two generate calls and the flush: at least this many batches once all is sent
    while len(batches) < expected:
        batches = []
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(30_000), "replay never answered"
            _, _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            batches.append(payload.hex())
    dealer.close(0)
    ctx.term()
    llm.close()
    return {"batches": batches, "prompts": prompts, "salted": salted}


def decode(path: Path) -> int:
    """Under vLLM's interpreter: decode with vLLM's classes, rebuild hashes with vLLM's functions."""
    import msgspec
    import vllm
    from vllm.distributed import kv_events as ke
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu

    print(f"vLLM {vllm.__version__}")
    kcu.init_none_hash(sha256_cbor)  # PYTHONHASHSEED is set by the caller
    data = json.loads(path.read_text())
    failures = 0
    for encoding, run in data.items():
        decoder = msgspec.msgpack.Decoder(ke.KVEventBatch)
        events = []
        try:
            for payload in run["batches"]:
                events += decoder.decode(bytes.fromhex(payload)).events
        except msgspec.ValidationError as exc:
            print(f"{encoding}: vLLM's KVEventBatch refuses it: {exc}")
            if encoding == "map":
                failures += 1
            continue
        names = sorted({type(e).__name__ for e in events})
        print(
            f"{encoding}: {len(run['batches'])} batches, {len(events)} events decoded by vLLM's classes: {names}"
        )
        # vLLM's own hashes of the same prompts (first-block extra keys: the salt, as tailserve keys it).
        expected: set[bytes] = set()
        for prompt, salt in [(p, None) for p in run["prompts"]] + [(run["salted"], "tenant-a")]:
            parent = None
            for i in range(len(prompt) // BLOCK):
                extra = (salt,) if salt and i == 0 else None
                parent = kcu.hash_block_tokens(
                    sha256_cbor, parent, prompt[i * BLOCK : (i + 1) * BLOCK], extra
                )
                expected.add(bytes(parent))
        stored = {bytes(h) for e in events if isinstance(e, ke.BlockStored) for h in e.block_hashes}
        missing = expected - stored
        print(
            f"{encoding}: {len(expected)} prompt blocks hashed by vLLM, {len(missing)} not in tailserve's events"
        )
        failures += bool(missing)
        cleared = sum(isinstance(e, ke.AllBlocksCleared) for e in events)
        print(
            f"{encoding}: AllBlocksCleared x{cleared}, BlockRemoved x{sum(isinstance(e, ke.BlockRemoved) for e in events)}"
        )
    return 1 if failures else 0


def main() -> int:
    if sys.argv[1:2] == ["--decode"]:
        return decode(Path(sys.argv[2]))
    vllm_python = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "benchmarks/.venvs/vllm/bin/python")
    if not Path(vllm_python).exists():
        print(f"no vLLM interpreter at {vllm_python}: nothing to check")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        runs = {encoding: capture_batches(workdir, encoding) for encoding in ("array", "map")}
        out = workdir / "runs.json"
        out.write_text(json.dumps(runs))
        env = {**os.environ, "PYTHONHASHSEED": SEED}
        return subprocess.run([vllm_python, __file__, "--decode", str(out)], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
