"""Request parsing and validation: every bad body names its field; supported fields reach SamplingParams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tailserve.engine.request import MAX_CACHE_SALT_CHARS
from tailserve.errors import ContextLengthExceededError, InvalidRequestError
from tailserve.http.errors import InvalidJSONError, UnsupportedParameterError, to_http
from tailserve.http.json_body import parse_json
from tailserve.server.generation_defaults import GenerationDefaults, read_generation_defaults
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_prompt_ids,
    completion_prompt_ids,
    validate_body,
)
from tailserve.server.sampling_args import sampling_params
from tailserve.server.serving import api_key_cache_salt
from tests.server.fake_engine import ByteTokenizer

TOK = ByteTokenizer()


def completion(**fields: Any) -> CompletionRequest:
    return validate_body(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return validate_body(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'"text"', b"\xff\xfe{}", b""])
def test_bad_json_is_400_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidJSONError) as info:
        parse_json(body)
    assert to_http(info.value).status == 400
    assert to_http(info.value).body["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"stop": 3}, "stop"),
        ({"frobnicate": True}, "frobnicate"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        completion(**fields)
    assert info.value.param == param
    assert param.split(".")[0] in info.value.message


def test_missing_fields_name_the_field() -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_body(CompletionRequest, {"model": "m"})
    assert info.value.param == "prompt" and "Missing" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        validate_body(ChatCompletionRequest, {"messages": []})
    assert info.value.param == "model"


def test_message_errors_point_into_the_list() -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert info.value.param == "messages[1].role"
    with pytest.raises(UnsupportedParameterError) as info2:
        chat_prompt_ids(chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), TOK)
    assert info2.value.param == "messages[0].content"
    with pytest.raises(InvalidRequestError) as info:
        chat_prompt_ids(chat(messages=[]), TOK)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_completion_parameters_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedParameterError) as info:
        sampling_params(completion(**fields), 2, 100, 1024)
    assert info.value.param == param
    assert to_http(info.value).status == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),  # the legacy API; tools replace it
        ({"function_call": {"name": "f"}}, "function_call"),
    ],
)
def test_unsupported_chat_parameters_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedParameterError) as info:
        sampling_params(chat(**fields), 2, 100, 1024)
    assert info.value.param == param


def test_default_values_of_unsupported_parameters_are_accepted() -> None:
    fields = {
        "n": 1,
        "logprobs": False,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    sampling_params(chat(**fields, presence_penalty=0, frequency_penalty=0.0, logit_bias={}), 2, 100, 1024)
    sampling_params(completion(n=1, echo=False, best_of=1, logprobs=None), 2, 100, 1024)


def test_sampling_fields_reach_sampling_params() -> None:
    req = completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop=["x", "yz"], ignore_eos=True
    )
    p = sampling_params(req, 2, 100, 1024)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.0, 0.5, 3, 11)
    assert p.stop == ("x", "yz") and p.ignore_eos
    assert sampling_params(completion(stop="."), 2, 100, 1024).stop == (".",)
    assert sampling_params(completion(), 2, 100, 1024).max_tokens == 16  # the OpenAI completions default


def test_penalties_min_p_min_tokens_bias_and_stop_ids_reach_sampling_params() -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 3,
        "stop_token_ids": [7, 9],
        "logit_bias": {"12": 5.0, "3": -100},
    }
    for req in (completion(**fields), chat(**fields)):
        p = sampling_params(req, 2, 100, 1024)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
        assert (p.min_p, p.min_tokens, p.stop_token_ids) == (0.05, 3, (7, 9))
        assert p.logit_bias == ((12, 5.0), (3, -100.0))


def test_sdk_routine_fields_are_accepted_and_change_nothing() -> None:
    plain = sampling_params(chat(), 2, 100, 1024)
    routine = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u1"}
    assert sampling_params(chat(**routine), 2, 100, 1024) == plain
    streamed = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert streamed.stream_options is not None and streamed.stream_options.continuous_usage_stats


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_extensions_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(completion(**fields), 2, 100, 1024)
    assert info.value.param == param
    assert to_http(info.value).status == 400


def test_cache_salt_reaches_sampling_params_and_a_bad_one_names_the_field() -> None:
    assert sampling_params(completion(cache_salt="tenant-1"), 2, 100, 1024).cache_salt == "tenant-1"
    assert sampling_params(chat(cache_salt="t" * MAX_CACHE_SALT_CHARS), 2, 100, 1024).cache_salt
    assert sampling_params(completion(), 2, 100, 1024).cache_salt is None
    for salt in ("", "t" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(InvalidRequestError) as info:
            sampling_params(chat(cache_salt=salt), 2, 100, 1024)
        assert info.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError) as info:
        completion(cache_salt=["a"])
    assert info.value.param == "cache_salt"


def test_api_key_salts_keep_keys_apart_and_a_request_salt_divides_its_key() -> None:
    salts = {api_key_cache_salt(key, salt) for key in ("key-1", "key-2") for salt in (None, "a", "b")}
    assert len(salts) == 6
    assert api_key_cache_salt("key-1", "a") == api_key_cache_salt("key-1", "a")
    assert all(len(s) <= MAX_CACHE_SALT_CHARS for s in salts)


def test_logprobs_fields_reach_sampling_params() -> None:
    assert sampling_params(completion(logprobs=3), 2, 100, 1024).logprobs == 3
    assert sampling_params(completion(logprobs=0), 2, 100, 1024).logprobs == 0
    assert sampling_params(completion(), 2, 100, 1024).logprobs is None
    assert sampling_params(chat(logprobs=True, top_logprobs=4), 2, 100, 1024).logprobs == 4
    assert sampling_params(chat(logprobs=True), 2, 100, 1024).logprobs == 0
    assert sampling_params(chat(logprobs=False), 2, 100, 1024).logprobs is None
    for req, param in [
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (completion(logprobs=21), "logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            sampling_params(req, 2, 100, 1024)
        assert info.value.param == param


def test_n_fans_out_forks_with_consecutive_seeds() -> None:
    from tailserve.server.protocol import choices_per_prompt, fan_out

    req = completion(n=3, seed=5)
    params = sampling_params(req, 2, 100, 1024)
    inputs = fan_out([[1, 2], [3]], [params, params], choices_per_prompt(req), "cmpl-x", False, False)
    assert [i.params.seed for i in inputs] == [5, 6, 7, 5, 6, 7]
    assert [i.fork_of for i in inputs] == [None, "cmpl-x-0", "cmpl-x-0", None, "cmpl-x-3", "cmpl-x-3"]
    assert [i.shares_prompt for i in inputs] == [False, True, True, False, True, True]
    for n in (0, 17):
        with pytest.raises(InvalidRequestError) as info:
            choices_per_prompt(chat(n=n))
        assert info.value.param == "n"


def test_chat_max_tokens_default_and_alias() -> None:
    assert sampling_params(chat(), 30, 100, 1024).max_tokens == 70  # the rest of the context
    assert sampling_params(chat(max_completion_tokens=5, max_tokens=9), 30, 100, 1024).max_tokens == 5
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(chat(max_completion_tokens=0), 30, 100, 1024)
    assert info.value.param == "max_completion_tokens"
    assert "max_completion_tokens" in info.value.message
    with pytest.raises(ContextLengthExceededError):
        sampling_params(chat(), 100, 100, 1024)
    with pytest.raises(ContextLengthExceededError) as too_long:  # the context's rule, in the client's name
        sampling_params(chat(max_completion_tokens=80), 30, 100, 1024)
    assert too_long.value.param == "max_completion_tokens"
    assert "lower max_completion_tokens to at most 70" in too_long.value.message


def test_value_ranges_come_from_sampling_params() -> None:
    for fields, param in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            sampling_params(completion(**fields), 2, 100, 1024)
        assert info.value.param == param


def test_prompts_as_text_or_token_ids() -> None:
    assert completion_prompt_ids(completion(prompt="hi"), TOK) == [[104, 105]]
    assert completion_prompt_ids(completion(prompt=[5, 6, 7]), TOK) == [[5, 6, 7]]
    assert completion_prompt_ids(completion(prompt=["hi"]), TOK) == [[104, 105]]
    assert completion_prompt_ids(completion(prompt=[[1, 2]]), TOK) == [[1, 2]]
    assert completion_prompt_ids(completion(prompt=["a", "b"]), TOK) == [[97], [98]]
    assert completion_prompt_ids(completion(prompt=[[1], [2, 3]]), TOK) == [[1], [2, 3]]
    for prompt, param in [("", "prompt"), ([], "prompt"), (["a", ""], "prompt[1]"), (["a"] * 65, "prompt")]:
        with pytest.raises(InvalidRequestError) as info:
            completion_prompt_ids(completion(prompt=prompt), TOK)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError):
        completion_prompt_ids(completion(prompt=[-1]), TOK)


def test_chat_text_parts_are_joined() -> None:
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert TOK.decode(chat_prompt_ids(req, TOK)) == "<user>ab\n<assistant>"


def test_error_body_shape() -> None:
    body = to_http(InvalidRequestError("bad", "max_tokens")).body
    assert json.loads(json.dumps(body)) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    }


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 1000 + b"]" * 1000,  # RecursionError in pydantic before
        b'{"a": ' * 40 + b"1" + b"}" * 40,  # past MAX_JSON_DEPTH, still parseable
        b'{"model": "m", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",  # int digit limit
        b'{"model": "m", "prompt": "\\ud800"}',  # lone surrogate: no tokenizer takes it
        b'{"model": "m", "messages": [{"role": "user", "content": "x\\udfff"}]}',
        b'{"\\ud800": 1}',
    ],
)
def test_bodies_that_crashed_later_layers_are_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidJSONError):
        parse_json(body)


def test_a_body_at_the_depth_limit_still_parses() -> None:
    assert parse_json(b'{"a": ' * 31 + b"1" + b"}" * 31)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_400(seed: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(completion(seed=seed), 2, 100, 1024)
    assert info.value.param == "seed"


def test_seed_at_the_64_bit_borders_is_accepted() -> None:
    assert sampling_params(completion(seed=2**64 - 1), 2, 100, 1024).seed == 2**64 - 1
    assert sampling_params(completion(seed=-(2**63)), 2, 100, 1024).seed == -(2**63)


@pytest.mark.parametrize("content", [None, []])
def test_user_message_without_content_is_400(content: Any) -> None:
    req = chat(messages=[{"role": "user", "content": content}])
    with pytest.raises(InvalidRequestError) as info:
        chat_prompt_ids(req, TOK)
    assert info.value.param == "messages[0].content"
    # An assistant turn may carry no content (it held tool calls in the client's history).
    ok = chat(messages=[{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}])
    assert chat_prompt_ids(ok, TOK)


def test_missing_max_tokens_is_capped_by_the_server_default() -> None:
    assert sampling_params(chat(), 30, 8192, 1024).max_tokens == 1024
    assert sampling_params(chat(), 30, 100, 1024).max_tokens == 70  # the context left is smaller
    assert sampling_params(completion(), 2, 100, 8).max_tokens == 8  # below OpenAI's 16
    assert sampling_params(chat(max_tokens=2000), 30, 8192, 1024).max_tokens == 2000  # explicit wins


def test_model_generation_defaults_fill_only_what_the_request_leaves_out() -> None:
    model = GenerationDefaults(temperature=0.2, top_p=0.9, top_k=40)
    p = sampling_params(chat(), 2, 100, 1024, model)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 40)
    p = sampling_params(chat(temperature=1.0, top_p=1.0, top_k=0), 2, 100, 1024, model)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    p = sampling_params(chat(), 2, 100, 1024)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)  # OpenAI's


def test_generation_defaults_from_hf_config_and_gguf(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    assert read_generation_defaults(tmp_path) == GenerationDefaults(temperature=0.6, top_p=0.95)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 20}))
    assert read_generation_defaults(tmp_path) == GenerationDefaults(temperature=0.0, top_k=20)
    assert read_generation_defaults(tmp_path / "missing") == GenerationDefaults()
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 30)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_generation_defaults(path) == GenerationDefaults(temperature=0.25, top_k=30)


def test_server_modules_and_engine_stats_load_without_torch() -> None:
    """The server types the engine with engine/stats.py and config.py; neither may pull in torch."""
    code = (
        "import sys, tailserve.server.app, tailserve.server.lifecycle, tailserve.engine.stats; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
