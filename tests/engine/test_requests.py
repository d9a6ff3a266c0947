"""Sampling, stop rules, detokenization and bad input, as a caller of the engine sees them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tailserve.config import EngineConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.errors import ConfigError, ContextLengthExceededError, InvalidRequestError, ModelLoadError
from tailserve.weights.loader import LoadedModel
from tailserve.weights.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(smol: LoadedModel) -> LLM:
    from tailserve.config import CacheConfig, ModelConfig

    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=256),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
    )
    return LLM(config=config, loaded=smol)


def test_incremental_detokenizer_never_splits_a_character(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    text = "北京是中国的首都 🙂👍🏽 naïve café — done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_same_seed_same_output_regardless_of_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(["Once upon a time"], params)[0].token_ids
    batched = llm.generate(["Once upon a time", "The weather today", "In a distant land"], params)
    assert batched[0].token_ids == alone
    other = llm.generate(
        ["Once upon a time"], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99)
    )
    assert other[0].token_ids != alone


@pytest.mark.parametrize(
    "extra",
    [
        {"min_p": 0.05},
        {"top_k": 40},
        {"presence_penalty": 0.8, "frequency_penalty": 0.4},
        {"repetition_penalty": 1.3, "logit_bias": {13: 3.0}},
        {"min_tokens": 6, "stop_token_ids": (13,)},
    ],
)
def test_same_seed_same_output_regardless_of_batch_with_each_feature(
    llm: LLM, extra: dict[str, object]
) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=77, **extra)  # type: ignore[arg-type]
    others = SamplingParams(max_tokens=10, temperature=0.7, seed=3, presence_penalty=1.0)
    alone = llm.generate(["Once upon a time"], params)[0].token_ids
    batched = llm.generate(["Once upon a time", "The weather today"], [params, others])
    assert batched[0].token_ids == alone


def test_min_tokens_holds_off_the_end_token(llm: LLM) -> None:
    prompt = ["What is the capital of France?"]
    free = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0), chat=True)[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 30
    eos = llm.engine.tokenizer.eos_token_ids
    held = llm.generate(
        prompt, SamplingParams(max_tokens=60, temperature=0.0, min_tokens=len(free.token_ids) + 5), chat=True
    )[0]
    assert len(held.token_ids) >= len(free.token_ids) + 5
    assert not eos & set(held.token_ids[: len(free.token_ids) + 5])


def test_penalties_and_logit_bias_change_greedy_output(llm: LLM) -> None:
    prompt = ["Repeat after me: la la la la la la"]
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    repeated = len(plain) - len(set(plain))
    # (presence is a flat -2 at most: not enough against this margin; tests/model/test_sampler.py checks it)
    for extra in ({"repetition_penalty": 1.8}, {"frequency_penalty": 1.5}):
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]
        penalised = llm.generate(prompt, params)[0].token_ids
        assert len(penalised) - len(set(penalised)) < repeated, extra
    forced = llm.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0})
    )[0]
    assert forced.token_ids == [42] * 4


def test_stop_token_ids_stop_with_reason_stop(llm: LLM) -> None:
    prompt = ["Count: one, two, three, four, five, six,"]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    stop_id = free[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(stop_id) + 1]


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(["The capital of Italy is"], SamplingParams(max_tokens=8, temperature=0.0))
    top1 = llm.generate(
        ["The capital of Italy is"], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=5)
    )
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_string_is_cut_and_not_emitted(llm: LLM) -> None:
    prompt = "Count: one, two, three, four, five, six,"
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert "," in free
    stop = free.split(",")[1].strip()  # a word the model will produce
    engine = llm.engine
    engine.add_request(
        "stop", engine.tokenizer.encode(prompt), SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))
    )
    streamed, final = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
            final = out
    assert final is not None and final.finish_reason == "stop"
    assert stop not in streamed and streamed == final.text
    assert free.startswith(final.text)


def test_eos_stops_and_max_tokens_gives_length(llm: LLM) -> None:
    chat = llm.generate(
        ["What is the capital of France?"], SamplingParams(max_tokens=40, temperature=0.0), chat=True
    )[0]
    assert chat.finish_reason == "stop" and "Paris" in chat.text
    capped = llm.generate(
        ["Tell me a long story."], SamplingParams(max_tokens=3, temperature=0.0), chat=True
    )[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3
    assert capped.timings is not None and len(capped.timings.token_times) == 3
    ignoring = llm.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        chat=True,
    )[0]
    assert ignoring.finish_reason == "length" and len(ignoring.token_ids) == 20


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 9.0}, "presence_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"min_tokens": 99}, "min_tokens"),
    ],
)
def test_bad_sampling_values_are_typed_errors(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_bad_requests_raise_before_taking_blocks(llm: LLM) -> None:
    engine = llm.engine
    used = engine.stats().kv_blocks_used
    with pytest.raises(ContextLengthExceededError) as info:
        engine.add_request("long", [5] * 300, SamplingParams(max_tokens=4))
    assert info.value.param == "prompt" and "256" in str(info.value)
    with pytest.raises(ContextLengthExceededError) as info:
        engine.add_request("mt", [5] * 200, SamplingParams(max_tokens=100))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError) as bad:
        engine.add_request("bias", [5], SamplingParams(logit_bias={10**9: 1.0}))
    assert bad.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as bad:
        engine.add_request("stop", [5], SamplingParams(stop_token_ids=(10**9,)))
    assert bad.value.param == "stop_token_ids"
    assert engine.stats().kv_blocks_used == used and not engine.has_unfinished()


def test_unreadable_or_unsupported_models_raise_typed_errors(
    tmp_path: object, engine_config: Callable[..., EngineConfig]
) -> None:
    import json
    from pathlib import Path

    from tailserve.weights.loader import load_model

    base = Path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(base / "missing"), dtype=__import__("torch").float32)
    bad = base / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(bad), dtype=__import__("torch").float32)
    d = base / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(d), dtype=__import__("torch").float32)
    with pytest.raises(ModelLoadError, match="unknown preset"):
        load_model("dummy:nope", dtype=__import__("torch").float32)
    with pytest.raises(ConfigError):
        engine_config(block_size=3)


def test_logprobs_describe_the_raw_distribution(llm: LLM) -> None:
    import math

    prompt = ["The capital of Italy is"]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=5))[0]
    assert len(greedy.logprobs) == len(greedy.token_ids) == 6
    for token, lp in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert lp.token_id == token and lp.top[0][0] == token  # greedy: the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True) and len(lp.top) == 5
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5
    # Penalties, temperature and truncation change the draw, not the distribution logprobs report.
    shaped = llm.generate(
        prompt,
        SamplingParams(max_tokens=1, temperature=1.3, top_k=5, repetition_penalty=1.5, seed=1, logprobs=2),
    )[0]
    first = shaped.logprobs[0]
    assert first.top == greedy.logprobs[0].top[:2]
    assert dict(greedy.logprobs[0].top).get(first.token_id, first.logprob) == pytest.approx(
        first.logprob, abs=1e-5
    )
    plain = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.logprobs == [] and plain.token_ids == greedy.token_ids[:3]


def test_first_token_logprobs_equal_log_softmax_of_teacher_forced_logits(llm: LLM) -> None:
    import torch

    from tailserve.executor.runner import SeqChunk
    from tailserve.model.sampler import SamplingSpec

    engine = llm.engine
    prompt = engine.tokenizer.encode("The three primary colours are")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))[0]
    kv = engine.scheduler.kv
    assert kv.allocate("reference", len(prompt))  # blocks of our own: no cached prefix is overwritten
    try:
        chunk = SeqChunk(prompt, 0, kv.block_table("reference"), True, SamplingSpec(temperature=0.0))
        reference = torch.log_softmax(engine.runner.logits_for([chunk])[-1].float(), dim=-1)
    finally:
        kv.free("reference")
    lp = out.logprobs[0]
    assert lp.token_id == int(reference.argmax())
    assert abs(lp.logprob - float(reference[lp.token_id])) < 1e-4
    for token, value in lp.top:
        assert abs(value - float(reference[token])) < 1e-4
    assert [t for t, _ in lp.top] == reference.topk(20).indices.tolist()


def test_forked_siblings_share_the_prompt_blocks_and_draw_their_own_tokens(llm: LLM) -> None:
    engine = llm.engine
    prompt = engine.tokenizer.encode("A list of fruits and vegetables that grow in the garden: " * 4)
    bs = engine.scheduler.kv.block_size
    assert len(prompt) > 3 * bs

    def run(tag: str) -> tuple[list[list[int]], int]:
        ids = [f"{tag}-{i}" for i in range(3)]
        for i, rid in enumerate(ids):
            params = SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i)
            engine.add_request(rid, prompt, params, fork_of=ids[0] if i else None)
        outs: dict[str, list[int]] = {}
        peak = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
            peak = max(peak, engine.stats().kv_blocks_used)
        return [outs[rid] for rid in ids], peak

    first, peak = run("fork-a")
    again, _ = run("fork-b")
    assert first == again and len({tuple(t) for t in first}) == 3
    prompt_blocks = -(-len(prompt) // bs)
    # Shared: one copy of the prompt's full blocks, plus each sibling's own tail and output blocks.
    assert peak <= prompt_blocks + 3 * 2 < 3 * prompt_blocks
    assert engine.stats().kv_blocks_used == 0
