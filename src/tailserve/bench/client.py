"""The HTTP side: one streamed OpenAI-compatible request, timed chunk by chunk, into a RequestRecord.

Talks HTTP only (httpx, async). Never raises for a failed request: the failure is classified into
`error_kind` on the record (see docs/BENCH.md for the kinds) so the run can go on and count it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import httpx

from tailserve.bench.errors import TargetError
from tailserve.bench.records import RequestRecord, allocate_tokens
from tailserve.bench.sse import MalformedSSEError, SSEParser, snippet, sse_lines
from tailserve.bench.tokenizers import PromptTokenizer
from tailserve.bench.workload import TurnPlan

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_BODY_LIMIT = 2000
MESSAGE_CHARS = 400  # of a server's own error message kept in a record (a bare body: sse.snippet's)


@dataclass(frozen=True)
class TargetConfig:
    """The server under test. `extra_body` is merged into every request body."""

    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = True
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> str:
        """Base URL without a trailing slash or `/v1`."""
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def redacted(self) -> dict[str, Any]:
        """For the result file: everything but the key."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "endpoint": self.endpoint,
            "api_key": "***" if self.api_key else None,
            "timeout_s": self.timeout_s,
            "ignore_eos": self.ignore_eos,
            "include_usage": self.include_usage,
            "extra_body": self.extra_body,
        }


