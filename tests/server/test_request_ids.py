"""X-Request-Id as vLLM: the client's id names the request (the body's `id`) and comes back as a
header on every response, errors included; without one the server's own id does. And /version."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import tailserve
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with threaded_server(FakeEngine()) as url:
        yield url


def test_a_client_id_names_the_request_and_comes_back(base: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    completion = {"model": "fake-model", "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{base}/v1/completions", json=completion, headers={"X-Request-Id": "trace-43"})
    assert r.json()["id"] == "cmpl-trace-43"
    r = httpx.post(
        f"{base}/v1/responses", json={"model": "fake-model", "input": "Hi"}, headers={"X-Request-Id": "t44"}
    )
    assert r.headers["x-request-id"] == "t44" and r.json()["id"] == "resp_t44"


def test_without_one_the_servers_id_comes_back(base: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT)
    assert r.json()["id"] == f"chatcmpl-{r.headers['x-request-id']}"
    streamed = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True})
    assert f'"id":"chatcmpl-{streamed.headers["x-request-id"]}"' in streamed.text


def test_errors_and_probes_carry_it_too(base: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "n": 99}, headers={"X-Request-Id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    assert httpx.get(f"{base}/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"


def test_an_unusable_id_is_replaced_not_trusted(base: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "x" * 500})
    assert len(r.headers["x-request-id"]) == 32 and r.json()["id"] == f"chatcmpl-{r.headers['x-request-id']}"


def test_the_same_id_twice_at_once_is_served_twice(base: str) -> None:
    """A retry may reuse its id while the first attempt still runs: both are served (the engine's
    own ids stay unique), each answered under the client's id."""
    long = {**CHAT, "stream": True, "max_tokens": 200}
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST", f"{base}/v1/chat/completions", json=long, headers={"X-Request-Id": "dup"}
        ) as first,
    ):
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # the first is running
        second = client.post(f"{base}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "dup"})
        assert second.status_code == 200 and second.json()["id"] == "chatcmpl-dup"
        assert '"id":"chatcmpl-dup"' in "".join(lines)


def test_version(base: str) -> None:
    assert httpx.get(f"{base}/version").json() == {"version": tailserve.__version__}
