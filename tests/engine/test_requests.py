"""Sampling, stop rules, detokenization and bad input, as a caller of the engine sees them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tailserve.config import EngineConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.errors import ConfigError, ContextLengthExceededError, InvalidRequestError, ModelLoadError
from tailserve.model.loader import LoadedModel
from tailserve.model.tokenizer import IncrementalDetokenizer


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
    assert engine.stats().kv_blocks_used == used and not engine.has_unfinished()


def test_unreadable_or_unsupported_models_raise_typed_errors(
    tmp_path: object, engine_config: Callable[..., EngineConfig]
) -> None:
    import json
    from pathlib import Path

    from tailserve.model.loader import load_model

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
