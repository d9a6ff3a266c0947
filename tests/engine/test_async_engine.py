"""AsyncEngine streams tokens as produced; closing a stream or aborting from another thread frees blocks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine, SamplingParams
from tailserve.errors import InvalidRequestError
from tailserve.model.loader import LoadedModel


def _config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )


async def _wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        s = engine.stats()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_streams_deliver_every_token_and_aborts_free_blocks(smol: LoadedModel) -> None:
    async def main() -> None:
        engine = AsyncEngine(_config(), loaded=smol)
        await engine.start()
        tok = engine.tokenizer
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        prompts = [
            tok.encode(p) for p in ("The sun rises in the", "Water is made of", "The best way to learn is")
        ]

        async def collect(rid: str, ids: list[int]) -> tuple[str, list[str], str | None]:
            pieces, reason = [], None
            async for out in engine.generate(rid, ids, greedy):
                pieces.append(out.new_text)
                reason = out.finish_reason
                final = out.text
            return final, pieces, reason

        results = await asyncio.gather(*(collect(f"s{i}", p) for i, p in enumerate(prompts)))
        for final, pieces, reason in results:
            assert "".join(pieces) == final and reason == "length"
            assert len(pieces) == 12  # one output per generated token, as produced

        # Closing the stream early (a client went away) aborts the request.
        gen = engine.generate("early", prompts[0], SamplingParams(max_tokens=200, temperature=0.0))
        async for _ in gen:
            break
        await gen.aclose()
        await _wait_idle(engine)

        # Abort from another thread while tokens stream.
        seen = 0
        stream = engine.generate("threaded", prompts[1], SamplingParams(max_tokens=200, temperature=0.0))
        async for out in stream:
            seen += 1
            if seen == 3:
                threading.Thread(target=engine.abort, args=("threaded",)).start()
            if out.finished:
                assert out.finish_reason == "abort"
        assert seen < 200
        await _wait_idle(engine)

        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate("bad", [], greedy):
                pass
        await engine.shutdown()

    asyncio.run(main())


def test_cli_generate_answers_paris() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tailserve.cli", "generate", "--chat", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_cli_generate_reports_bad_model() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tailserve.cli", "generate", "--model", "/no/such/model", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr
