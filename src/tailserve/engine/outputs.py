"""Turning sampled tokens into what callers see: stop rules, incremental text, RequestOutput snapshots.

It decides when a request is done (end token, stop token, stop string, max_tokens, context full, a
complete grammar) and which text may be released; it never touches the scheduler or the KV cache.
"""

from __future__ import annotations

import logging

from tailserve.engine.request import Request, RequestOutput
from tailserve.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    """Appends each sampled token to its request and says whether, and why, the request finished."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append_token(self, req: Request, token: int, now: float) -> str | None:
        """Record the token; return the finish reason ("stop" / "length") or None to go on. A complete
        grammar stops the request (its end token was the last taken)."""
        grammar_done = req.grammar is not None and (_rejected(req, token) or req.grammar.terminated)
        p = req.params
        req.token_ids.append(token)
        t = req.timings
        if t.first_token is None:
            t.first_token = now
        t.token_times.append(now)
        may_stop = req.num_output_tokens > p.min_tokens  # min_tokens: the sampler banned stop tokens
        is_eos = token in self.tokenizer.eos_token_ids and not p.ignore_eos
        if may_stop and (is_eos or token in p.stop_token_ids):
            return "stop"
        assert req.detokenizer is not None, "the engine gives every request a detokenizer"
        req.text += req.detokenizer.add(token)
        if may_stop and p.stop and _cut_at_stop(req):
            return "stop"
        if req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            return "length"
        return "stop" if grammar_done else None

    @staticmethod
    def output(req: Request, new_ids: list[int], finished: bool) -> RequestOutput:
        """The caller's view after this step; text that could still start a stop string is held back."""
        hold = 0 if finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        upto = max(req.emitted_chars, len(req.text) - hold)
        new_text = req.text[req.emitted_chars : upto]
        req.emitted_chars = upto
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=req.output_token_ids,
            text=req.text[:upto],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.timings.cached_tokens,
            timings=req.timings if finished else None,
            new_logprobs=req.logprobs[len(req.logprobs) - len(new_ids) :] if req.logprobs else [],
            logprobs=list(req.logprobs) if finished else [],
            prompt_logprobs=list(req.prompt_logprobs) if finished or req.num_output_tokens <= 1 else [],
        )


def _cut_at_stop(req: Request) -> bool:
    """Cut the text at the first stop string found in its new part; True if one was found."""
    longest = max(len(s) for s in req.params.stop)
    window_start = max(0, req.emitted_chars - longest)
    hits = [i for s in req.params.stop if (i := req.text.find(s, window_start)) >= 0]
    if not hits:
        return False
    req.text = req.text[: min(hits)]
    return True


def _rejected(req: Request, token: int) -> bool:
    """Feed the token to the request's grammar; True if it refuses it. The bitmask allows only tokens
    the grammar accepts: a refusal is a mask bug, so say so loudly rather than let a broken output
    pass as a normal stop."""
    assert req.grammar is not None
    if req.grammar.accept(token):
        return False
    log.error("request %s: sampled token %d outside its grammar; stopping it", req.request_id, token)
    return True
