"""Structured outputs over HTTP on the real default model, with the official openai client:
response_format json_schema (the client's `parse`) and json_object, vLLM's structured_outputs
(regex, choice), streamed and not; bad specs are a 400 naming the field and leave nothing running."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine
from tailserve.server.config import ServerConfig
from tailserve.weights.loader import LoadedModel
from tests.server.harness import threaded_server

MODEL = "SmolLM2-135M-Instruct"


class Fruit(BaseModel):
    color: Literal["red", "green", "yellow"]
    count: int = Field(ge=1, le=9)
    name: str = Field(max_length=8)


@pytest.fixture(scope="module")
def base(smol: LoadedModel) -> Iterator[str]:
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=2048),
        cache=CacheConfig(kv_cache_memory_bytes=128 << 20),
        scheduler=SchedulerConfig(
            slo_ttft_s=60.0, slo_tpot_s=60.0
        ),  # a loaded machine must not get requests refused
    )
    with threaded_server(AsyncEngine(config, loaded=smol), ServerConfig()) as url:
        yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def engine_state(base: str) -> dict[str, float]:
    """Running, waiting, KV blocks held and prompt tokens run so far, from /metrics."""
    names = ("tailserve_requests_running", "tailserve_requests_waiting", "tailserve_kv_blocks_used")
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name in names or s.name == "tailserve_prompt_tokens_count":
                out[s.name] = float(s.value)
    return out


FRUIT_MESSAGES = [{"role": "user", "content": "Describe a fruit as JSON with a color, a count and a name."}]


def test_parse_returns_a_bounded_object_for_every_seed(base: str) -> None:
    async def one(c: openai.AsyncOpenAI, seed: int) -> Any:
        return await c.chat.completions.parse(
            model=MODEL,
            messages=FRUIT_MESSAGES,  # type: ignore[arg-type]
            response_format=Fruit,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )

    async def main() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, s) for s in range(20)))

    results = asyncio.run(main())
    parsed = [r.choices[0].message.parsed for r in results]
    assert all(isinstance(p, Fruit) for p in parsed), [r.choices[0].message.content for r in results]
    assert all(r.choices[0].finish_reason == "stop" for r in results)
    assert len({p.model_dump_json() for p in parsed}) > 1  # sampled at temperature 1, not one forced answer


def test_streamed_json_schema_equals_the_non_streamed_output(base: str) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "fruit", "schema": Fruit.model_json_schema(), "strict": True},
    }
    c = client(base)
    args: dict[str, Any] = dict(
        model=MODEL, messages=FRUIT_MESSAGES, response_format=schema, temperature=1.0, seed=7, max_tokens=60
    )
    whole = c.chat.completions.create(**args).choices[0].message.content or ""
    chunks = list(c.chat.completions.create(**args, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole
    Fruit.model_validate_json(streamed)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_output_parses(base: str) -> None:
    c = client(base)
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object with one key, name."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_regex_and_choice(base: str, stream: bool) -> None:
    c = client(base)
    texts = []
    for extra in ({"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, {"choice": ["alpha", "beta", "gamma"]}):
        if stream:
            chunks = c.completions.create(
                model=MODEL,
                prompt="Answer:",
                max_tokens=12,
                temperature=1.0,
                seed=1,
                stream=True,
                extra_body={"structured_outputs": extra},
            )
            texts.append("".join(ch.choices[0].text for ch in chunks if ch.choices))
        else:
            chat = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Answer."}],
                max_tokens=12,
                temperature=1.0,
                seed=1,
                extra_body={"structured_outputs": extra},
            )
            texts.append(chat.choices[0].message.content or "")
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", texts[0]), texts
    assert texts[1] in ("alpha", "beta", "gamma"), texts


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_specs_are_a_400_naming_the_field_and_change_nothing(
    base: str, extra: dict[str, Any], param: str
) -> None:
    before = engine_state(base)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    after = engine_state(base)
    assert after == before and after["tailserve_requests_running"] == after["tailserve_kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_choices_keeps_its_own_grammar_state(base: str, stream: bool) -> None:
    c = client(base)
    args: dict[str, Any] = dict(
        model=MODEL, prompt="Code:", max_tokens=12, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2}"}},
    )  # fmt: skip
    texts = ["", "", ""]
    if stream:
        for ch in c.completions.create(**args, stream=True):
            for choice in ch.choices:
                texts[choice.index] += choice.text
    else:
        texts = [ch.text for ch in sorted(c.completions.create(**args).choices, key=lambda ch: ch.index)]
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2}", t) for t in texts), texts
    assert len(set(texts)) > 1, texts
