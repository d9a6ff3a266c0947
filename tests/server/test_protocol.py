"""Request parsing and validation: every bad body names its field; supported fields reach SamplingParams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tailserve.errors import ContextLengthExceededError, InvalidRequestError
from tailserve.server.errors import InvalidJSONError, UnsupportedParameterError, to_http
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_prompt_ids,
    completion_prompt_ids,
    parse_json,
    sampling_params,
    validate_body,
)
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
        ({"n": 2}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_completion_parameters_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedParameterError) as info:
        sampling_params(completion(**fields), 2, 100)
    assert info.value.param == param
    assert to_http(info.value).status == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 3}, "n"),
    ],
)
def test_unsupported_chat_parameters_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedParameterError) as info:
        sampling_params(chat(**fields), 2, 100)
    assert info.value.param == param


def test_default_values_of_unsupported_parameters_are_accepted() -> None:
    fields = {
        "n": 1,
        "logprobs": False,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    sampling_params(chat(**fields, presence_penalty=0, frequency_penalty=0.0, logit_bias={}), 2, 100)
    sampling_params(completion(n=1, echo=False, best_of=1, logprobs=None), 2, 100)


def test_sampling_fields_reach_sampling_params() -> None:
    req = completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop=["x", "yz"], ignore_eos=True
    )
    p = sampling_params(req, 2, 100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.0, 0.5, 3, 11)
    assert p.stop == ("x", "yz") and p.ignore_eos
    assert sampling_params(completion(stop="."), 2, 100).stop == (".",)
    assert sampling_params(completion(), 2, 100).max_tokens == 16  # the OpenAI completions default


def test_chat_max_tokens_default_and_alias() -> None:
    assert sampling_params(chat(), 30, 100).max_tokens == 70  # the rest of the context
    assert sampling_params(chat(max_completion_tokens=5, max_tokens=9), 30, 100).max_tokens == 5
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(chat(max_completion_tokens=0), 30, 100)
    assert info.value.param == "max_completion_tokens"
    assert "max_completion_tokens" in info.value.message
    with pytest.raises(ContextLengthExceededError):
        sampling_params(chat(), 100, 100)


def test_value_ranges_come_from_sampling_params() -> None:
    for fields, param in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            sampling_params(completion(**fields), 2, 100)
        assert info.value.param == param


def test_prompts_as_text_or_token_ids() -> None:
    assert completion_prompt_ids(completion(prompt="hi"), TOK) == [104, 105]
    assert completion_prompt_ids(completion(prompt=[5, 6, 7]), TOK) == [5, 6, 7]
    assert completion_prompt_ids(completion(prompt=["hi"]), TOK) == [104, 105]
    assert completion_prompt_ids(completion(prompt=[[1, 2]]), TOK) == [1, 2]
    for prompt, param_cls in [
        (["a", "b"], UnsupportedParameterError),
        ("", InvalidRequestError),
        ([], InvalidRequestError),
    ]:
        with pytest.raises(param_cls) as info:
            completion_prompt_ids(completion(prompt=prompt), TOK)
        assert info.value.param == "prompt"
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
