"""End to end: `tailserve serve` as a subprocess on a loopback port, driven by the official openai client.

Most tests use the real engine with `dummy:tiny` (random weights, byte tokenizer); two check real
answers from the default SmolLM2 model. Nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailserve.kernels import cpu as cpu_kernels
from tests.server.bad_inputs import BAD_INPUTS, check_bad_inputs
from tests.server.harness import REPO, serve_process

TINY = "dummy-tiny"


def metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(base: str, name: str, **labels: str) -> float:
    return metrics(base).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(base: str, timeout_s: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Metrics once no request runs or waits and no KV block is held (or the last seen after timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        idle = all(
            m[(n, ())] == 0
            for n in ("tailserve_requests_running", "tailserve_requests_waiting", "tailserve_kv_blocks_used")
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_idle(base: str) -> None:
    m = wait_idle(base)
    assert m[("tailserve_requests_running", ())] == 0
    assert m[("tailserve_requests_waiting", ())] == 0
    assert m[("tailserve_kv_blocks_used", ())] == 0
    assert m[("tailserve_kv_blocks_capacity", ())] > 0


@pytest.fixture(scope="module")
def tiny() -> Iterator[str]:
    # Lax TTFT and TPOT targets: admission must not refuse requests because other jobs load the machine.
    with serve_process(
        ["--model", "dummy:tiny", "--max-body-bytes", "256KiB", "--slo-ttft", "60", "--slo-tpot", "60"]
    ) as server:
        yield server.base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_openai_client_completion_and_chat_with_usage(tiny: str) -> None:
    c = client(tiny)
    assert [m.id for m in c.models.list()] == [TINY]
    r = c.completions.create(
        model=TINY, prompt="Hello", max_tokens=8, seed=1, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == 13
    assert r.usage.prompt_tokens_details is not None
    timings = (r.model_extra or {})["tailserve_timings"]
    assert timings["output_tokens"] == 8 and timings["prompt_tokens"] == 5
    assert 0 <= timings["ttft_s"] <= timings["e2e_s"]

    ids = c.completions.create(
        model=TINY, prompt=[72, 101, 108], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ids.usage is not None and ids.usage.prompt_tokens == 3

    chat = c.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5


def _stream_text(stream: Any, chat: bool) -> tuple[str, list[Any]]:
    chunks = list(stream)
    text = ""
    for ch in chunks:
        for choice in ch.choices:
            text += (choice.delta.content or "") if chat else choice.text
    return text, chunks


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_non_streamed_for_same_seed(tiny: str, chat: bool) -> None:
    c = client(tiny)
    common: dict[str, Any] = {"model": TINY, "max_tokens": 40, "seed": 1234, "temperature": 0.8}
    common["extra_body"] = {"top_k": 50}
    if chat:
        messages: Any = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story"},
        ]
        full = c.chat.completions.create(messages=messages, **common)
        stream = c.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
        expected = full.choices[0].message.content
    else:
        full = c.completions.create(prompt="Once upon a time", **common)
        stream = c.completions.create(
            prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **common
        )
        expected = full.choices[0].text
    text, chunks = _stream_text(stream, chat)
    assert text == expected
    assert full.usage is not None
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert "tailserve_timings" in (last.model_extra or {})
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


X_ID = ord("x") + 3  # dummy:tiny's byte tokenizer: id = byte + 3


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_sampling_extensions_and_sdk_fields_over_http(tiny: str, chat: bool, stream: bool) -> None:
    c = client(tiny)
    common: dict[str, Any] = {
        "model": TINY,
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": {str(X_ID): 100},
        "presence_penalty": 0.5,
        "frequency_penalty": 0.2,
        "user": "u-1",
        # vLLM's extensions: the stop id is the forced one, held off for min_tokens tokens
        "extra_body": {"repetition_penalty": 1.1, "min_p": 0.1, "min_tokens": 3, "stop_token_ids": [X_ID]},
    }
    routine = {"store": False, "metadata": {"team": "eval"}, "service_tier": "auto"}
    if chat:
        common |= routine  # the client's own chat parameters
    else:
        common["extra_body"] |= routine  # sent by SDKs that share one body for both endpoints
    if stream:
        common["stream_options"] = {"include_usage": True}
    if chat:
        r: Any = c.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], stream=stream, **common
        )
    else:
        r = c.completions.create(prompt="hello", stream=stream, **common)
    if stream:
        text, chunks = _stream_text(r, chat)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        used = chunks[-1].usage
    else:
        choice = r.choices[0]
        text = choice.message.content if chat else choice.text
        finish, used = [choice.finish_reason], r.usage
    assert finish == ["stop"]
    assert used is not None and used.completion_tokens == 4  # 3 held tokens, then the stop id
    assert "x" not in text
    assert_idle(tiny)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_of_greedy_tokens_top_their_alternatives(tiny: str, stream: bool) -> None:
    c = client(tiny)
    kwargs: dict[str, Any] = {
        "model": TINY,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    messages: Any = [{"role": "user", "content": "hello"}]
    full = c.chat.completions.create(messages=messages, **kwargs)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == full.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-6)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0
    if stream:
        chunks = list(c.chat.completions.create(messages=messages, stream=True, **kwargs))
        streamed = [
            e
            for ch in chunks
            if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content or []
        ]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_in_the_legacy_shape(tiny: str) -> None:
    r = client(tiny).completions.create(model=TINY, prompt="abc", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == 6
    )  # (dummy bytes: token texts need not join to the text)
    assert lp.top_logprobs is not None and all(len(top) <= 2 for top in lp.top_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy: no alternative beats the chosen token (keys are texts: dummy ids that decode alike merge).
        assert 0 >= value >= max(top.values()) - 1e-6 and token in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gets_one_choice_each_in_order(tiny: str, stream: bool) -> None:
    c = client(tiny)
    prompts = ["a", "bb", "ccc", "dddd"]
    kwargs: dict[str, Any] = {"model": TINY, "max_tokens": 5, "temperature": 0.8, "seed": 9}
    alone = [c.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    if stream:
        texts = [""] * len(prompts)
        finish: list[str | None] = [None] * len(prompts)
        chunks = list(
            c.completions.create(
                prompt=prompts, stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        for ch in chunks:
            for choice in ch.choices:
                texts[choice.index] += choice.text
                finish[choice.index] = choice.finish_reason or finish[choice.index]
        used = chunks[-1].usage
        assert finish == ["length"] * 4
    else:
        r = c.completions.create(prompt=prompts, **kwargs)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
        texts, used = [ch.text for ch in r.choices], r.usage
    assert texts == alone
    assert used is not None and used.prompt_tokens == 1 + 2 + 3 + 4 and used.completion_tokens == 20
    assert_idle(tiny)


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_share_the_prompt_and_are_reproducible_as_a_set(tiny: str, chat: bool) -> None:
    c = client(tiny)
    kwargs: dict[str, Any] = {"model": TINY, "max_tokens": 12, "temperature": 1.0, "seed": 21, "n": 3}
    messages: Any = [{"role": "user", "content": "tell me something"}]

    def texts() -> tuple[list[str], Any]:
        if chat:
            r: Any = c.chat.completions.create(messages=messages, **kwargs)
            return [ch.message.content for ch in r.choices], r
        r = c.completions.create(prompt="tell me something", **kwargs)
        return [ch.text for ch in r.choices], r

    first, r = texts()
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(first)) == 3
    assert texts()[0] == first
    one = c.completions.create(model=TINY, prompt="tell me something", max_tokens=1) if not chat else None
    if one is not None:
        assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once, not n times
    assert 3 <= r.usage.completion_tokens <= 36
    assert_idle(tiny)


def test_n_streams_by_index_and_holds_one_copy_of_the_prompt_blocks(tiny: str) -> None:
    prompt = "x" * 400  # 25 full blocks of 16 byte tokens
    body = {"model": TINY, "prompt": prompt, "max_tokens": 160, "n": 4, "stream": True, "temperature": 1.0}
    peaks: list[float] = []
    done = threading.Event()

    def watch() -> None:  # /metrics read while the four choices run
        while not done.is_set():
            peaks.append(value(tiny, "tailserve_kv_blocks_used"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    texts = [""] * 4
    try:
        with httpx.stream("POST", f"{tiny}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    texts[choice["index"]] += choice["text"]
    finally:
        done.set()
        watcher.join()
    prompt_blocks = 400 // 16 + 1
    # One copy of the prompt plus each choice's tail and output blocks; four copies would be > 100.
    assert 0 < max(peaks) <= prompt_blocks + 4 * (160 // 16 + 2) < 4 * prompt_blocks
    assert len(set(texts)) == 4
    assert_idle(tiny)


def test_tokenize_and_detokenize_as_vllm(tiny: str) -> None:
    r = httpx.post(f"{tiny}/tokenize", json={"model": TINY, "prompt": "hi!"}).json()
    assert r["tokens"] == [ord(ch) + 3 for ch in "hi!"] and r["count"] == 3 and r["max_model_len"] > 0
    chat = httpx.post(
        f"{tiny}/tokenize", json={"model": TINY, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 200 and chat.json()["count"] >= 2
    back = httpx.post(f"{tiny}/detokenize", json={"model": TINY, "tokens": r["tokens"]}).json()
    assert back == {"prompt": "hi!"}
    assert httpx.post(f"{tiny}/detokenize", json={"model": "nope", "tokens": [5]}).status_code == 404


def test_logit_bias_forces_a_token(tiny: str) -> None:
    r = client(tiny).completions.create(
        model=TINY, prompt="hello", max_tokens=5, temperature=0, logit_bias={str(X_ID): 100}
    )
    assert r.choices[0].text == "xxxxx"


def test_continuous_usage_stats_put_usage_on_every_chunk(tiny: str) -> None:
    body = {
        "model": TINY,
        "prompt": "abc",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{tiny}/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_stream_without_usage_puts_timings_on_the_finish_chunk(tiny: str) -> None:
    with httpx.stream(
        "POST", f"{tiny}/v1/completions", json={"model": TINY, "prompt": "a", "max_tokens": 3, "stream": True}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "usage" not in events[-1]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["tailserve_timings"]["output_tokens"] == 3
    assert all("tailserve_timings" not in e for e in events[:-1])


def test_twenty_concurrent_async_streams_then_pool_is_free(tiny: str) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.completions.create(
            model=TINY,
            prompt=f"request {i} " * (i + 1),
            max_tokens=16 + i,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def main() -> list[tuple[str, int]]:
        c = openai.AsyncOpenAI(base_url=f"{tiny}/v1", api_key="unused", max_retries=0)
        non_stream = await c.completions.create(
            model=TINY, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert non_stream.usage is not None and non_stream.usage.completion_tokens == 2
        return await asyncio.gather(*(one(c, i) for i in range(20)))

    results = asyncio.run(main())
    assert [usage for _, usage in results] == [16 + i for i in range(20)]
    assert_idle(tiny)


def _raw_stream(base: str, body: dict[str, Any]) -> socket.socket:
    url = urlparse(base)
    sock = socket.create_connection((url.hostname, url.port))
    payload = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    return sock


def test_client_disconnect_mid_stream_frees_everything(tiny: str) -> None:
    aborted = value(tiny, "tailserve_requests_finished_total", finish_reason="abort")
    sock = _raw_stream(
        tiny, {"model": TINY, "prompt": "go", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    )
    got = b""
    while got.count(b"data: ") < 5:
        got += sock.recv(65536)
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    assert value(tiny, "tailserve_kv_blocks_used") > 0 or value(tiny, "tailserve_requests_running") > 0
    sock.close()
    assert_idle(tiny)
    assert value(tiny, "tailserve_requests_finished_total", finish_reason="abort") == aborted + 1


def test_bad_inputs_get_status_and_error_body_and_change_nothing(tiny: str) -> None:
    before = value(tiny, "tailserve_prompt_tokens_count")
    check_bad_inputs(tiny, tiny)
    good = len([e for e in BAD_INPUTS if e.body_read])  # each followed by one good request
    assert value(tiny, "tailserve_prompt_tokens_count") == before + good  # only the good ones ran
    assert value(tiny, "tailserve_request_errors_total", status="400") >= 20
    assert value(tiny, "tailserve_request_errors_total", status="415") >= 2
    assert_idle(tiny)


def test_oversized_headers_get_431_json_not_a_reset(tiny: str) -> None:
    r = httpx.post(
        f"{tiny}/v1/completions",
        json={"model": TINY, "prompt": "a", "max_tokens": 1},
        headers={"x-padding": "p" * 200_000},
    )
    assert r.status_code == 431 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{tiny}/health").status_code == 200


def test_routing_errors_are_openai_json_with_allow(tiny: str) -> None:
    r = httpx.get(f"{tiny}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"]
    assert httpx.get(f"{tiny}/v1/nothing").json()["error"]["code"] == "not_found"


def test_metrics_parse_and_histograms_move(tiny: str) -> None:
    names = {f.name for f in text_string_to_metric_families(httpx.get(f"{tiny}/metrics").text)}
    for name in (
        "tailserve_time_to_first_token_seconds",
        "tailserve_inter_token_latency_seconds",
        "tailserve_time_per_output_token_seconds",
        "tailserve_e2e_request_latency_seconds",
        "tailserve_queue_time_seconds",
        "tailserve_prompt_tokens",
        "tailserve_generation_tokens",
        "tailserve_requests_running",
        "tailserve_requests_waiting",
        "tailserve_kv_cache_usage_ratio",
        "tailserve_kv_blocks_capacity",
        "tailserve_kv_blocks_used",
        "tailserve_prefix_cache_hit_rate",
        "tailserve_prefix_cache_queries",
        "tailserve_prefix_cache_hits",
        "tailserve_prefix_cache_collisions",
        "tailserve_requests_finished",
        "tailserve_preemptions",
        "tailserve_requests_rejected",
        "tailserve_request_errors",
        "tailserve_ready",
    ):
        assert name in names, name
    hists = ("tailserve_time_to_first_token_seconds", "tailserve_e2e_request_latency_seconds")
    counts = {h: value(tiny, f"{h}_count") for h in (*hists, "tailserve_inter_token_latency_seconds")}
    itl = counts["tailserve_inter_token_latency_seconds"]
    client(tiny).completions.create(model=TINY, prompt="m", max_tokens=6, extra_body={"ignore_eos": True})
    for h in hists:
        assert value(tiny, f"{h}_count") == counts[h] + 1
    assert value(tiny, "tailserve_inter_token_latency_seconds_count") == itl + 5
    assert value(tiny, "tailserve_ready") == 1
    assert value(tiny, "tailserve_e2e_request_latency_seconds_bucket", le="120.0") >= 1


def _cached_tokens(base: str, text: str, chat: bool = False, api_key: str = "unused", **body: Any) -> int:
    """usage.prompt_tokens_details.cached_tokens of a one-token request for `text`."""
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)
    r: Any
    if chat:
        messages = [{"role": "user", "content": text}]
        r = c.chat.completions.create(model=TINY, messages=messages, max_tokens=1, extra_body=body)
    else:
        r = c.completions.create(model=TINY, prompt=text, max_tokens=1, extra_body=body)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


@pytest.mark.parametrize("chat", [False, True])
def test_cache_salt_shares_cached_blocks_within_a_salt_only(tiny: str, chat: bool) -> None:
    text = f"{uuid.uuid4().hex}: a system prompt nobody has sent this server before today."
    assert _cached_tokens(tiny, text, chat, cache_salt="tenant-a") == 0
    hit = _cached_tokens(tiny, text, chat, cache_salt="tenant-a")
    assert hit >= 64  # its full blocks (16 tokens each), all but the last token
    assert _cached_tokens(tiny, text, chat, cache_salt="tenant-b") == 0
    assert _cached_tokens(tiny, text, chat) == 0  # no salt: not the salted requests' blocks either
    assert _cached_tokens(tiny, text, chat, cache_salt="tenant-b") == hit
    assert _cached_tokens(tiny, text, chat) == hit
    assert value(tiny, "tailserve_prefix_cache_collisions_total") == 0
    assert_idle(tiny)


def test_cache_salt_from_api_key_keeps_keys_apart(tmp_path: Path) -> None:
    classes = tmp_path / "slo_classes.json"
    classes.write_text(json.dumps({"api_keys": {"key-2": "interactive"}}))  # a second key
    args = ["--model", "dummy:tiny", "--api-key", "key-1", "--slo-classes", str(classes)]
    with serve_process(
        [*args, "--cache-salt-from-api-key", "--slo-ttft", "60", "--slo-tpot", "60"]
    ) as server:
        text = "A system prompt that both keys send, long enough for several blocks."
        assert _cached_tokens(server.base, text, api_key="key-1") == 0
        hit = _cached_tokens(server.base, text, api_key="key-1")
        assert hit >= 48
        assert _cached_tokens(server.base, text, api_key="key-2") == 0
        assert _cached_tokens(server.base, text, api_key="key-2") == hit
        # A request's own salt divides its key's share of the cache; the same salt under another
        # key is still another key's.
        assert _cached_tokens(server.base, text, api_key="key-1", cache_salt="x") == 0
        assert _cached_tokens(server.base, text, api_key="key-2", cache_salt="x") == 0


def test_overload_with_tiny_queue_gives_429_and_accepted_requests_complete() -> None:
    args = ["--model", "dummy:tiny", "--max-waiting", "1", "--max-num-seqs", "2"]
    with serve_process(args) as server:
        base = server.base

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                body = {"model": TINY, "prompt": "load " * 20, "max_tokens": 48, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(24)))

        responses = asyncio.run(burst())
        rejected = [r for r in responses if r.status_code == 429]
        accepted = [r for r in responses if r.status_code == 200]
        assert len(rejected) + len(accepted) == 24
        assert rejected and accepted
        for r in rejected:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        for r in accepted:
            assert r.json()["usage"]["completion_tokens"] == 48
        assert sum(
            value(base, "tailserve_requests_rejected_total", reason=k) for k in ("queue_full", "slo")
        ) == len(rejected)
        assert_idle(base)


def test_sigterm_finishes_the_stream_refuses_new_requests_and_exits_zero() -> None:
    with serve_process(["--model", "dummy:tiny", "--drain-timeout", "60"]) as server:
        base, proc = server.base, server.proc
        lines: list[str] = []
        first = threading.Event()

        def read_stream() -> None:
            body = {"model": TINY, "prompt": "drain", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        statuses = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and 503 not in statuses:
            r = httpx.post(f"{base}/v1/completions", json={"model": TINY, "prompt": "late", "max_tokens": 2})
            statuses.append(r.status_code)
        assert statuses[-1] == 503, statuses
        assert httpx.get(f"{base}/ready").status_code == 503
        reader.join(60)
        assert proc.wait(timeout=60) == 0
        assert lines[-1] == "data: [DONE]"
        final = json.loads(lines[-2][6:])
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["tailserve_timings"]["output_tokens"] == 400


@pytest.fixture(scope="module")
def smol() -> Iterator[str]:
    with serve_process(["--model", "default"], ready_timeout_s=240) as server:
        yield server.base


def test_default_model_answers_correctly(smol: str) -> None:
    c = client(smol)
    (model,) = [m.id for m in c.models.list()]
    assert model == "SmolLM2-135M-Instruct"
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in (chat.choices[0].message.content or "")
    stream = c.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 8"], stream=True
    )
    text, chunks = _stream_text(stream, chat=False)
    assert text.startswith(" 5, 6, 7,") and "8" not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


def readme_request() -> tuple[str, dict[str, Any]]:
    """The path and JSON body of the README's curl example, exactly as a new user would paste it."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"curl -s 127\.0\.0\.1:8000(\S+).*?-d '(\{.*?\})'", text, re.DOTALL)
    assert match, "README.md has no curl example"
    return match.group(1), json.loads(match.group(2))


