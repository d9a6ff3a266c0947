"""Greedy generations equal transformers' `generate`, whatever the batching, chunking, caching or preemption."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from tailserve.config import EngineConfig
from tailserve.engine import LLM, RequestOutput, SamplingParams
from tailserve.weights.loader import LoadedModel

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write one sentence about the ocean.",
    "What language is spoken in Brazil?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "List the days of the week.",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smol: LoadedModel) -> list[list[int]]:
    system = [{"role": "system", "content": "You are a concise assistant. Answer briefly."}]
    return [smol.tokenizer.apply_chat_template(system + [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]], hf_reference: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf_reference.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [o.token_ids for o in outs]


def _assert_pool_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_concurrent_greedy_equals_transformers(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    llm = LLM(config=engine_config(), loaded=smol)
    assert _run(llm, prompts) == reference
    _assert_pool_free(llm)
    assert "Paris" in llm.tokenizer.decode(reference[0])


def test_tiny_token_budget_chunks_prefill_same_tokens(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    llm = LLM(
        config=engine_config(max_num_batched_tokens=24, max_num_seqs=16, prefill_step_tokens=0), loaded=smol
    )
    assert _run(llm, prompts) == reference
    assert llm.engine.stats().steps_total > sum(len(p) for p in prompts) // 24  # prompts really were chunked
    _assert_pool_free(llm)


def test_a_prompt_with_nothing_decoding_takes_one_longer_step_same_tokens(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """With no stream decoding, the first prompt in line goes in one step of up to
    --prefill-step-tokens (against a 24-token step budget), and only it: the prompts queued behind
    it, and those that arrive while streams decode, go back to the step budget. Every token is still
    transformers'."""
    config = engine_config(max_num_batched_tokens=24, max_num_seqs=16, prefill_step_tokens=4096)
    llm = LLM(config=config, loaded=smol)
    engine, outs = llm.engine, dict[str, list[int]]()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert len(prompts[0]) > 24
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    _collect(outs, engine.step())
    plan = engine.last_plan
    assert plan is not None and plan.num_decodes == 0
    assert [(req.request_id, n) for req, n in plan.scheduled] == [("r0", len(prompts[0]))]
    while engine.has_unfinished():
        _collect(outs, engine.step())
        assert engine.last_plan is not None and engine.last_plan.num_decodes > 0  # r0 decodes from now on
        assert engine.last_plan.num_tokens <= 24
    assert [outs[f"r{i}"] for i in range(len(prompts))] == reference
    _assert_pool_free(llm)