async def preflight(target: TargetConfig) -> str:
    """Check reachability, auth and the model name via GET /v1/models; return the model to use."""
    try:
        async with httpx.AsyncClient(timeout=min(10.0, target.timeout_s)) as http:
            resp = await http.get(target.root + "/v1/models", headers=target.headers())
    except httpx.HTTPError as exc:
        raise TargetError(f"cannot reach {target.root}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code in (401, 403):
        raise TargetError(
            f"authentication failed at {target.root} (HTTP {resp.status_code}); check --api-key"
        )
    if resp.status_code != 200:
        # Not every server lists models; the first requests will tell.
        if target.model is None:
            raise TargetError(f"{target.root}/v1/models answered HTTP {resp.status_code}; pass --model")
        return target.model
    try:
        served = [str(m["id"]) for m in resp.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        served = []
    if target.model is None:
        if not served:
            raise TargetError(f"{target.root}/v1/models lists no model; pass --model")
        return served[0]
    if served and target.model not in served:
        raise TargetError(f"model {target.model!r} is not served at {target.root}; it serves {served}")
    return target.model


def request_body(
    target: TargetConfig, model: str, turn: TurnPlan, history: list[dict[str, str]]
) -> dict[str, Any]:
    """The JSON body for one turn; `history` holds the earlier turns' user/assistant messages."""
    body: dict[str, Any] = {"model": model, "max_tokens": turn.output_tokens, "stream": True}
    if target.include_usage:
        body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        messages = [{"role": "system", "content": turn.system_prefix}] if turn.system_prefix else []
        body["messages"] = [*messages, *history, {"role": "user", "content": turn.prompt}]
    else:
        parts = [turn.system_prefix] if turn.system_prefix else []
        parts += [m["content"] for m in history] + [turn.prompt]
        body["prompt"] = "\n\n".join(parts)
    body.update(target.extra_body)
    return body


def classify_status(status: int) -> str:
    """Error kind for a non-200 HTTP status."""
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "not_found"
    if status in (400, 413, 422):
        return "bad_request"
    if status == 429:
        return "rate_limited"
    if status >= 500:
        return "server_error"
    return "http_error"


class _StreamState:
    """What a stream has carried so far."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.texts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, float] | None = None
        self.finish_reason: str | None = None
        self.done = False


async def send_request(
    http: httpx.AsyncClient,
    target: TargetConfig,
    body: dict[str, Any],
    record: RequestRecord,
    tokenizer: PromptTokenizer,
    run_start: float,
) -> RequestRecord:
    """Send `body`, stream the answer, fill `record` (timings, tokens, or the error) and return it."""
    state = _StreamState()
    sent = time.perf_counter()
    record.sent_s = sent - run_start
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(http, target, body, record, state, sent)
    except TimeoutError:
        _fail(record, "timeout", f"no complete answer within {target.timeout_s:g} s")
    except MalformedSSEError as exc:
        _fail(record, "malformed_sse", str(exc))
    except httpx.ConnectError as exc:
        _fail(record, "connect", f"cannot connect to {target.url}: {exc}")
    except httpx.TimeoutException as exc:
        _fail(record, "timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        _fail(record, "protocol", f"{type(exc).__name__}: {exc}")
    record.done_s = time.perf_counter() - sent
    _finish_counts(record, state, tokenizer)
    return record


async def _stream(
    http: httpx.AsyncClient,
    target: TargetConfig,
    body: dict[str, Any],
    record: RequestRecord,
    state: _StreamState,
    sent: float,
) -> None:
    async with http.stream("POST", target.url, json=body, headers=target.headers()) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            record.retry_after_s = _retry_after(resp.headers.get("retry-after"))
            raw = (await resp.aread())[:_ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
            _fail(record, classify_status(resp.status_code), f"HTTP {resp.status_code}: {_error_text(raw)}")
            return
        parser = SSEParser()
        async for line in sse_lines(resp.aiter_bytes()):
            payload = parser.feed_line(line)
            if payload is not None and _on_event(payload, state, time.perf_counter() - sent, record):
                return
        payload = parser.finish()
        if payload is not None and _on_event(payload, state, time.perf_counter() - sent, record):
            return
    if not state.done and state.finish_reason is None:
        _fail(record, "incomplete", "stream ended without [DONE] or a finish_reason")


def _on_event(payload: str, state: _StreamState, at: float, record: RequestRecord) -> bool:
    """Handle one SSE data payload; True when the stream is over (done or failed)."""
    if payload.strip() == "[DONE]":
        state.done = True
        return True
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        raise MalformedSSEError(f"data is not JSON: {snippet(payload)!r}") from None
    if not isinstance(chunk, dict):
        raise MalformedSSEError(f"data is not a JSON object: {snippet(payload)!r}")
    if "error" in chunk:
        _fail(record, "stream_error", f"server error mid-stream: {snippet(json.dumps(chunk['error']))}")
        return True
    choices = chunk.get("choices")
    if choices is None and "usage" not in chunk:
        raise MalformedSSEError(f"chunk has neither choices nor usage: {snippet(payload)!r}")
    if isinstance(chunk.get("usage"), dict):
        state.usage = chunk["usage"]
    if isinstance(chunk.get("tailserve_timings"), dict):
        state.timings = {k: float(v) for k, v in chunk["tailserve_timings"].items() if _is_number(v)}
    if not isinstance(choices, list):
        if choices is not None:
            raise MalformedSSEError(f"choices is not a list: {snippet(payload)!r}")
        return False
    for choice in choices:
        _on_choice(choice, state, at)
    return False


def _on_choice(choice: Any, state: _StreamState, at: float) -> None:
    if not isinstance(choice, dict):
        raise MalformedSSEError(f"choice is not an object: {snippet(repr(choice))!r}")
    delta = choice.get("delta")
    if isinstance(delta, dict):
        text = delta.get("content") or delta.get("reasoning_content") or ""
        role_only = "role" in delta and not text
    else:
        text = choice.get("text") or ""
        role_only = False
    finish = choice.get("finish_reason")
    if not isinstance(text, str):
        raise MalformedSSEError(f"token text is not a string: {snippet(repr(text))!r}")
    # An empty-text chunk still stands for a token (e.g. a byte held back by the detokenizer),
    # and so does the chunk that closes the choice: its time is the last token's, even with no text
    # (tailserve sends the finish reason alone when the last token's text was held back). Role-only
    # openers do not.
    if text or not role_only:
        state.times.append(at)
        state.texts.append(text)
    if finish is not None:
        state.finish_reason = str(finish)


def _finish_counts(record: RequestRecord, state: _StreamState, tokenizer: PromptTokenizer) -> None:
    """Token counts: the server's usage first, the local tokenizer second, chunk count last."""
    record.chunk_times_s = state.times
    record.output_text = "".join(state.texts)
    record.finish_reason = state.finish_reason
    record.server_timings = state.timings
    usage = state.usage or {}
    if _is_number(usage.get("completion_tokens")):
        total, source = int(usage["completion_tokens"]), "usage"
    elif tokenizer.exact:
        total, source = tokenizer.count(record.output_text), "tokenizer"
    else:
        total, source = len(state.times), "chunks"
    # A partial stream (error after some tokens) still counts only the chunks that arrived.
    if record.error_kind is not None:
        total, source = len(state.times), "chunks"
    weights = [tokenizer.count(t) for t in state.texts] if tokenizer.exact else [1] * len(state.texts)
    record.chunk_tokens = allocate_tokens(weights, total)
    record.output_tokens = sum(record.chunk_tokens)
    record.output_tokens_source = source
    prompt_tokens = usage.get("prompt_tokens")
    record.input_tokens = int(prompt_tokens) if _is_number(prompt_tokens) else record.planned_input_tokens
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and _is_number(details.get("cached_tokens")):
        record.cached_tokens = int(details["cached_tokens"])
    if record.error_kind is None and record.output_tokens == 0:
        _fail(record, "no_tokens", "stream finished without any generated token")


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    if record.error_kind is None:
        record.error_kind = kind
        record.error_message = message


def _error_text(raw: str) -> str:
    """The `error.message` of an OpenAI-style error body (up to MESSAGE_CHARS: a refusal's message
    says why, e.g. the TPOT a 429 predicted), else the body itself (shortened)."""
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = err.get("message") if isinstance(err, dict) else None
        if isinstance(message, str):
            return snippet(message, MESSAGE_CHARS)
        if isinstance(obj, dict) and isinstance(obj.get("detail"), str):
            return snippet(obj["detail"], MESSAGE_CHARS)
    except json.JSONDecodeError:
        pass
    return snippet(raw.strip()) or "(empty body)"


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (the HTTP-date form is not used by inference servers)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