def test_readme_request_answers_with_bounded_tokens(smol: str) -> None:
    path, body = readme_request()
    assert body.get("max_tokens"), "the README example must bound its answer"
    r = httpx.post(f"{smol}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert 0 < usage["completion_tokens"] <= body["max_tokens"]
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_request_without_max_tokens_stops_at_the_server_cap() -> None:
    with serve_process(["--model", "dummy:tiny", "--max-tokens-default", "7"]) as server:
        c = client(server.base)
        (card,) = httpx.get(f"{server.base}/v1/models").json()["data"]
        assert card["max_tokens_default"] == 7
        chat = c.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "Talk"}], extra_body={"ignore_eos": True}
        )
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 7
        text = c.completions.create(model=TINY, prompt="Talk", extra_body={"ignore_eos": True})
        assert text.usage is not None and text.usage.completion_tokens == 7  # under OpenAI's 16


def test_prompts_of_any_length_create_no_kernel_once_the_server_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server creates its prompt-row kernels before /ready (docs/ENGINE.md "Prompt-row kernels"),
    so requests of many prompt lengths afterwards compile nothing mid-step and take no new memory.
    oneDNN's creation log (ONEDNN_VERBOSE) counts the kernels it created."""
    created = "create:cache_miss,cpu,inner_product"
    monkeypatch.setenv("ONEDNN_VERBOSE", "profile_create")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    with serve_process(["--model", "dummy:tiny", "--max-num-batched-tokens", "96"]) as server:
        at_ready = server.log().count(created)
        # Without bf16 arithmetic prompt rows run on a float32 copy (no oneDNN kernel at ready): it
        # must create none while serving either.
        if at_ready == 0 and cpu_kernels.native_bf16():
            pytest.skip("no prompt row runs through oneDNN here (no fused CPU kernels, or no oneDNN)")
        c = client(server.base)
        for n in (3, 17, 40, 77, 95, 130, 190):  # longer than the budget: chunks of other sizes too
            ids = [(7 * i) % 200 + 3 for i in range(n)]
            done = c.completions.create(model=TINY, prompt=ids, max_tokens=2, extra_body={"ignore_eos": True})
            assert done.usage is not None and done.usage.prompt_tokens == n
        assert server.log().count(created) == at_ready
