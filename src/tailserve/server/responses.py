"""OpenAI response bodies and stream chunks, built from engine RequestOutputs.

Pure functions from (job, output) to JSON-ready dicts: no I/O, no engine calls, no hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tailserve.engine.request import RequestOutput, SloTarget, TokenLogprob
from tailserve.server.tools import ToolCallStream, parse_tool_calls

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Job:
    """One HTTP request as the response builders see it."""

    request_id: str
    kind: Kind
    model: str
    created: int
    include_usage: bool
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every text chunk
    token_text: Callable[[int], str] | None = None  # set when the request asked for logprobs
    tool_calls: bool = False  # chat with tools: the output is parsed for <tool_call> blocks
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1
    best_of: tuple[int, int] | None = None  # (n, best_of) when best_of > n: candidates to rank
    admission_estimate_s: float = 0.0  # the TTFT admission predicted for the (first) choice on arrival
    admission_tpot_estimate_s: float = 0.0  # its TPOT as admission priced it on arrival (0: not priced)
    slo: SloTarget | None = None  # the targets it was admitted and scheduled by (None: the engine's)


def logprobs_json(job: Job, lps: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs.content` shape, or the legacy completions shape (tokens,
    token_logprobs, top_logprobs, text_offset); None when the request did not ask."""
    text = job.token_text
    if text is None:
        return None
    if job.kind == "chat":

        def entry(tok: int, lp: float) -> dict[str, Any]:
            t = text(tok)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        content = [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
        return {"content": content, "refusal": None}
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    job: Job, prompt_ids: Sequence[int], lps: Sequence[TokenLogprob]
) -> dict[str, Any] | None:
    """`echo`: the legacy logprobs of the prompt's tokens; the first has no context, so its logprob
    and top_logprobs are null (as OpenAI and vLLM). None when the request did not ask."""
    text = job.token_text
    if text is None or not prompt_ids:
        return None
    first = text(prompt_ids[0])
    rest = logprobs_json(job, lps, len(first)) or {}
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def add_echo(
    job: Job, choice: dict[str, Any], echo_text: str, prompt_ids: Sequence[int], out: RequestOutput
) -> None:
    """Put the prompt before a non-streamed completion choice: its text, and its logprobs when asked
    (the generated tokens' text_offset then counts from the end of the prompt's text)."""
    choice["text"] = echo_text + choice["text"]
    head = prompt_logprobs_json(job, prompt_ids, out.prompt_logprobs)
    if head is not None:
        tail = logprobs_json(job, out.logprobs, len(echo_text)) or {}
        choice["logprobs"] = {key: head[key] + tail[key] for key in head}


def usage(
    out: RequestOutput | Sequence[RequestOutput], prompt_counted: Sequence[bool] | None = None
) -> dict[str, Any]:
    """OpenAI `usage` summed over the choices; a prompt shared by n choices counts once
    (`prompt_counted` False for the others), with `cached_tokens` from the prefix cache."""
    outs = [out] if isinstance(out, RequestOutput) else out
    counted = [o for o, c in zip(outs, prompt_counted or [True] * len(outs), strict=True) if c]
    prompt = sum(o.num_prompt_tokens for o in counted)
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in counted)},
    }


def timings(job: Job, out: RequestOutput) -> dict[str, float | int | str | None]:
    """The `tailserve_timings` extension field (docs/INTERFACES.md); zeros if the engine gave none.
    Beside the admission estimate: the SLO class and targets the request was admitted and scheduled by."""
    slo = job.slo
    estimate: dict[str, float | int | str | None] = {
        "admission_estimate_s": job.admission_estimate_s,
        "admission_tpot_estimate_s": job.admission_tpot_estimate_s,
        "slo_class": slo.slo_class if slo is not None else None,
        "slo_ttft_s": slo.ttft_s if slo is not None else None,
        "slo_tpot_s": slo.tpot_s if slo is not None else None,
    }
    if out.timings is not None:
        return out.timings.as_dict() | estimate
    keys = ("queue_s", "prefill_s", "ttft_s", "decode_s", "e2e_s")
    empty: dict[str, float | int | str | None] = dict.fromkeys(keys, 0.0)
    return (
        empty
        | {
            "preemptions": 0,
            "cached_tokens": out.num_cached_tokens,
            "prompt_tokens": out.num_prompt_tokens,
            "output_tokens": len(out.token_ids),
        }
        | estimate
    )


