"""Structured outputs in the engine: every sampled token obeys the grammar, on the real model, at
temperature 1, through n-way batches and preemption; bad specs change nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
import torch

from tailserve.config import EngineConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.engine.request import GrammarSpec
from tailserve.engine.structured import _tokenizer_info
from tailserve.errors import InvalidRequestError
from tailserve.model.sampler import SamplingSpec, adjust_logits
from tailserve.weights.loader import LoadedModel

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["color", "count", "name"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(smol: LoadedModel) -> LLM:
    return LLM(loaded=smol, dtype="float32", max_model_len=2048)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"color", "count", "name"}, text
    assert obj["color"] in ("red", "green", "blue") and 1 <= obj["count"] <= 9, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, text


def test_json_schema_holds_at_temperature_one_across_seeds(llm: LLM) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = _chat(llm, "Describe a fruit as JSON.")
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, grammar=spec) for s in range(4)]
    outs = llm.generate([prompt] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        _check_schema(out.text)
    assert len({o.text for o in outs}) > 1  # sampled, not forced to one answer
    assert len(llm.engine.grammars) >= 1


def test_regex_and_choice_and_rows_without_grammar_side_by_side(llm: LLM) -> None:
    prompt = _chat(llm, "Give me a code.")
    regex = SamplingParams(
        max_tokens=20, temperature=1.0, seed=3, grammar=GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}")
    )
    choice = SamplingParams(
        max_tokens=20,
        temperature=1.0,
        seed=4,
        grammar=GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])),
    )
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate([prompt], free)[0]
    outs = llm.generate([prompt] * 3, [regex, choice, free])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("yes", "no", "maybe") and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == alone.token_ids  # a grammar row beside it changes nothing for it


def test_preemption_keeps_matcher_state(
    smol: LoadedModel, engine_config: Callable[..., EngineConfig]
) -> None:
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2 fp32 KV bytes for one 16-token block
    llm = LLM(config=engine_config(kv_cache_memory_bytes=12 * block_bytes), loaded=smol)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = _chat(llm, "Describe a fruit as JSON, please, with a color, a count and a short name.")
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=10 + s, grammar=spec) for s in range(4)]
    outs = llm.generate([prompt] * 4, params)
    assert llm.engine.stats().preemptions_total > 0
    for out in outs:
        _check_schema(out.text)


def test_malformed_schema_is_rejected_before_anything_is_queued(llm: LLM) -> None:
    cached = len(llm.engine.grammars)
    bad = GrammarSpec(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}', "response_format"
    )
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("bad", _chat(llm, "hi"), SamplingParams(max_tokens=4, grammar=bad))
    assert err.value.param == "response_format"
    assert not llm.engine.has_unfinished() and len(llm.engine.grammars) == cached
    with pytest.raises(InvalidRequestError):
        llm.engine.grammars.compile(GrammarSpec("regex", "[unclosed", "structured_outputs.regex"))


def test_cache_compiles_each_spec_once(llm: LLM) -> None:
    spec = GrammarSpec("regex", "ab+c")
    first = llm.engine.grammars.compile(spec)
    assert llm.engine.grammars.compile(GrammarSpec("regex", "ab+c", param="other")) is first


def test_a_grammar_prepared_for_a_request_on_its_way_is_not_evicted() -> None:
    """More distinct schemas in flight than the cache holds: the one prepared ahead must still be
    there when the engine thread makes the request's matcher (the step loop never compiles)."""
    from tailserve.engine.structured import GrammarCache
    from tailserve.weights.tokenizer import ByteTokenizer, Tokenizer

    cache = GrammarCache(Tokenizer(ByteTokenizer(512), [2]), 512, capacity=2)
    prepared = cache.compile(GrammarSpec("regex", "a+"), prepare=True)
    for i in range(4):  # other requests' grammars push it to the cold end of the LRU
        cache.compile(GrammarSpec("regex", f"b{{{i + 1}}}"))
    assert cache.compile(GrammarSpec("regex", "a+")) is prepared
    assert len(cache) == 2  # the ones nobody waits for are still evicted


def test_vocabulary_bytes_spell_the_text(smol: LoadedModel) -> None:
    """The bytes the grammar sees per token concatenate to the text those tokens decode to."""
    import xgrammar

    tok = smol.tokenizer
    info = _tokenizer_info(xgrammar, tok, smol.arch.vocab_size)
    vocab = info.decoded_vocab
    text = 'Grüße, {"naïve": [1, 2]}\n\tend'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(vocab[t] for t in ids) == text.encode()
    assert set(info.stop_token_ids) == set(tok.eos_token_ids)


def test_bitmask_touches_only_its_rows() -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    mask = torch.zeros(3, 3, dtype=torch.int32)
    mask[1, 0] = 1 << 5  # token 5
    mask[1, 2] = 1 << 1  # token 65
    specs = [SamplingSpec(), SamplingSpec(token_bitmask=mask[1]), SamplingSpec()]
    out = adjust_logits(logits, specs)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [5, 65] and torch.equal(out[1, allowed], logits[1, allowed])
    assert adjust_logits(logits, [SamplingSpec()] * 3) is logits  # no grammar: no copy at all


def test_length_bounded_strings_admit_no_raw_control_characters() -> None:
    """JSON forbids raw control characters in strings; a maxLength string must not let them in."""
    from tailserve.engine.structured import GrammarCache
    from tailserve.weights.tokenizer import ByteTokenizer, Tokenizer

    cache = GrammarCache(Tokenizer(ByteTokenizer(512), [2]), 512)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}
    matcher = cache.matcher(GrammarSpec("json_schema", json.dumps(schema)))
    assert all(matcher.accept(b + 3) for b in b'{"a": "')  # byte b is token b + 3
    words = cache.bitmask([matcher])[0]
    allowed = {t - 3 for t in range(3, 259) if int(words[t // 32]) >> (t % 32) & 1}
    assert ord("x") in allowed and ord('"') in allowed  # a character, or the end of the string
    assert not allowed & set(range(32)) and ord("\\") not in allowed


def test_min_tokens_does_not_hold_a_complete_grammar_open(llm: LLM) -> None:
    """min_tokens bans the end token, but a finished choice can only end: the grammar wins."""
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))
    params = SamplingParams(max_tokens=20, min_tokens=10, temperature=1.0, seed=2, grammar=spec)
    (out,) = llm.generate([_chat(llm, "Yes or no?")], params)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert not llm.engine.has_unfinished()
