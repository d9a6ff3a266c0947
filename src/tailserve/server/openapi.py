"""The response bodies as pydantic models, and /openapi.json built from them and the request models.

The routes keep parsing raw bodies (protocol.py's strict validation and OpenAI error messages); the
models here only describe what they send, and the tests hold every builder in responses.py to them.
Nothing here runs on a request's path.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from tailserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tailserve.server.responses_api import ResponsesRequest
from tailserve.server.tokenize import DetokenizeRequest, TokenizeRequest


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----- errors --------------------------------------------------------------------------------------
class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    """Every 4xx and 5xx body: OpenAI's error shape, which its clients parse."""

    error: ErrorDetail


# ----- completions and chat ------------------------------------------------------------------------
class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Timings(_Out):
    """`tailserve_timings` (extension, docs/INTERFACES.md): where this request's time went."""

    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float
    preemptions: int
    cached_tokens: int
    prompt_tokens: int
    output_tokens: int
    admission_estimate_s: float
    admission_tpot_estimate_s: float = 0.0
    slo_class: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    tailserve_timings: Timings | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprobEntry] | None = None
    refusal: None = None


class FunctionCall(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    tailserve_timings: Timings | None = None


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    tailserve_timings: Timings | None = None


class CompletionChunk(CompletionResponse):
    """One `data:` event of a streamed completion (the body's shape, a choice's new text)."""


# ----- the Responses API ---------------------------------------------------------------------------
class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class OutputMessage(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Out):
    """POST /v1/responses: the Response object (stored nowhere: `store` is always false)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: Literal[False]
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    user: str | None = None
    usage: ResponseUsage | None = None
    tailserve_timings: Timings | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (`event: <type>` and this as `data`): response.created,
    response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta / .done, response.function_call_arguments.delta / .done,
    response.content_part.done, response.output_item.done, then response.completed (or
    response.incomplete at max_output_tokens); `error` if the engine fails mid-stream."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


# ----- models, tokenizer, probes -------------------------------------------------------------------
class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    max_tokens_default: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Out):
    prompt: str


class Status(_Out):
    status: str


class Version(_Out):
    version: str


# ----- the schema ----------------------------------------------------------------------------------
SSE = "text/event-stream"
# The request body model of each POST route (the handlers read raw bodies; this is what they accept).
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/responses": ResponsesRequest,
}
# The stream events of routes that stream (`stream: true`), documented beside the JSON body.
STREAM_EVENTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionChunk,
    "/v1/chat/completions": ChatCompletionChunk,
    "/v1/responses": ResponseStreamEvent,
}
_ERRORS = {
    "400": "invalid request: the message names the parameter (`param`)",
    "401": "missing or wrong API key",
    "404": "unknown model or route",
    "413": "body over --max-body-bytes",
    "415": "a body that is not application/json",
    "429": "admission refused: the queue is full or the TTFT target cannot be met (Retry-After)",
    "500": "server fault",
    "503": "not ready yet, or draining",
}


def error_responses(*codes: str) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a route: these error statuses (all when none named), each with
    OpenAI's error body. 401 only applies under /v1/ (where --api-key is checked)."""
    return {
        int(code): {"model": ErrorResponse, "description": why}
        for code, why in _ERRORS.items()
        if not codes or code in codes
    }


def _sse_event_schema(data_ref: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.2's reading of a text/event-stream schema): its `data` is
    JSON of the route's event model, an OpenAI error body (a failure after the stream began, or the
    drain deadline), or chat's closing `[DONE]`."""

    def json_of(ref: dict[str, Any]) -> dict[str, Any]:
        return {"type": "string", "contentMediaType": "application/json", "contentSchema": ref}

    error = {"$ref": "#/components/schemas/ErrorResponse"}
    data = {"anyOf": [{"const": "[DONE]"}, json_of(data_ref), json_of(error)]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": data, "id": {"type": "string"}},
    }


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes and their response models, plus each POST route's request body
    (from protocol.py's models) and its `text/event-stream` events; cached on the app."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (m, "validation") for m in REQUEST_BODIES.values()
    ]
    models += [(m, "serialization") for m in STREAM_EVENTS.values()]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    paths = schema["paths"]
    # FastAPI documents a 422 for path parameters; this server never sends one (a 404 instead).
    for route in paths.values():
        for operation in route.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, model in REQUEST_BODIES.items():
        if path not in paths:
            continue
        paths[path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(model, "validation")]}},
        }
    for path, event in STREAM_EVENTS.items():
        if path not in paths:
            continue
        ok = paths[path]["post"]["responses"]["200"]
        ok["description"] = f"the body; with `stream: true`, events whose data is a {event.__name__}"
        ok["content"][SSE] = {"schema": _sse_event_schema(refs[(event, "serialization")])}
    app.openapi_schema = schema
    return schema