def test_repeated_prefix_hits_cache_same_tokens(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    llm = LLM(config=engine_config(), loaded=smol)
    assert _run(llm, prompts[:1]) == reference[:1]  # warms the cache with the shared system prompt
    before = llm.engine.stats().prefix_cache_hits
    assert _run(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits - before >= 16 * len(prompts)  # at least one full block each
    outs = llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    assert all(o.num_cached_tokens >= 16 for o in outs)
    _assert_pool_free(llm)


def test_tiny_pool_forces_preemption_same_tokens(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2 fp32 KV bytes for one 16-token block
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = -(-longest // 16) * 3  # room for about three sequences at once
    llm = LLM(config=engine_config(kv_cache_memory_bytes=num_blocks * block_bytes), loaded=smol)
    assert llm.engine.stats().kv_blocks_total == num_blocks
    assert _run(llm, prompts) == reference
    assert llm.engine.stats().preemptions_total > 0
    _assert_pool_free(llm)


def test_abort_mid_generation_frees_every_block(
    smol: LoadedModel, engine_config: Callable[..., EngineConfig], prompts: list[list[int]]
) -> None:
    llm = LLM(config=engine_config(max_num_batched_tokens=32, max_num_seqs=16), loaded=smol)
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(6):  # some mid-prefill, some decoding
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    for i in range(len(prompts)):
        out = engine.abort(f"r{i}")
        assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("r0") is None  # idempotent
    assert not engine.has_unfinished()
    _assert_pool_free(llm)


def test_each_engine_steps_on_its_own_thread_count() -> None:
    """torch's thread count is per process: an engine built after another (here with another
    --num-threads) must not leave the first one stepping on its count, and a step of either
    leaves the count it ran on, whatever the caller set in between."""
    before = torch.get_num_threads()
    engines = {n: LLM("dummy:tiny", weight_format="bf16", num_threads=n, max_model_len=64) for n in (1, 2)}
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(3)  # the caller's own setting, between steps
            out = engines[n].generate([[1, 5, 9, 13]], params)
            assert len(out[0].token_ids) == 3
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def _lane_llm(smol: LoadedModel, engine_config: Callable[..., EngineConfig], **scheduler: object) -> LLM:
    """An engine on 2 threads, so prompts that arrive while others decode go to the prefill lane (a
    thread each). Late prompts stay on the lane (their move to all threads depends on wall-clock step
    times; it has tests of its own)."""
    config = engine_config(**{"late_prompts_all_threads": False, **scheduler})
    llm = LLM(
        config=dataclasses.replace(config, model=dataclasses.replace(config.model, num_threads=2)),
        loaded=smol,
    )
    assert llm.engine.lane is not None
    return llm


def _collect(outs: dict[str, list[int]], step: list[RequestOutput]) -> None:
    for o in step:
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)


def _lane_llm_decoding(
    smol: LoadedModel, engine_config: Callable[..., EngineConfig], prompt: list[int]
) -> tuple[LLM, dict[str, list[int]], SamplingParams]:
    """A lane engine with request "a" decoding (its first token out), so the next prompts go to the
    lane; the outputs collected so far and the greedy parameters."""
    llm = _lane_llm(smol, engine_config)
    outs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm.engine.add_request("a", prompt, params)
    while "a" not in outs:
        _collect(outs, llm.engine.step())
    return llm, outs, params


def test_prefill_lane_same_tokens(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """Prompts arriving one by one while earlier ones decode are computed on the prefill lane beside
    the decode steps, in chunks of the lane's own budget, and every token is still transformers'."""
    # Unpaced: the pacing rule holds a prompt off the lane by measured step times, so on a busy
    # machine prompts went partly through ordinary steps and no lane chunk reached 24 (pacing has
    # tests of its own, in virtual time: tests/engine/test_lane_pacing.py). First come, first
    # served: under the SLO policy a prompt kept waiting past its TTFT target (wall clock, so on a
    # slow run) is past saving and holds a reserve of each chunk that nothing else may take, and the
    # largest chunk was 17 in a fresh-clone CI run (the reserve has its own tests: tests/engine/test_past_saving.py).
    llm = _lane_llm(
        smol,
        engine_config,
        max_num_batched_tokens=32,
        lane_chunk_tokens=24,
        max_num_seqs=16,
        pace_lane=False,
        policy="fcfs",
    )
    engine, outs, lane_steps = llm.engine, dict[str, list[int]](), 0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    lane, chunks = engine.lane, []
    assert lane is not None
    submit = lane.submit
    lane.submit = lambda plan, c: chunks.append(plan) or submit(plan, c)  # type: ignore[method-assign]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        for _ in range(3):
            _collect(outs, engine.step())
            lane_steps += bool(engine.scheduler.in_flight)
    while engine.has_unfinished():
        _collect(outs, engine.step())
    assert lane_steps >= len(prompts) - 1  # every prompt after the first met a decoding stream
    assert [outs[f"r{i}"] for i in range(len(prompts))] == reference
    # The lane's chunks are timed apart from the steps (half the threads), each prompt of a chunk
    # apart (it runs them one by one), and counted once.
    assert engine.scheduler.lane_timer.steps == sum(len(plan.scheduled) for plan in chunks) >= 1
    # A lane chunk holds at most --lane-chunk-tokens (24), not the step budget (32). Whether one is
    # full depends on how much of its prompt ordinary steps took first, which is timing: with the
    # faster decode rows of the no-bf16 kind the largest was 17 in one fresh-clone CI run of three.
    assert 0 < max(plan.num_prefill_tokens for plan in chunks) <= 24
    stats = engine.stats()
    assert stats.steps_total == sum(h.count for h in stats.steps.duration_s)
    _assert_pool_free(llm)


def test_abort_of_a_prompt_on_the_prefill_lane(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """Aborting a request whose chunk is computing on the lane waits for the chunk (its KV blocks are
    being written) and frees them; the chunk's other prompt and the decoding stream go on unchanged."""
    llm, outs, params = _lane_llm_decoding(smol, engine_config, prompts[0])
    engine = llm.engine
    engine.add_request("b", prompts[1], params)
    engine.add_request("c", prompts[2], params)
    _collect(outs, engine.step())
    assert engine.scheduler.in_flight == {"b", "c"}  # one lane plan for both prompts, run one by one
    out = engine.abort("b")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert "b" not in engine.scheduler.in_flight and engine.has_unfinished()
    while engine.has_unfinished():
        _collect(outs, engine.step())
    assert outs["a"] == reference[0] and outs["c"] == reference[2]
    _assert_pool_free(llm)


def test_a_late_prompt_runs_on_all_threads_in_the_decodes_step(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """Where the scheduler moves a late prompt off the lane (its TTFT deadline passes there and not on
    all threads: tests/engine/test_lane_pacing.py), its chunk runs in the decodes' own step on all
    threads, nothing goes to the lane, and every token is still transformers'."""
    llm, outs, params = _lane_llm_decoding(smol, engine_config, prompts[0])
    engine = llm.engine
    lane = engine.lane
    assert lane is not None
    engine.scheduler._all_threads_saves = lambda first, decodes, now: True  # type: ignore[method-assign]
    engine.add_request("b", prompts[1], params)
    step = engine.step()
    assert not lane.busy and not engine.scheduler.in_flight
    plan = engine.last_plan
    assert plan is not None and plan.all_threads and plan.num_decodes == 1
    assert [r.request_id for r, _ in plan.scheduled] == ["a", "b"]  # its whole prompt (less the cached)
    assert {o.request_id for o in step} == {"a", "b"}  # the stream's token and the prompt's first
    _collect(outs, step)
    while engine.has_unfinished():
        _collect(outs, engine.step())
    assert outs["a"] == reference[0] and outs["b"] == reference[1]
    assert engine.scheduler.lane_timer.steps == 0
    _assert_pool_free(llm)


def test_a_lane_chunk_s_first_token_does_not_wait_for_another_decode_step(
    smol: LoadedModel, engine_config: Callable[..., EngineConfig], prompts: list[list[int]]
) -> None:
    """Once a lane chunk ends, the next step hands out its first token before it plans or runs
    anything: a client sees the token when the prompt is done, not one decode step later."""
    llm, outs, params = _lane_llm_decoding(smol, engine_config, prompts[0])
    engine = llm.engine
    engine.add_request("b", prompts[1], params)
    _collect(outs, engine.step())
    lane = engine.lane
    assert lane is not None and engine.scheduler.in_flight == {"b"}
    while not lane.done():
        _collect(outs, engine.step())
    assert "b" not in outs
    runs: list[int] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda *a, **k: runs.append(1) or execute(*a, **k)  # type: ignore[method-assign]
    first = engine.step()
    assert [o.request_id for o in first] == ["b"] and len(first[0].new_token_ids) == 1
    assert not runs  # no step ran before the token went out
    while engine.has_unfinished():
        _collect(outs, engine.step())
    assert runs and outs["b"]  # the steps go on after it
    _assert_pool_free(llm)


def test_a_lane_plan_s_prompts_run_one_by_one_each_first_token_out_when_its_own_ends(
    smol: LoadedModel,
    engine_config: Callable[..., EngineConfig],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """Two prompts handed to the lane in one plan run as two forwards, back to back: the first one's
    token goes out when its own forward ends, not when the pair's would (a pair's first prompt waited
    for the second's rows), and every token is still transformers'."""
    llm, outs, params = _lane_llm_decoding(smol, engine_config, prompts[0])
    engine = llm.engine
    lane = engine.lane
    assert lane is not None
    forwards: list[list[int]] = []  # each forward on the lane: its chunks' tokens
    run = lane._run
    lane._run = lambda chunks: forwards.append([len(c.token_ids) for c in chunks]) or run(chunks)  # type: ignore[method-assign]
    engine.add_request("b", prompts[1], params)
    engine.add_request("c", prompts[2], params)
    _collect(outs, engine.step())
    assert engine.scheduler.in_flight == {"b", "c"}  # one plan for both
    while not lane.done():
        _collect(outs, engine.step())
    first = engine.step()
    assert [o.request_id for o in first] == ["b"]  # c's forward still to end, or to be taken next
    assert engine.scheduler.in_flight == {"c"} and "c" not in outs
    _collect(outs, first)
    while engine.has_unfinished():
        _collect(outs, engine.step())
    assert len(forwards) == 2 and all(len(f) == 1 for f in forwards)  # a forward a prompt
    assert [outs["a"], outs["b"], outs["c"]] == reference[:3]
    assert engine.scheduler.lane_timer.steps == 2  # each prompt timed on its own
    _assert_pool_free(llm)


class _FailingRunner:
    def execute(self, chunks: object, threads: int | None = None) -> None:
        raise RuntimeError("the lane's chunk failed")


def test_a_failed_lane_chunk_fails_a_step_and_holds_no_block(
    smol: LoadedModel, engine_config: Callable[..., EngineConfig], prompts: list[list[int]]
) -> None:
    """An error on the lane's thread surfaces from a step on the loop's thread (where the server
    aborts everything), and leaves nothing in flight: every request aborts and frees its blocks."""
    llm, _, params = _lane_llm_decoding(smol, engine_config, prompts[0])
    engine = llm.engine
    assert engine.lane is not None
    engine.lane.runner = _FailingRunner()  # type: ignore[assignment]
    engine.add_request("b", prompts[1], params)
    with pytest.raises(RuntimeError, match="lane's chunk failed"):
        for _ in range(MAX_TOKENS):
            engine.step()
    assert not engine.scheduler.in_flight
    assert {o.request_id for o in engine.abort_all()} == {"a", "b"}
    _assert_pool_free(llm)
