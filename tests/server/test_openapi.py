"""/openapi.json: generated from the request and response models, with OpenAI's error body on every
error status; and every response builder in server/responses.py holds to those models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from tailserve.engine.request import RequestOutput, TokenLogprob
from tailserve.server.config import ServerConfig
from tailserve.server.openapi import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
)
from tailserve.server.responses import (
    Job,
    add_echo,
    choice_chunks,
    full_response,
    role_chunk,
    stream_end,
    text_chunk,
)
from tailserve.server.tools import ToolCallStream
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _out(
    text: str, finished: bool = True, logprobs: bool = False, new_text: str | None = None
) -> RequestOutput:
    ids = list(range(1, len(text) + 1))
    lps = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)]) for t in ids] if logprobs else []
    return RequestOutput(
        request_id="r",
        new_token_ids=ids,
        new_text=text if new_text is None else new_text,
        token_ids=ids,
        text=text,
        finished=finished,
        finish_reason="stop" if finished else None,
        num_prompt_tokens=5,
        num_cached_tokens=2,
        new_logprobs=lps,
        logprobs=lps,
        prompt_logprobs=lps[:3],
    )


def _job(kind: str, **fields: Any) -> Job:
    return Job("id-1", kind, "m", 1_700_000_000, **fields)  # type: ignore[arg-type]


def _valid(model: type[BaseModel], body: dict[str, Any]) -> None:
    model.model_validate(body)


@pytest.mark.parametrize("logprobs", [False, True])
def test_completion_bodies_and_chunks_match_their_models(logprobs: bool) -> None:
    job = _job("completion", include_usage=True, token_text=(lambda t: f"<{t}>") if logprobs else None)
    out = _out("Hello", logprobs=logprobs)
    body = full_response(job, [out, _out("Bye", logprobs=logprobs)], [True, False])
    add_echo(job, body["choices"][0], "Say: ", [7, 8, 9, 10], out)
    _valid(CompletionResponse, body)
    lps = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}], "text_offset": [0]}
    for chunk in [
        text_chunk(job, "He", None, out, lps if logprobs else None),
        *choice_chunks(job, out),
        *stream_end(job, choice_chunks(job, out), [out]),
    ]:
        _valid(CompletionChunk, chunk)


@pytest.mark.parametrize("text", ["Plain answer.", f"Let me check.{CALL}"])
def test_chat_bodies_and_chunks_match_their_models(text: str) -> None:
    job = _job(
        "chat", include_usage=True, continuous_usage=True, tool_calls=True, token_text=lambda t: f"<{t}>"
    )
    out = _out(text, logprobs=True)
    _valid(ChatCompletionResponse, full_response(job, out))
    chunks = [role_chunk(job)]
    tools = ToolCallStream()
    for i in range(0, len(text), 7):  # the text as it streams, in pieces that split the tags
        piece = _out(text[: i + 7], finished=i + 7 >= len(text), new_text=text[i : i + 7])
        chunks += choice_chunks(job, piece, None, 0, tools)
    chunks = stream_end(job, chunks, [out])
    for chunk in chunks:
        _valid(ChatCompletionChunk, chunk)
    assert chunks[-1]["usage"]["completion_tokens"] == len(text)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    with threaded_server(FakeEngine(), ServerConfig()) as base:
        yield base


def test_openapi_json_describes_requests_responses_and_errors(fake_server: str) -> None:
    schema = httpx.get(f"{fake_server}/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    ok = chat["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}
    assert "text/event-stream" in ok
    for code in ("400", "401", "404", "413", "429", "503"):
        error = chat["responses"][code]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}, code
    responses = paths["/v1/responses"]["post"]
    assert responses["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"
    }
    assert responses["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponseObject"
    }
    request = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(request["required"]) and request["additionalProperties"] is False
    assert "temperature" in request["properties"]
    for operation in (op for route in paths.values() for op in route.values()):
        assert "422" not in operation["responses"]  # FastAPI's validation error is never sent here
    assert httpx.get(f"{fake_server}/docs").status_code == 404  # its page would load a CDN's scripts


def test_an_error_body_is_the_documented_shape(fake_server: str) -> None:
    r = httpx.post(f"{fake_server}/v1/completions", json={"model": "fake-model", "prompt": "x", "n": 99})
    assert r.status_code == 400
    ErrorResponse.model_validate(r.json())


def test_disable_fastapi_docs_serves_no_schema() -> None:
    with threaded_server(FakeEngine(), ServerConfig(openapi=False)) as base:
        assert httpx.get(f"{base}/openapi.json").status_code == 404
