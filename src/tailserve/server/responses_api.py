"""The Responses API (POST /v1/responses) for text, over the chat path: `instructions` and `input`
become chat messages, Responses tools become chat tools, and the engine's outputs become a Response
object or the API's semantic stream events (response.created ... response.completed).

Stateless: nothing is kept after a response, so `store: true` and `previous_response_id` get a
400 naming them. Pure translation; the chat path (serving.py) does all the serving.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from tailserve.engine.request import RequestOutput
from tailserve.errors import InvalidRequestError
from tailserve.http.errors import UnsupportedParameterError
from tailserve.http.json_body import parse_json
from tailserve.http.sse import sse_json
from tailserve.server.protocol import _Body, validate_body
from tailserve.server.request_ids import request_id_of
from tailserve.server.responses import Job, timings, usage
from tailserve.server.serving import Serving
from tailserve.server.tools import ToolCallStream


class InputPart(_Body):
    """A part of an input message: text (`output_text`: an earlier assistant turn sent back) is
    served; any other kind is read only to be refused by name (_part_text)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class InputMessage(_Body):
    """A message item; `type` may be left out (the SDK's easy input form)."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    """An earlier function call of the model, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """A function's result, answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(_Body):
    """A tool in the Responses shape (flat, not chat's nested `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Body):
    """`text.format`: plain text, a JSON object, or JSON following a schema (chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # vLLM's extensions of the Responses request, served as on the chat path (benchmark clients send
    # ignore_eos, e.g. aiperf's --extra-inputs).
    ignore_eos: bool | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    cache_salt: str | None = None
    priority: int | str | None = None


async def handle(serving: Serving, request: Request) -> Response:
    """POST /v1/responses: validated, served as a chat request, answered in the Responses shape; a
    400 names the parameter as the client sent it."""
    req = validate_body(ResponsesRequest, parse_json(await request.body()))
    try:
        body = json.dumps(chat_body(req)).encode()
        render = ResponseRender(req, request_id_of(request))
        return await serving.handle("chat", request, render, body)
    except InvalidRequestError as exc:
        raise renamed(exc) from None


_EXTENSIONS = (
    "ignore_eos",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "cache_salt",
    "priority",
)
# Chat parameter names, as the chat path reports them, -> the Responses names a client sent.
_PARAM_NAMES = (
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
    ("response_format", "text.format"),
)


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request that serves `req`; a 400 for what a stateless server cannot do."""
    if req.store:
        raise UnsupportedParameterError(
            "Parameter 'store' must be false: this server keeps no responses (send the whole "
            "conversation as 'input' instead)",
            "store",
        )
    if req.previous_response_id is not None:
        raise UnsupportedParameterError(
            "Parameter 'previous_response_id' is not supported: this server keeps no responses "
            "(send the whole conversation as 'input' instead)",
            "previous_response_id",
        )
    if req.include:
        raise UnsupportedParameterError("Parameter 'include' is not supported by this server", "include")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "response_format": _response_format(req.text),
    }
    optional |= {name: getattr(req, name) for name in _EXTENSIONS}
    body |= {k: v for k, v in optional.items() if v is not None}
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    return body


def renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat-path error with the parameter named as the Responses request has it."""
    message, param = exc.message, exc.param
    for chat, responses in _PARAM_NAMES:
        message = message.replace(f"'{chat}", f"'{responses}")
        if param is not None and (param == chat or param.startswith((f"{chat}.", f"{chat}["))):
            param = responses + param[len(chat) :]
    out = type(exc)(message, param)
    return out


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if isinstance(item, InputMessage):
            parts = item.content
            text = (
                parts if isinstance(parts, str) else "".join(_part_text(p, i, j) for j, p in enumerate(parts))
            )
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _part_text(part: InputPart, item: int, index: int) -> str:
    if part.type not in ("input_text", "output_text") or part.text is None:
        raise UnsupportedParameterError(
            f"Only text parts ({{'type': 'input_text', 'text': ...}}) are supported, got type '{part.type}'",
            f"input[{item}].content[{index}]",
        )
    return part.text


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError(
            "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise InvalidRequestError("'text.format' of type json_schema needs a 'schema'", "text.format.schema")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}
    return {"type": "json_schema", "json_schema": schema}


# ----- output ---------------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(out: RequestOutput) -> dict[str, Any]:
    u = usage(out)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseRender:
    """Engine outputs of one /v1/responses request -> its Response object, or its stream events."""

    def __init__(self, req: ResponsesRequest, request_id: str | None = None) -> None:
        self.req = req
        self.response_id = f"resp_{request_id}" if request_id else _new_id("resp")
        self._stream: ResponseEvents | None = None

    def response(
        self, job: Job, status: str, output: list[dict[str, Any]], out: RequestOutput | None
    ) -> dict[str, Any]:
        """The Response object (`out`, the finished output, brings usage and the finish reason)."""
        req = self.req
        incomplete = None
        if out is not None and out.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": job.created,
            "model": job.model,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "user": req.user,
            "usage": _usage(out) if out is not None else None,
        }
        if out is not None:
            body["tailserve_timings"] = timings(job, out)
        return body

    def body(self, job: Job, finals: Sequence[RequestOutput]) -> dict[str, Any]:
        """The non-streamed body: a message item for the text, a function_call item per call."""
        (out,) = finals
        events = ResponseEvents(self, job)
        events.feed_all(out.text)
        return self.response(job, "completed", events.finish_items(), out)

    async def events(
        self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[bytes]:
        """The semantic stream: created, in_progress, items and deltas as text comes, completed."""
        stream = self._stream = ResponseEvents(self, job)
        for event in stream.start():
            yield event
        async for _, out in outputs:
            for event in stream.feed(out.new_text):
                yield event
            if out.finished:
                for event in stream.finish(out):
                    yield event

    def error_event(self, body: dict[str, Any]) -> bytes:
        """A failure after the stream began (OpenAI error body): the API's `error` event."""
        error = body.get("error", {})
        sequence_number = self._stream.sequence_number if self._stream is not None else 0
        data = {
            "type": "error",
            "code": error.get("code"),
            "message": error.get("message", "internal error"),
            "param": error.get("param"),
            "sequence_number": sequence_number,
        }
        return _sse(data)


def _sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {sse_json(data)}\n\n".encode()


class ResponseEvents:
    """The output items of one response as text arrives: text goes to a message item, each tool call
    to a function_call item (from ToolCallStream's chat deltas when the request has tools); `feed`
    returns the SSE events for what is new, `finish_items` the items for a non-streamed body."""

    def __init__(self, render: ResponseRender, job: Job) -> None:
        self.render = render
        self.job = job
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its open item
        self._tools = ToolCallStream(job.max_tool_calls) if job.tool_calls else None

    def _event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return _sse(data)

    def start(self) -> list[bytes]:
        snapshot = self.render.response(self.job, "in_progress", [], None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, text: str) -> list[bytes]:
        if self._tools is None:
            return self._text(text) if text else []
        return [e for delta in self._tools.feed(text) for e in self._delta(delta)]

    def feed_all(self, text: str) -> None:
        """The whole text at once (non-streamed): the same items, events discarded."""
        self.feed(text)
        if self._tools is not None:
            for delta in self._tools.finish():
                self._delta(delta)

    def finish(self, out: RequestOutput) -> list[bytes]:
        events = [e for delta in (self._tools.finish() if self._tools else []) for e in self._delta(delta)]
        events += self._close_all()
        done = self.render.response(self.job, "completed", self.items, out)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=done)]

    def finish_items(self) -> list[dict[str, Any]]:
        self._close_all()
        return self.items

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        """One chat delta from ToolCallStream: `content`, a call's header, or its argument text."""
        if delta.get("content"):
            return self._text(delta["content"])
        events: list[bytes] = []
        for call in delta.get("tool_calls", []):
            index = call["index"]
            if "id" in call:  # a new call: the text before it is a finished message
                events += self._close_message()
                item = _call_item(_new_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
                self._calls[index] = item
                self.items.append(item)
                events.append(
                    self._event(
                        "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
                    )
                )
            fragment = call.get("function", {}).get("arguments", "")
            if fragment:
                item = self._calls[index]
                item["arguments"] += fragment
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=fragment,
                    )
                )
        return events

    def _text(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._message is None:
            self._message = _message_item(_new_id("msg"), "", "in_progress")
            self.items.append(self._message)
            index = len(self.items) - 1
            added = {**self._message, "content": []}
            events.append(self._event("response.output_item.added", output_index=index, item=added))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._message["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        part = self._message["content"][0]
        part["text"] += text
        index = self.items.index(self._message)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_message(self) -> list[bytes]:
        message, self._message = self._message, None
        if message is None:
            return []
        message["status"] = "completed"
        index = self.items.index(message)
        part = message["content"][0]
        item_id = message["id"]
        return [
            self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
            self._event("response.output_item.done", output_index=index, item=dict(message)),
        ]

    def _close_all(self) -> list[bytes]:
        events = self._close_message()
        for item in self._calls.values():
            item["status"] = "completed"
            index = self.items.index(item)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        self._calls = {}
        return events
