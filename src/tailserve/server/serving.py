"""One HTTP generation request end to end: parse, validate, admit, run in the engine, respond.

Every path out of here (finished, error, client gone, shutdown) aborts the engine request if it is
still running and releases its admission ticket exactly once; it never sends a partial 200 body
for a non-streamed request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailserve.engine.request import RequestOutput, SamplingParams, SloTarget, TokenLogprob
from tailserve.http.errors import ModelNotFoundError, to_http
from tailserve.http.json_body import parse_json
from tailserve.http.middleware import CLIENT_CLOSED_REQUEST, bearer_token
from tailserve.http.sse import SSE_DONE, SSEResponse, sse_event, until_disconnect
from tailserve.server.admission import Admission, Ticket
from tailserve.server.engine_api import Engine
from tailserve.server.generation_defaults import GenerationDefaults
from tailserve.server.metrics import ServerMetrics
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EngineInput,
    candidates_per_prompt,
    chat_prompt_ids,
    choices_per_prompt,
    completion_prompt_ids,
    echo_texts,
    fan_out,
    parses_tool_calls,
    validate_body,
)
from tailserve.server.request_ids import request_id_of
from tailserve.server.responses import (
    Job,
    Kind,
    add_echo,
    choice_chunks,
    full_response,
    logprobs_json,
    prompt_logprobs_json,
    role_chunk,
    stream_end,
    text_chunk,
    usage,
)
from tailserve.server.sampling_args import sampling_params
from tailserve.server.slo_classes import TPOT_HEADER, TTFT_HEADER, SloClasses, SloHeaders
from tailserve.server.tools import ToolCallStream

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class Render(Protocol):
    """Another API's output over the chat path (/v1/responses): its body, its events, its error event."""

    def body(self, job: Job, finals: Sequence[RequestOutput]) -> dict[str, Any]: ...

    def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]: ...

    def error_event(self, body: dict[str, Any]) -> bytes: ...


