"""POST /v1/responses through the official openai SDK (`client.responses.create`, streamed and not,
and its `responses.stream` helper): text, instructions, max_output_tokens, tools in the Responses
shape, and a clear 400 for what a stateless server cannot do."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tailserve.server.openapi import ResponseObject
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server

REPLY = "Hello there, friend. "
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def texts() -> Iterator[str]:
    with threaded_server(FakeEngine(reply=REPLY)) as base:
        yield base


@pytest.fixture(scope="module")
def calls() -> Iterator[str]:
    with threaded_server(FakeEngine(reply=CALL, max_model_len=4096)) as base:
        yield base


def test_a_text_response(texts: str) -> None:
    r = _client(texts).responses.create(
        model="fake-model", input="Hi", instructions="Be brief.", max_output_tokens=100
    )
    assert (r.object, r.status, r.output_text) == ("response", "completed", REPLY)
    assert r.instructions == "Be brief." and r.store is False
    assert r.usage is not None and r.usage.output_tokens == len(REPLY)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    raw = httpx.post(
        f"{texts}/v1/responses", json={"model": "fake-model", "input": "Hi", "max_output_tokens": 5}
    )
    ResponseObject.model_validate(raw.json())  # the body is what /openapi.json documents


def test_vllms_extensions_are_served(texts: str) -> None:
    """ignore_eos (what benchmark clients send) and stop: as on the chat path."""
    client = _client(texts)
    long = client.responses.create(
        model="fake-model", input="Hi", max_output_tokens=30, extra_body={"ignore_eos": True}
    )
    assert long.usage is not None and long.usage.output_tokens == 30
    stopped = client.responses.create(model="fake-model", input="Hi", extra_body={"stop": ["friend"]})
    assert stopped.output_text == "Hello there, "


def test_max_output_tokens_makes_it_incomplete(texts: str) -> None:
    r = _client(texts).responses.create(model="fake-model", input="Hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output_text == REPLY[:5]


def test_a_list_of_messages_is_a_conversation(texts: str) -> None:
    conversation: list = [
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    r = _client(texts).responses.create(model="fake-model", input=conversation, max_output_tokens=8)
    assert r.output_text == REPLY[:8]


def test_a_stream_has_the_semantic_events_in_order(texts: str) -> None:
    events = list(
        _client(texts).responses.create(model="fake-model", input="Hi", stream=True, max_output_tokens=100)
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == REPLY and events[-1].response.output_text == REPLY  # type: ignore[union-attr]
    assert events[-1].response.usage is not None  # type: ignore[union-attr]


def test_the_sdk_stream_helper_accumulates_the_same_response(texts: str) -> None:
    with _client(texts).responses.stream(model="fake-model", input="Hi", max_output_tokens=100) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == REPLY


@pytest.mark.parametrize("stream", [False, True])
def test_tools_in_the_responses_shape_become_function_calls(calls: str, stream: bool) -> None:
    client = _client(calls)
    if stream:
        with client.responses.stream(model="fake-model", input="Weather in Paris?", tools=TOOLS) as s:  # type: ignore[arg-type]
            types = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in types
        assert types[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    else:
        r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=TOOLS)  # type: ignore[arg-type]
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Paris"}' and call.call_id.startswith("call_")
    # The call and its result sent back as input: the next turn is served.
    history: list = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]
    again = client.responses.create(model="fake-model", input=history, tools=TOOLS)  # type: ignore[arg-type]
    assert again.status == "completed"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(texts: str, fields: dict, param: str) -> None:
    body = {"model": "fake-model", "input": "Hi", **fields}
    r = httpx.post(f"{texts}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_an_unknown_model_is_a_404(texts: str) -> None:
    with pytest.raises(openai.NotFoundError):
        _client(texts).responses.create(model="no-such-model", input="Hi")


def test_the_real_model_answers_the_same_as_chat(smol_fp32: str) -> None:
    """On the default model, greedy: the Responses text equals the chat completion's, streamed or not."""
    client = _client(smol_fp32)
    (model,) = [m.id for m in client.models.list()]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        max_tokens=16,
        temperature=0,
    )
    args = {"model": model, "instructions": "Be brief.", "input": "What is 2+2?", "max_output_tokens": 16}
    plain = client.responses.create(**args, temperature=0)
    streamed = list(client.responses.create(**args, temperature=0, stream=True))
    deltas = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert plain.output_text == deltas == chat.choices[0].message.content
    assert plain.usage is not None and chat.usage is not None
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
