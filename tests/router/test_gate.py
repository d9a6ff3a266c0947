"""What a client meets at the router: the server's gate before any body byte is read, OpenAI JSON
for the router's own errors, no internal URLs, and a client that leaves aborts the replica's work.

The end-to-end tests run `tailserve route` and `tailserve serve --model dummy:tiny` as processes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import Fake, RouterFactory
from tests.server.bad_inputs import BAD_INPUTS, BODY_LIMIT, TINY, check_bad_inputs
from tests.server.harness import ServerProcess, free_port, running_process, serve_process, tailserve_command


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A dummy:tiny replica and a router in front of it, both with the same body limit."""
    with serve_process(
        ["--model", "dummy:tiny", "--max-body-bytes", BODY_LIMIT, "--slo-ttft", "60", "--slo-tpot", "60"]
    ) as replica:
        port = free_port()
        cmd = tailserve_command("route", "--replica", replica.base, "--port", str(port))
        cmd += ["--max-body-bytes", BODY_LIMIT, "--health-interval", "0.2", "--log-level", "warning"]
        with running_process(cmd, port, ready_timeout_s=60) as router:
            yield replica, router


def replica_metric(replica: ServerProcess, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{replica.base}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_bad_inputs_through_the_router(stack: tuple[ServerProcess, ServerProcess]) -> None:
    replica, router = stack
    check_bad_inputs(router.base, replica.base)
    assert len(BAD_INPUTS) >= 30


def test_router_errors_are_openai_json_and_models_retrieve_works(
    stack: tuple[ServerProcess, ServerProcess],
) -> None:
    _, router = stack
    r = httpx.get(f"{router.base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{router.base}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"]
    r = httpx.post(f"{router.base}/v1/completions", json={"model": TINY}, headers={"x-pad": "p" * 200_000})
    assert r.status_code == 431 and r.json()["error"]["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(TINY).id == TINY
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_non_streamed_client_disconnect_aborts_on_the_replica(
    stack: tuple[ServerProcess, ServerProcess],
) -> None:
    replica, router = stack
    aborted = replica_metric(replica, "tailserve_requests_finished_total", finish_reason="abort")
    body = {"model": TINY, "prompt": "go", "max_tokens": 1500, "ignore_eos": True}

    async def give_up_after_a_second() -> None:
        async with httpx.AsyncClient(base_url=router.base, timeout=1.0) as http:
            results = await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(5)), return_exceptions=True
            )
        assert all(isinstance(r, httpx.TimeoutException) for r in results), results

    asyncio.run(give_up_after_a_second())
    deadline = time.monotonic() + 30
    while replica_metric(replica, "tailserve_requests_finished_total", finish_reason="abort") < aborted + 5:
        assert time.monotonic() < deadline, "the replica kept generating for clients that left"
        time.sleep(0.1)
    assert replica_metric(replica, "tailserve_requests_running") == 0
    assert replica_metric(replica, "tailserve_kv_blocks_used") == 0
    # The router forgot them too: a count left up would skew placement away from this replica for good.
    assert router_in_flight(router) == 0


def router_in_flight(router: ServerProcess) -> float:
    """tailserve_router_replica_in_flight summed over replicas (whatever labels name them)."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{router.base}/metrics").text):
        for sample in family.samples:
            if sample.name == "tailserve_router_replica_in_flight":
                total += sample.value
    return total


def _raw_headers_only(url: str, head: str) -> bytes:
    """Send request headers, no body, and read what comes back (the body is never sent)."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=20) as sock:
        sock.sendall(head.encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_body_limit_and_key_are_checked_before_the_body(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    router = make_router([fakes[0].url], api_key="k3y", max_body_bytes=64 * 1024)
    declared = 256 * 2**20  # 256 MiB announced; not one body byte follows
    head = f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    assert _raw_headers_only(router.url, head).startswith(b"HTTP/1.1 413")  # before 401, before the body
    served = fakes[0].behavior.served()
    body = {"model": "fake", "prompt": "p", "max_tokens": 2}
    r = httpx.post(router.url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(router.url + "/router/replicas").status_code == 401
    assert fakes[0].behavior.served() == served  # refused by the router itself
    for scheme in ("Bearer", "bearer"):
        r = httpx.post(router.url + "/v1/completions", json=body, headers={"Authorization": f"{scheme} k3y"})
        assert r.status_code == 200, scheme
    r = httpx.post(
        router.url + "/v1/completions", content=json.dumps(body), headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415


def test_client_answers_never_name_a_replica_url(fakes: list[Fake], make_router: RouterFactory) -> None:
    router = make_router([fakes[0].url], max_attempts=1)
    body = {"model": "fake", "prompt": "p", "max_tokens": 2}
    ok = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
    assert ok.status_code == 200 and ok.headers["x-tailserve-replica"] == "0"
    fakes[0].behavior.mode = "garbage"  # fails before output: the router gives up with its own 503
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 503 and r.json()["error"]["code"] == "all_replicas_failed"
    for answer in (ok, r):
        assert "127.0.0.1" not in answer.text and all("127.0.0.1" not in v for v in answer.headers.values())
    rows = httpx.get(router.url + "/router/replicas").json()["replicas"]
    assert rows[0]["url"] == fakes[0].url and rows[0]["index"] == 0  # the operator's view keeps it


def test_unauthenticated_metrics_name_replicas_by_index(stack: tuple[ServerProcess, ServerProcess]) -> None:
    replica, router = stack
    assert httpx.post(
        f"{router.base}/v1/completions", json={"model": TINY, "prompt": "a", "max_tokens": 2}
    ).is_success
    text = httpx.get(f"{router.base}/metrics").text  # open, like the server's: no internal URL in it
    assert replica.base not in text and "127.0.0.1" not in text
    labels = {
        sample.labels["replica"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "replica" in sample.labels
    }
    assert labels == {"0"}  # the --replica position, as in the x-tailserve-replica header


def test_responses_api_through_the_router_with_the_openai_client(
    stack: tuple[ServerProcess, ServerProcess],
) -> None:
    replica, router = stack
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.responses.create(model=TINY, input="hello", max_output_tokens=4, temperature=0)
    events = list(
        client.responses.create(model=TINY, input="hello", max_output_tokens=4, temperature=0, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete", [
        e.type for e in events
    ]
    assert events[-1].response.output_text == plain.output_text  # greedy: the same text either way
    # The stream ended at its last event, not at a [DONE]: the replica is still in rotation.
    assert httpx.get(f"{router.base}/ready").json()["healthy_replicas"] == 1
    assert router_in_flight(router) == 0
    for path in ("/version", "/openapi.json"):  # what else the server serves, forwarded as it is
        assert httpx.get(f"{router.base}{path}").json() == httpx.get(f"{replica.base}{path}").json(), path