class Serving:
    """Turns /v1/completions and /v1/chat/completions requests into engine generations."""

    def __init__(
        self,
        engine: Engine,
        admission: Admission,
        metrics: ServerMetrics,
        max_tokens_default: int,
        defaults: GenerationDefaults,
        slo_classes: SloClasses | None = None,
        cache_salt_from_api_key: bool = False,
        trust_request_slo: bool = False,
    ) -> None:
        self._engine = engine
        self._trust_request_slo = trust_request_slo
        self._cache_salt_from_api_key = cache_salt_from_api_key
        self._slo_classes = slo_classes or SloClasses.builtin(engine.config.scheduler)
        self._admission = admission
        self._metrics = metrics
        self._max_tokens_default = max_tokens_default
        self._defaults = defaults

    async def handle(
        self, kind: Kind, request: Request, render: Render | None = None, body: bytes | None = None
    ) -> Response:
        """The whole request; typed errors propagate to the app's single error mapping. `body` and
        `render`: another API served as chat (its body translated to a chat request, its own output)."""
        self._admission.check_available()
        api_key = bearer_token(request.headers.get("authorization"))
        raw = await request.body() if body is None else body
        h = request.headers
        slo_headers = SloHeaders(tuple(h.getlist(TTFT_HEADER)), tuple(h.getlist(TPOT_HEADER)))
        prepared = self.prepare(kind, raw, api_key, request_id_of(request), slo_headers)
        grammars = (i.params.grammar for i in prepared.inputs if i.params.grammar is not None)
        for spec in dict.fromkeys(grammars):
            await self._engine.prepare_grammar(spec)  # on a worker thread; a bad one is a 400 here
        return await self.respond(prepared, request.receive, render)

    def prepare(
        self,
        kind: Kind,
        body: bytes,
        api_key: str | None = None,
        request_id: str | None = None,
        slo_headers: SloHeaders | None = None,
    ) -> Prepared:
        """Body -> validated engine inputs (one per choice); raises before anything is queued.
        `api_key` (the caller's bearer token) may pick the request's SLO class and its cache_salt;
        `slo_headers` (the gateway's x-slo-ttft-ms / x-slo-tpot-ms) may set its targets (tighter than
        the caller's class only with --trust-request-slo, as the body's `slo` and `priority`);
        `request_id` (X-Request-Id) names it to the client (`chatcmpl-<request_id>`); the engine's
        ids stay fresh, so a client reusing an id (a retry) never collides with a running request."""
        data = parse_json(body)
        tokenizer = self._engine.tokenizer
        req: CompletionRequest | ChatCompletionRequest
        if kind == "completion":
            req = validate_body(CompletionRequest, data)
            self._check_model(req.model)
            prompts = completion_prompt_ids(req, tokenizer)
        else:
            req = validate_body(ChatCompletionRequest, data)
            self._check_model(req.model)
            prompts = [chat_prompt_ids(req, tokenizer)]
        slo_body = req.slo.model_dump() if req.slo is not None else None
        slo = self._slo_classes.for_request(
            api_key, req.model, req.priority, slo_body, slo_headers, trusted=self._trust_request_slo
        )
        salt = req.cache_salt
        if self._cache_salt_from_api_key and api_key is not None:
            salt = api_key_cache_salt(api_key, salt)
        # Engine limits (context, vocabulary, KV pool) are checked by the engine's add_request; the
        # max_tokens rule (check_max_tokens) first here, in the name the client sent it as.
        limit, default = self._engine.max_model_len, self._max_tokens_default
        all_params = [
            sampling_params(req, len(ids), limit, default, self._defaults, cache_salt=salt) for ids in prompts
        ]
        shows_logprobs = all_params[0].logprobs is not None
        n = choices_per_prompt(req)
        per_prompt = candidates_per_prompt(req, n)  # best_of
        best_of = (n, per_prompt) if per_prompt > n else None
        if best_of is not None:  # candidates are ranked by cumulative logprob, so each one computes it
            all_params = [_with_logprobs(p) for p in all_params]
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        engine_id = f"{prefix}-{uuid.uuid4().hex}"
        public_id = f"{prefix}-{request_id}" if request_id else engine_id
        echo = (
            echo_texts(req, prompts, tokenizer) if isinstance(req, CompletionRequest) and req.echo else None
        )
        inputs = fan_out(prompts, all_params, per_prompt, engine_id, req.stream, include_usage, echo)
        job = functools.partial(
            Job,
            public_id,
            kind,
            self._engine.model_name,
            int(time.time()),
            include_usage,
            continuous_usage=include_usage and options is not None and options.continuous_usage_stats,
            token_text=(lambda t: tokenizer.decode([t])) if shows_logprobs else None,
            tool_calls=parses_tool_calls(req),
            max_tool_calls=1
            if isinstance(req, ChatCompletionRequest) and req.parallel_tool_calls is False
            else None,
            best_of=best_of,
            slo=slo,
        )
        return Prepared(engine_id, inputs, slo, job)

    def _check_model(self, model: str) -> None:
        if model != self._engine.model_name:
            raise ModelNotFoundError(model, self._engine.model_name)

    async def respond(self, prepared: Prepared, receive: Receive, render: Render | None = None) -> Response:
        """Admit every choice and queue it, wait for all first outputs (errors still become a proper
        status), then answer: a stream of events, or one body once every choice has finished."""
        inputs = prepared.inputs
        closing = self._admission.drain.closing
        runs: list[_Run] = []
        handed_over = False
        finals: list[RequestOutput] | None = None
        self._admission.check_fits(len(inputs), sum(not inp.shares_prompt for inp in inputs))
        try:
            for i, inp in enumerate(inputs):
                # One engine request per choice, named after the HTTP request (`-index` when several).
                rid = prepared.request_id if len(inputs) == 1 else f"{prepared.request_id}-{i}"
                admitted = self._engine.submit(
                    rid,
                    inp.prompt_token_ids,
                    inp.params,
                    functools.partial(self._admission.admit, own_admitted=i, generations=len(inputs)),
                    slo=prepared.slo,
                    fork_of=inp.fork_of,
                )
                run = _Run(rid, self._engine, self._metrics, admitted.ticket, prepared.slo)
                run.gen = admitted.stream
                if admitted.ticket.held_s > 0:
                    self._metrics.held.inc()
                runs.append(run)
            first = runs[0].ticket
            job = prepared.job(
                admission_estimate_s=first.estimate_s, admission_tpot_estimate_s=first.tpot_estimate_s
            )
            firsts = await until_disconnect(_all([anext(r.gen) for r in runs]), receive, closing)
            if firsts is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            for run in runs:  # awaited together, several first outputs have no time of their own
                run.ticket.started(teach=len(runs) == 1)
            if inputs[0].stream:
                handed_over = True  # from here the event stream owns the runs and closes them
                if render is not None:
                    events = self._rendered_events(render, job, firsts, runs)
                else:
                    events = self._events(job, firsts, runs, inputs)
                return SSEResponse(events, on_close=_close_all(runs), closing=closing)
            work_left = _all([_last_output(f, r.gen) for f, r in zip(firsts, runs, strict=True)])
            finals = await until_disconnect(work_left, receive, closing)
            if finals is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(render.body(job, finals) if render else _body(job, inputs, finals))
        finally:
            if not handed_over:
                for i, run in enumerate(runs):
                    await run.close(finals[i] if finals is not None else None)

    async def _events(
        self, job: Job, firsts: list[RequestOutput], runs: list[_Run], inputs: list[EngineInput]
    ) -> AsyncGenerator[bytes, None]:
        """SSE events from the first outputs to [DONE], each chunk naming its choice's index; an
        engine error mid-stream becomes an error event. With echo, a choice's first chunk is its
        prompt (and the prompt's logprobs when asked)."""
        tools = [ToolCallStream(job.max_tool_calls) if job.tool_calls else None for _ in runs]
        finals: list[RequestOutput | None] = [None] * len(runs)
        # Per choice: logprobs of tokens whose text is still held back, and the next text_offset.
        pending: list[list[TokenLogprob]] = [[] for _ in runs]
        offsets = [0] * len(runs)
        outputs = _merged([r.gen for r in runs], firsts)
        try:
            if job.kind == "chat" and len(runs) == 1:
                yield sse_event(role_chunk(job))
            for i, (inp, first) in enumerate(zip(inputs, firsts, strict=True)):
                if inp.echo_text is not None:
                    lps = prompt_logprobs_json(job, inp.prompt_token_ids, first.prompt_logprobs)
                    yield sse_event(text_chunk(job, inp.echo_text, None, None, lps, i))
                    offsets[i] = len(inp.echo_text)
            async for i, out in outputs:
                pending[i] += out.new_logprobs
                if out.finished:
                    finals[i] = out
                if not (out.finished or out.new_text):
                    continue
                lps = logprobs_json(job, pending[i], offsets[i])
                offsets[i] += sum(len(t) for t in (lps or {}).get("tokens", []))
                pending[i] = []
                chunks = choice_chunks(job, out, lps, i, tools[i])
                if all(f is not None for f in finals):
                    done = [f for f in finals if f is not None]
                    chunks = stream_end(job, chunks, done, [not x.shares_prompt for x in inputs])
                for chunk in chunks:
                    yield sse_event(chunk)
            yield SSE_DONE
        except Exception as exc:
            http = to_http(exc)
            self._metrics.errors.labels(status=str(http.status)).inc()
            yield sse_event(http.body)
            yield SSE_DONE
        finally:
            await outputs.aclose()
            for run, final in zip(runs, finals, strict=True):
                await run.close(final)

    async def _rendered_events(
        self, render: Render, job: Job, firsts: list[RequestOutput], runs: list[_Run]
    ) -> AsyncGenerator[bytes, None]:
        """`render`'s events over the outputs; an engine error mid-stream becomes its error event."""
        finals: list[RequestOutput | None] = [None] * len(runs)
        outputs = _merged([r.gen for r in runs], firsts)

        async def tracked() -> AsyncIterator[tuple[int, RequestOutput]]:
            async for i, out in outputs:
                if out.finished:
                    finals[i] = out
                yield i, out

        try:
            async for event in render.events(job, tracked()):
                yield event
        except Exception as exc:
            http = to_http(exc)
            self._metrics.errors.labels(status=str(http.status)).inc()
            yield render.error_event(http.body)
        finally:
            await outputs.aclose()
            for run, final in zip(runs, finals, strict=True):
                await run.close(final)


