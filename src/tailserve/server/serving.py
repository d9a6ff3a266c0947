"""One HTTP generation request end to end: parse, validate, admit, run in the engine, respond.

Every path out of here (finished, error, client gone, shutdown) aborts the engine request if it is
still running and releases its admission ticket exactly once; it never sends a partial 200 body
for a non-streamed request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailserve.engine.request import RequestOutput, TokenLogprob
from tailserve.server.admission import Admission, Ticket
from tailserve.server.engine_api import Engine
from tailserve.server.errors import ModelNotFoundError, to_http
from tailserve.server.generation_defaults import GenerationDefaults
from tailserve.server.json_body import parse_json
from tailserve.server.metrics import ServerMetrics
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EngineInput,
    chat_prompt_ids,
    completion_prompt_ids,
    sampling_params,
    validate_body,
)
from tailserve.server.responses import (
    Job,
    Kind,
    final_chunks,
    full_response,
    logprobs_json,
    role_chunk,
    text_chunk,
)
from tailserve.server.sse import SSE_DONE, SSEResponse, sse_event, until_disconnect

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; never reaches a client


class Serving:
    """Turns /v1/completions and /v1/chat/completions requests into engine generations."""

    def __init__(
        self,
        engine: Engine,
        admission: Admission,
        metrics: ServerMetrics,
        max_tokens_default: int,
        defaults: GenerationDefaults,
    ) -> None:
        self._engine = engine
        self._admission = admission
        self._metrics = metrics
        self._max_tokens_default = max_tokens_default
        self._defaults = defaults

    async def handle(self, kind: Kind, request: Request) -> Response:
        """The whole request; typed errors propagate to the app's single error mapping."""
        self._admission.check_available()
        job, inp = self.prepare(kind, await request.body())
        return await self.respond(job, inp, request.receive)

    def prepare(self, kind: Kind, body: bytes) -> tuple[Job, EngineInput]:
        """Body -> validated engine input; raises before anything is queued."""
        data = parse_json(body)
        tokenizer = self._engine.tokenizer
        req: CompletionRequest | ChatCompletionRequest
        if kind == "completion":
            req = validate_body(CompletionRequest, data)
            self._check_model(req.model)
            ids = completion_prompt_ids(req, tokenizer)
        else:
            req = validate_body(ChatCompletionRequest, data)
            self._check_model(req.model)
            ids = chat_prompt_ids(req, tokenizer)
        # Engine limits (context, vocabulary, KV pool) are checked once, by the engine's add_request.
        params = sampling_params(
            req, len(ids), self._engine.max_model_len, self._max_tokens_default, self._defaults
        )
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        job = Job(
            f"{prefix}-{uuid.uuid4().hex}",
            kind,
            self._engine.model_name,
            int(time.time()),
            include_usage,
            continuous_usage=include_usage and options is not None and options.continuous_usage_stats,
            token_text=(lambda t: tokenizer.decode([t])) if params.logprobs is not None else None,
        )
        return job, EngineInput(ids, params, req.stream, include_usage)

    def _check_model(self, model: str) -> None:
        if model != self._engine.model_name:
            raise ModelNotFoundError(model, self._engine.model_name)

    async def respond(self, job: Job, inp: EngineInput, receive: Receive) -> Response:
        """Admit, wait for the first output (errors still become a proper status), then answer."""
        ticket = self._admission.admit(len(inp.prompt_token_ids))
        run = _Run(job.request_id, self._engine, self._metrics, ticket)
        run.gen = self._engine.generate(job.request_id, inp.prompt_token_ids, inp.params)
        final: RequestOutput | None = None
        handed_over = False
        closing = self._admission.drain.closing
        try:
            first = await until_disconnect(anext(run.gen), receive, closing)
            if first is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            ticket.started()
            if inp.stream:
                handed_over = True  # from here the event stream owns the run and closes it
                return SSEResponse(self._events(job, first, run), on_close=run.close, closing=closing)
            final = await until_disconnect(_last_output(first, run.gen), receive, closing)
            if final is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(full_response(job, final))
        finally:
            if not handed_over:
                await run.close(final)

    async def _events(self, job: Job, first: RequestOutput, run: _Run) -> AsyncGenerator[bytes, None]:
        """SSE events from the first output to [DONE]; an engine error mid-stream becomes an error event."""
        out: RequestOutput | None = first
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
        offset = 0  # legacy completions' text_offset of the next token
        try:
            if job.kind == "chat":
                yield sse_event(role_chunk(job))
            while out is not None and not out.finished:
                pending += out.new_logprobs
                if out.new_text:
                    lps = logprobs_json(job, pending, offset)
                    offset += sum(len(t) for t in (lps or {}).get("tokens", []))
                    pending = []
                    yield sse_event(text_chunk(job, out.new_text, None, out, lps))
                out = await anext(run.gen)
            if out is not None:
                for chunk in final_chunks(job, out, logprobs_json(job, pending + out.new_logprobs, offset)):
                    yield sse_event(chunk)
            yield SSE_DONE
        except Exception as exc:
            out = None
            http = to_http(exc)
            self._metrics.errors.labels(status=str(http.status)).inc()
            yield sse_event(http.body)
            yield SSE_DONE
        finally:
            await run.close(out)


class _Run:
    """One engine generation and its admission ticket; close() settles both exactly once."""

    def __init__(self, request_id: str, engine: Engine, metrics: ServerMetrics, ticket: Ticket) -> None:
        self.request_id = request_id
        self.gen: AsyncIterator[RequestOutput] = _nothing()
        self._engine = engine
        self._metrics = metrics
        self._ticket = ticket
        self._closed = False

    async def close(self, out: RequestOutput | None = None) -> None:
        """Metrics for a finished request; abort anything else; release the ticket."""
        if self._closed:
            return
        self._closed = True
        try:
            if out is not None and out.finished:
                self._metrics.observe_finished(out)
            else:
                self._engine.abort(self.request_id)
                self._metrics.observe_aborted()
            aclose = getattr(self.gen, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._ticket.done()


async def _nothing() -> AsyncGenerator[RequestOutput, None]:
    return
    yield


async def _last_output(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Iterate to the finished output (a non-streamed response needs only the last one)."""
    out = first
    while not out.finished:
        out = await anext(gen)
    return out