def full_response(
    job: Job, out: RequestOutput | Sequence[RequestOutput], prompt_counted: Sequence[bool] | None = None
) -> dict[str, Any]:
    """The non-streamed body of /v1/completions or /v1/chat/completions; one choice per output, in
    order (the timings are the first choice's)."""
    outs = [out] if isinstance(out, RequestOutput) else list(out)
    choices = []
    for index, o in enumerate(outs):
        lps = logprobs_json(job, o.logprobs)
        if job.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": o.text, "logprobs": lps}
        else:
            choice = {"index": index, "message": _chat_message(job, o), "logprobs": lps}
        choice["finish_reason"] = o.finish_reason
        if "tool_calls" in choice.get("message", {}) and o.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
        choices.append(choice)
    return {
        "id": job.request_id,
        "object": "text_completion" if job.kind == "completion" else "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage(outs, prompt_counted),
        "tailserve_timings": timings(job, outs[0]),
    }


def _chat_message(job: Job, out: RequestOutput) -> dict[str, Any]:
    """The assistant message; with tools, its <tool_call> blocks as `tool_calls` and the rest as content."""
    if not job.tool_calls:
        return {"role": "assistant", "content": out.text}
    content, calls = parse_tool_calls(out.text, job.max_tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def _chunk(job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job.request_id,
        "object": "text_completion" if job.kind == "completion" else "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if job.include_usage:
        body["usage"] = None  # OpenAI sends null on every chunk but the last when include_usage is set
    return body


def role_chunk(job: Job) -> dict[str, Any]:
    """The first chat chunk: the assistant role with empty content."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(job, [choice])


def text_chunk(
    job: Job,
    text: str,
    finish_reason: str | None,
    out: RequestOutput | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chunk carrying new text and, on the last one, the finish reason (usage so far if continuous);
    `delta` replaces a chat chunk's text delta (tool-call deltas)."""
    if job.kind == "completion":
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        if delta is None:
            delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    body = _chunk(job, [choice])
    if job.continuous_usage and out is not None:
        body["usage"] = usage(out)
    return body


def choice_chunks(
    job: Job,
    out: RequestOutput,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tools: ToolCallStream | None = None,
) -> list[dict[str, Any]]:
    """One choice's new output as chunks, the finish reason on the last once it is done. Parsed for
    tool calls (`tools`, that choice's parser), it is one chunk per delta the parser makes certain
    (logprobs on the first, or alone while text is held back) and finish_reason "tool_calls" when a
    call was made."""
    reason = out.finish_reason if out.finished else None
    if tools is None:
        return [text_chunk(job, out.new_text, reason, out, logprobs, index)]
    deltas = tools.feed(out.new_text) + (tools.finish() if out.finished else [])
    chunks = [
        text_chunk(job, "", None, out, logprobs if k == 0 else None, index, delta=d)
        for k, d in enumerate(deltas)
    ]
    if reason is not None or (not deltas and logprobs is not None):
        if reason == "stop" and tools.calls:
            reason = "tool_calls"
        chunks.append(text_chunk(job, "", reason, out, None if deltas else logprobs, index, delta={}))
    return chunks


def stream_end(
    job: Job,
    last: list[dict[str, Any]],
    outs: Sequence[RequestOutput],
    prompt_counted: Sequence[bool] | None = None,
) -> list[dict[str, Any]]:
    """The stream's last chunks: the last choice's (`last`, its finish reason among them), then the
    usage chunk when asked; the timings go on the final chunk, which for several choices is the usage
    chunk or an empty-choices chunk of its own."""
    if job.include_usage:
        last = [*last, _chunk(job, []) | {"usage": usage(outs, prompt_counted)}]
    elif len(outs) > 1:
        last = [*last, _chunk(job, [])]
    last[-1]["tailserve_timings"] = timings(job, outs[0])  # the first choice's
    return last