@dataclass(frozen=True)
class Prepared:
    """A validated request before admission: its engine inputs (one per choice, in choice order) and
    its Job, built once admission has priced the first choice (`job(admission_estimate_s=...)`)."""

    request_id: str
    inputs: list[EngineInput]
    slo: SloTarget | None  # its latency targets (its class's, or its own), None: the engine's
    job: Callable[..., Job]


class _Run:
    """One engine generation and its admission ticket; close() settles both exactly once."""

    def __init__(
        self,
        request_id: str,
        engine: Engine,
        metrics: ServerMetrics,
        ticket: Ticket,
        slo: SloTarget | None = None,
    ) -> None:
        self.request_id = request_id
        self.slo = slo
        self.gen: AsyncIterator[RequestOutput] = _nothing()
        self.ticket = ticket
        self._engine = engine
        self._metrics = metrics
        self._closed = False

    async def close(self, out: RequestOutput | None = None) -> None:
        """Metrics for a finished request; abort anything else; release the ticket."""
        if self._closed:
            return
        self._closed = True
        try:
            if out is not None and out.finished:
                self._metrics.observe_finished(out, self.slo)
            else:
                self._engine.abort(self.request_id)
                self._metrics.observe_aborted()
            aclose = getattr(self.gen, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self.ticket.done()


def api_key_cache_salt(api_key: str, cache_salt: str | None) -> str:
    """--cache-salt-from-api-key: one salt per (key, the request's own salt); a digest, so the key
    itself never reaches the engine, and no other key's requests can name the same salt."""
    return hashlib.sha256(json.dumps([api_key, cache_salt]).encode()).hexdigest()


def _with_logprobs(params: SamplingParams) -> SamplingParams:
    """best_of ranks by cumulative logprob: computed even where the client did not ask (then not shown)."""
    return params if params.logprobs is not None else dataclasses.replace(params, logprobs=0)


def _body(job: Job, inputs: Sequence[EngineInput], finals: Sequence[RequestOutput]) -> dict[str, Any]:
    """The non-streamed body: with best_of, each prompt's n candidates of highest cumulative logprob,
    best first (usage counts every candidate's tokens); with echo, each choice's prompt before it."""
    chosen = list(range(len(finals)))
    if job.best_of is not None:
        n, per_prompt = job.best_of
        chosen = []
        for start in range(0, len(finals), per_prompt):
            group = range(start, start + per_prompt)
            chosen += sorted(group, key=lambda i: -sum(lp.logprob for lp in finals[i].logprobs))[:n]
    counted = [not inputs[i].shares_prompt for i in chosen]
    body = full_response(job, [finals[i] for i in chosen], counted)
    if job.best_of is not None:
        body["usage"] = usage(finals, [not x.shares_prompt for x in inputs])
    for choice, i in zip(body["choices"], chosen, strict=True):
        if (text := inputs[i].echo_text) is not None:
            add_echo(job, choice, text, inputs[i].prompt_token_ids, finals[i])
    return body


async def _all(work: list[Awaitable[RequestOutput]]) -> list[RequestOutput]:
    """Every result, in order; on the first error the rest are cancelled before it propagates
    (so no generator is still running when its run is closed)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _close_all(runs: list[_Run]) -> Callable[[], Awaitable[None]]:
    """The SSE response's on_close for several runs (each closes once)."""

    async def close() -> None:
        for run in runs:
            await run.close()

    return close


async def _nothing() -> AsyncGenerator[RequestOutput, None]:
    return
    yield


async def _last_output(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Iterate to the finished output (a non-streamed response needs only the last one)."""
    out = first
    while not out.finished:
        out = await anext(gen)
    return out


async def _merged(
    gens: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) from every generator as they come, starting with the first outputs,
    until each has finished; a generator's error is raised here. One generator is read directly."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(gens) == 1:
        out = firsts[0]
        while not out.finished:
            out = await anext(gens[0])
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(i: int, out: RequestOutput) -> None:
        try:
            while not out.finished:
                out = await anext(gens[i])
                await queue.put((i, out))
        except Exception as exc:  # handed to the reader below, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, f)) for i, f in enumerate(firsts)]
    unfinished = sum(not f.finished for f in firsts)
    try:
        while unfinished:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item.finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
