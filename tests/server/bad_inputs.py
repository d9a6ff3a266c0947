"""The probe's catalogue of bad requests, one table for the server and the router in front of it.

Each entry must get a 4xx OpenAI JSON error, change no engine state (no KV block held, no prompt
run) and, when its body was read, leave the keep-alive connection answering the next request.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

TINY = "dummy-tiny"
BODY_LIMIT = "256KiB"  # the servers under test run with --max-body-bytes 256KiB
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class BadInput:
    """One bad request and the error it must get."""

    name: str
    body: bytes | dict[str, Any]
    status: int
    param: str | None = None
    path: str = "/v1/completions"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    body_read: bool = True  # False: refused from the headers, so the connection cannot be reused
    says: str | None = None  # a phrase the message must keep (the useful part of a library's complaint)

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def _chat(content: Any) -> dict[str, Any]:
    return {"model": TINY, "messages": [{"role": "user", "content": content}]}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BAD_INPUTS: list[BadInput] = [
    BadInput("truncated json", b'{"model": "dummy-tiny", "prompt": ', 400),
    BadInput("invalid utf-8", b'{"model": "dummy-tiny", "prompt": "\xff\xfe"}', 400),
    BadInput("json array", b"[1, 2, 3]", 400),
    BadInput("nested 1000 deep", b'{"model": "dummy-tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400),
    BadInput("5000-digit max_tokens", b'{"model": "dummy-tiny", "prompt": "a", "max_tokens": ' + b"7" * 5000 + b"}", 400),
    BadInput("lone surrogate prompt", b'{"model": "dummy-tiny", "prompt": "a\\ud800b"}', 400),
    BadInput("lone surrogate chat", json.dumps(_chat("x")).replace("x", "\\udc00").encode(), 400, path="/v1/chat/completions"),
    BadInput("seed 2**64", {"model": TINY, "prompt": "a", "seed": 2**64}, 400, "seed"),
    BadInput("seed below -2**63", {"model": TINY, "prompt": "a", "seed": -(2**63) - 1}, 400, "seed"),
    BadInput("max_tokens as text", {"model": TINY, "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    BadInput("prompt as number", {"model": TINY, "prompt": 12}, 400, "prompt"),
    BadInput("no prompt", {"model": TINY}, 400, "prompt"),
    BadInput("no model", {"prompt": "a"}, 400, "model"),
    BadInput("max_tokens 0", {"model": TINY, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    BadInput("max_tokens past the context", {"model": TINY, "prompt": "a", "max_tokens": 10**6}, 400, "max_tokens"),
    BadInput("prompt past the context", {"model": TINY, "prompt": "a" * 3000, "max_tokens": 1}, 400, "prompt"),
    BadInput("token id past the vocabulary", {"model": TINY, "prompt": [10**9]}, 400, "prompt"),
    BadInput("empty prompt", {"model": TINY, "prompt": ""}, 400, "prompt"),
    BadInput("empty prompt in a list", {"model": TINY, "prompt": ["a", ""]}, 400, "prompt[1]"),
    BadInput("a listed prompt past the context", {"model": TINY, "prompt": ["a", "a" * 3000], "max_tokens": 1}, 400, "prompt"),
    BadInput("unknown model", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    BadInput("n over 16", {"model": TINY, "prompt": "a", "n": 17}, 400, "n"),
    BadInput("logprobs over 20", {"model": TINY, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    BadInput("top_logprobs over 20", {"model": TINY, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "/v1/chat/completions"),
    BadInput("negative temperature", {"model": TINY, "prompt": "a", "temperature": -1}, 400, "temperature"),
    BadInput("top_p past 1", {"model": TINY, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    BadInput("logit_bias key not an id", {"model": TINY, "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    BadInput("logit_bias past the vocabulary", {"model": TINY, "prompt": "a", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    BadInput("stop_token_ids past the vocabulary", {"model": TINY, "prompt": "a", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    BadInput("min_tokens over max_tokens", {"model": TINY, "prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    BadInput("repetition_penalty 0", {"model": TINY, "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    BadInput("unknown field", {"model": TINY, "prompt": "a", "unknown_knob": 1}, 400, "unknown_knob"),
    BadInput(
        "stream_options without stream",
        {"model": TINY, "prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    BadInput("text/plain body", {"model": TINY, "prompt": "a"}, 415, headers={"content-type": "text/plain"}),
    BadInput("form body", b"model=x", 415, headers={"content-type": "application/x-www-form-urlencoded"}),
    BadInput("body over the limit", {"model": TINY, "prompt": "a" * 300_000}, 413, body_read=False),
    BadInput("no messages", {"model": TINY, "messages": []}, 400, "messages", "/v1/chat/completions"),
    BadInput("messages as text", {"model": TINY, "messages": "hi"}, 400, "messages", "/v1/chat/completions"),
    BadInput("user content null", _chat(None), 400, "messages[0].content", "/v1/chat/completions"),
    BadInput("user content []", _chat([]), 400, "messages[0].content", "/v1/chat/completions"),
    BadInput(
        "tool without a function",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0]",
        "/v1/chat/completions",
    ),
    BadInput(
        "tool_choice names an unknown tool",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "tools": [_TOOL],
         "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "tool_choice",
        "/v1/chat/completions",
    ),
    BadInput(
        "tool message without tool_call_id",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
        400,
        "messages[1].tool_call_id",
        "/v1/chat/completions",
    ),
    BadInput(
        "malformed json schema",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        400,
        "response_format.json_schema.schema",
        "/v1/chat/completions",
        says='Unsupported type "nope"',
    ),
    BadInput(
        "json schema with a dangling $ref",
        {"model": TINY, "prompt": "a", "structured_outputs": {"json": {"$ref": "#/definitions/missing"}}},
        400,
        "structured_outputs.json",
        says="#/definitions/missing",
    ),
    BadInput(
        "json schema minimum over maximum",
        {"model": TINY, "prompt": "a", "structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
        400,
        "structured_outputs.json",
        says="minimum greater than maximum",
    ),
    BadInput(
        "unclosed regex",
        {"model": TINY, "prompt": "a", "structured_outputs": {"regex": "[unclosed"}},
        400,
        "structured_outputs.regex",
        says="Unclosed '['",
    ),
    BadInput(
        "grammar with an undefined rule",
        {"model": TINY, "prompt": "a", "structured_outputs": {"grammar": "root ::= foo"}},
        400,
        "structured_outputs.grammar",
        says='Rule "foo" is not defined',
    ),
    BadInput(
        "min_tokens with a grammar",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "min_tokens": 5,
         "structured_outputs": {"choice": ["yes", "no"]}},
        400,
        "min_tokens",
        "/v1/chat/completions",
    ),
    BadInput("no role", {"model": TINY, "messages": [{"content": "x"}]}, 400, "messages[0].role", "/v1/chat/completions"),
    BadInput(
        "negative max_completion_tokens",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
        400,
        "max_completion_tokens",
        "/v1/chat/completions",
    ),
    BadInput("chat unknown model", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "/v1/chat/completions"),
    BadInput("empty cache_salt", {"model": TINY, "prompt": "a", "cache_salt": ""}, 400, "cache_salt"),
    BadInput("cache_salt as number", {"model": TINY, "prompt": "a", "cache_salt": 7}, 400, "cache_salt"),
    BadInput("cache_salt of 257 characters", {"model": TINY, "prompt": "a", "cache_salt": "s" * 257}, 400, "cache_salt"),
    BadInput("empty cache_salt in chat", {**_chat("x"), "cache_salt": ""}, 400, "cache_salt", "/v1/chat/completions"),
    BadInput(
        "64 prompts x n=16: more generations than the queue holds",
        {"model": TINY, "prompt": ["a"] * 64, "n": 16, "max_tokens": 1},
        400,
        "n",
        says="1024 generations",
    ),
    # The gateway's SLO headers (issue 42): a number of milliseconds in (0, one hour], sent once
    BadInput("x-slo-ttft-ms not a number", {"model": TINY, "prompt": "a"}, 400, "x-slo-ttft-ms", headers={**JSON, "x-slo-ttft-ms": "fast"}),
    BadInput("x-slo-ttft-ms negative", {"model": TINY, "prompt": "a"}, 400, "x-slo-ttft-ms", headers={**JSON, "x-slo-ttft-ms": "-5"}),
    BadInput("x-slo-tpot-ms zero", {"model": TINY, "prompt": "a"}, 400, "x-slo-tpot-ms", headers={**JSON, "x-slo-tpot-ms": "0"}),
    BadInput("x-slo-tpot-ms nan", {"model": TINY, "prompt": "a"}, 400, "x-slo-tpot-ms", headers={**JSON, "x-slo-tpot-ms": "nan"}),
    BadInput("x-slo-ttft-ms past an hour", {"model": TINY, "prompt": "a"}, 400, "x-slo-ttft-ms", headers={**JSON, "x-slo-ttft-ms": "3600001"}),
    BadInput("x-slo-tpot-ms of 400 digits in chat", _chat("x"), 400, "x-slo-tpot-ms", "/v1/chat/completions", {**JSON, "x-slo-tpot-ms": "9" * 400}),
    BadInput("slo.ttft_ms past an hour", {"model": TINY, "prompt": "a", "slo": {"ttft_ms": 1e12}}, 400, "slo.ttft_ms"),
    # vLLM's tokenizer routes, which the router forwards too (issue 43)
    BadInput("tokenize prompt and messages", {"model": TINY, "prompt": "a", "messages": []}, 400, "prompt", "/tokenize"),
    BadInput("tokenize unknown model", {"model": "nope", "prompt": "a"}, 404, "model", "/tokenize"),
    BadInput("tokenize truncated json", b'{"model": "dummy-tiny", "prompt": ', 400, path="/tokenize"),
    BadInput("detokenize id past the vocabulary", {"model": TINY, "tokens": [10**9]}, 400, "tokens", "/detokenize"),
    BadInput("detokenize tokens as text", {"model": TINY, "tokens": "abc"}, 400, "tokens", "/detokenize"),
]  # fmt: skip

INTERNALS = re.compile(r"\[\d\d:\d\d:\d\d\]|/[\w.-]+/\S*\.(cc|cpp|h|hpp|py)\b|\.(cc|cpp|h|hpp|py):\d+")
GOOD = json.dumps({"model": TINY, "prompt": "fine", "max_tokens": 2}).encode()


def kv_blocks_used(metrics_base: str) -> float:
    text = httpx.get(f"{metrics_base}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tailserve_kv_blocks_used":
                return float(sample.value)
    raise KeyError("tailserve_kv_blocks_used")


def wait_no_blocks(metrics_base: str, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (used := kv_blocks_used(metrics_base)) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return used


def check_bad_inputs(base: str, metrics_base: str) -> None:
    """Send every entry to `base` over one keep-alive connection; `metrics_base` is the engine's server."""
    url = urlparse(base)
    assert url.hostname is not None and url.port is not None
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        for entry in BAD_INPUTS:
            conn.request("POST", entry.path, body=entry.content(), headers=entry.headers)
            sock = conn.sock
            response = conn.getresponse()
            raw = response.read()
            assert response.status == entry.status, (entry.name, response.status, raw[:300])
            assert 400 <= response.status < 500
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}, (entry.name, raw[:300])
            assert error["message"] and error["type"], entry.name
            if entry.param is not None:
                assert error["param"] == entry.param, (entry.name, raw[:300])
            # No build path, source line or log timestamp of a library leaks into a message.
            assert not INTERNALS.search(error["message"]), (entry.name, error["message"])
            if entry.says is not None:
                assert entry.says in error["message"], (entry.name, error["message"])
            assert wait_no_blocks(metrics_base) == 0, entry.name
            if not entry.body_read:
                conn.close()
                continue
            conn.request("POST", "/v1/completions", body=GOOD, headers=JSON)
            good = conn.getresponse()
            assert good.status == 200, (entry.name, good.read()[:300])
            good.read()
            assert conn.sock is sock and sock is not None, f"{entry.name}: the connection was dropped"
    finally:
        conn.close()
