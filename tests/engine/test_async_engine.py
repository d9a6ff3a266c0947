"""AsyncEngine streams tokens as produced; closing a stream or aborting from another thread frees blocks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine, SamplingParams
from tailserve.engine.llm_engine import LLMEngine
from tailserve.errors import InvalidRequestError
from tailserve.weights.loader import LoadedModel


def _config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )


def _small_steps(policy: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, policy=policy),
    )


def _serve_by_hand(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    """One greedy token for `prompt`, stepping the engine on this thread (its blocks join the cache)."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


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


def test_wait_estimate_counts_requests_not_yet_seen_by_the_step_loop(smol: LoadedModel) -> None:
    """A burst arrives faster than the engine thread drains its inbox: each generate() call must
    raise the next request's predicted wait at once, not after the next step."""

    async def main() -> None:
        engine = AsyncEngine(_small_steps("fcfs"), loaded=smol)
        # Teach the step timer its cost per prompt token with one prefill, driven by hand.
        _serve_by_hand(engine.engine, "timer", list(range(100, 150)))
        prompt = list(range(200, 250))
        alone = engine.estimate_wait(len(prompt))
        assert not alone.queued and alone.ttft_s == alone.alone_s > 0  # nothing ahead: its own prefill
        # The step loop is not started: these requests sit in the inbox, unseen by the engine.
        streams = [engine.generate(f"b{i}", prompt, SamplingParams(max_tokens=4)) for i in range(3)]
        waits = [engine.estimate_wait_s(len(prompt))]
        streams.append(engine.generate("b3", prompt, SamplingParams(max_tokens=4)))
        waits.append(engine.estimate_wait_s(len(prompt)))
        assert alone.ttft_s < waits[0] < waits[1]
        await engine.start()
        for stream in streams:
            async for _ in stream:
                pass
        await _wait_idle(engine)
        assert not engine.estimate_wait(len(prompt)).queued  # seen, served, gone from the count
        await engine.shutdown()

    asyncio.run(main())


def test_wait_estimate_prices_only_the_prompt_tokens_the_prefix_cache_lacks(smol: LoadedModel) -> None:
    """A follow-up turn resends a history the cache holds: admission must price the new tokens only,
    for the newcomer and for everything queued ahead of it, or it refuses turns that would make
    their target (seen in the multi-turn comparison: 429s while P99 TTFT was well within it)."""

    async def main() -> None:
        engine = AsyncEngine(_small_steps("fcfs"), loaded=smol)
        history = list(range(100, 300))  # 200 tokens, served once: 12 full blocks of 16 cached
        _serve_by_hand(engine.engine, "turn1", history)
        params = SamplingParams(max_tokens=4)
        follow_up = history + list(range(400, 420))  # 220 tokens, the first 192 cached
        unrelated = list(range(600, 820))  # 220 tokens, none cached
        work = engine.engine.prompt_work_tokens
        assert work(follow_up, params) == 220 - 192
        assert work(unrelated, params) == 220
        # Prompt logprobs cannot come from the cache: such a request computes its whole prompt.
        assert work(follow_up, SamplingParams(max_tokens=4, prompt_logprobs=0)) == 220
        # Something ahead (the step loop is not started), then each kind queued: the follow-up adds
        # far less predicted wait for the next newcomer than the unrelated prompt does.
        streams = [engine.generate("ahead", list(range(900, 964)), params)]
        newcomer = 64
        before = engine.estimate_wait_s(newcomer)
        # submit prices it once, for admission and for the queue alike (the admit here admits all).
        admitted = engine.submit("follow-up", follow_up, params, lambda quote: quote)
        assert admitted.ticket.work_tokens == 220 - 192
        assert admitted.ticket.predicted_wait_s > 0  # "ahead" is queued before it
        streams.append(admitted.stream)
        after_follow_up = engine.estimate_wait_s(newcomer)
        streams.append(engine.generate("unrelated", unrelated, params))
        after_unrelated = engine.estimate_wait_s(newcomer)
        assert 0 < after_follow_up - before < (after_unrelated - after_follow_up) / 2
        await engine.start()
        for stream in streams:
            async for _ in stream:
                pass
        await _wait_idle(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_a_queued_follow_up_counts_only_its_uncached_tokens_in_the_engine_snapshot(smol: LoadedModel) -> None:
    engine = AsyncEngine(_small_steps("slo"), loaded=smol).engine
    history = list(range(100, 300))
    _serve_by_hand(engine, "turn1", history)
    engine.add_request("turn2", history + list(range(400, 420)), SamplingParams(max_tokens=2))
    assert [p[0] for p in engine.queue_snapshot().pending] == [28]  # waiting: 220 less 192 cached
    engine.step()  # scheduled: the prefix is matched, and the count is what is left to compute
    pending = engine.queue_snapshot().pending
    assert pending == [] or pending[0][0] < 28
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().prefix_cache_hits >= 192


def test_refused_request_raises_on_the_stream_and_a_duplicate_id_keeps_the_first(smol: LoadedModel) -> None:
    async def main() -> None:
        engine = AsyncEngine(_config(), loaded=smol)
        await engine.start()
        too_long = SamplingParams(max_tokens=10_000)
        with pytest.raises(InvalidRequestError):  # LLMEngine.add_request is the one border
            async for _ in engine.generate("long", [1, 2, 3], too_long):
                pass
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        first = engine.generate("same", [5, 6, 7], params)
        second = engine.generate("same", [5, 6, 7], params)
        with pytest.raises(InvalidRequestError):
            async for _ in second:
                pass
        outs = [out async for out in first]
        assert outs[-1].finished and len(outs[-1].token_ids) == 30
        await _wait_idle(engine)
        await engine.shutdown()

    asyncio.run(main())
