"""The router in front of fake replicas: passthrough, retries, clean stream errors, 503, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.router.conftest import FAST, Fake, RouterFactory


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def _sse_payloads(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]


def _metric(router_url: str, name: str, **labels: str) -> float:
    """One sample's value from the router's /metrics (0 when absent)."""
    text = httpx.get(router_url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if sample == name and got == want:
            return float(value)
    return 0.0


def test_openai_client_non_streaming_and_streaming(fakes: list[Fake], make_router: RouterFactory) -> None:
    router = make_router([f.url for f in fakes])
    client = _client(router.url)
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=3)
    assert completion.choices[0].text.endswith("xxx")
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content is not None
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert pieces[0].startswith("[r") and pieces[1:] == ["x"] * 5
    assert [m.id for m in client.models.list().data] == ["fake"]
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/ready").json()["healthy_replicas"] == 3


def test_stream_is_relayed_before_the_replica_finishes(fakes: list[Fake], make_router: RouterFactory) -> None:
    release = threading.Event()
    for fake in fakes:
        fake.behavior.hold_after_first = release
    router = make_router([f.url for f in fakes])
    body = {"model": "fake", "prompt": "p", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        # The replica is still holding the rest: the first event got through unbuffered.
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"].startswith("[r")
        release.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("mode", ["error_500", "error_503", "error_429", "garbage"])
@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_output_is_retried_elsewhere(
    fakes: list[Fake], make_router: RouterFactory, mode: str, stream: bool
) -> None:
    bad = fakes[0]
    bad.behavior.mode = mode
    # Health checks only at start (with room for a loaded machine): a replica taken out stays out for
    # the test, and one in stays in. With checks every 0.2 s under a 0.5 s timeout, a loaded CI
    # machine once took the bad replica out before round robin reached it (served 0 times), and
    # its /ready is fine, so checks could also put a taken-out one back before the gauge is read.
    router = make_router(
        [f.url for f in fakes], policy="round_robin", health_interval_s=30.0, health_timeout_s=5.0
    )
    body = {"model": "fake", "prompt": "p", "max_tokens": 2, "stream": stream}
    for _ in range(3):  # round robin reaches the bad replica at least once
        response = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
        assert response.status_code == 200
        if stream:
            assert _sse_payloads(response)[-1] == "[DONE]"
            assert all("error" not in p for p in _sse_payloads(response))
        else:
            assert "[r" in response.json()["choices"][0]["text"]
        assert response.headers["x-tailserve-replica"] != str(fakes.index(bad))
    assert bad.behavior.served() >= 1
    assert _metric(router.url, "tailserve_router_retries_total") >= 1
    status = {"error_500": "500", "error_503": "503", "error_429": "429", "garbage": "garbage"}[mode]
    assert (
        _metric(router.url, "tailserve_router_requests_total", replica=str(fakes.index(bad)), status=status)
        >= 1
    )
    taken_out = mode in ("error_503", "garbage")
    assert _metric(router.url, "tailserve_router_replica_healthy", replica=str(fakes.index(bad))) == (
        0 if taken_out else 1
    )


def test_refused_connection_is_retried_and_replica_taken_out(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    router = make_router([f.url for f in fakes], policy="round_robin", health_interval_s=30.0)
    fakes[1].server.stop()
    for i in range(6):
        response = httpx.post(
            router.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1}, timeout=20
        )
        assert response.status_code == 200
    assert _metric(router.url, "tailserve_router_replica_healthy", replica="1") == 0
    assert _metric(router.url, "tailserve_router_requests_total", replica="1", status="connect_error") == 1


@pytest.mark.parametrize("mode", ["garbage_mid_stream", "die_mid_stream"])
def test_failure_after_output_ends_stream_cleanly_without_replay(
    fakes: list[Fake], make_router: RouterFactory, mode: str
) -> None:
    for fake in fakes:
        fake.behavior.mode = mode
    router = make_router([f.url for f in fakes])
    body = {"model": "fake", "prompt": "p", "max_tokens": 4, "stream": True}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=20)
    payloads = _sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["type"] == "server_error"
    assert all(json.loads(p).get("choices") for p in payloads[:-2])  # no garbage reached the client
    assert sum(f.behavior.served() for f in fakes) == 1  # never replayed


def test_every_replica_down_is_a_prompt_503(fakes: list[Fake], make_router: RouterFactory) -> None:
    for fake in fakes:
        fake.behavior.ready = False
    router = make_router([f.url for f in fakes])
    started = time.monotonic()
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "p"}, timeout=30)
    # Bound far below the 600 s upstream timeout: it answers at once instead of hanging.
    assert time.monotonic() - started < 5
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_replica"
    assert httpx.get(router.url + "/ready").status_code == 503
    assert sum(f.behavior.served() for f in fakes) == 0


def test_every_replica_dead_before_any_check_is_a_prompt_503(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    router = make_router([f.url for f in fakes], health_interval_s=60.0)  # no check will notice
    for fake in fakes:
        fake.server.stop()
    started = time.monotonic()
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "p"}, timeout=30)
    assert time.monotonic() - started < 5  # refused connections fail fast; nothing waits on a timeout
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "all_replicas_failed"
    assert httpx.get(router.url + "/ready").status_code == 503  # each refused connection took one out


def test_every_replica_failing_returns_the_last_error(fakes: list[Fake], make_router: RouterFactory) -> None:
    for fake in fakes:
        fake.behavior.mode = "error_429"
    router = make_router([f.url for f in fakes])
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "p"}, timeout=30)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert sum(f.behavior.served() for f in fakes) == 3  # max_attempts, each on another replica


def test_bad_json_is_rejected_by_the_router(fakes: list[Fake], make_router: RouterFactory) -> None:
    router = make_router([f.url for f in fakes])
    response = httpx.post(router.url + "/v1/completions", content=b"{nope", timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unready_replica_leaves_and_returns_within_check_interval(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    router = make_router([f.url for f in fakes], policy="round_robin")
    # Generous bound from the config: threshold checks plus a few intervals and the check timeout.
    bound_s = (FAST["unhealthy_threshold"] + 3) * FAST["health_interval_s"] + FAST["health_timeout_s"] + 2
    fakes[2].behavior.ready = False
    assert _wait_for(
        lambda: _metric(router.url, "tailserve_router_replica_healthy", replica="2") == 0, bound_s
    )
    served_before = fakes[2].behavior.served()
    for i in range(6):
        httpx.post(router.url + "/v1/completions", json={"prompt": f"p{i}"}, timeout=20).raise_for_status()
    assert fakes[2].behavior.served() == served_before
    fakes[2].behavior.ready = True
    assert _wait_for(
        lambda: _metric(router.url, "tailserve_router_replica_healthy", replica="2") == 1, bound_s
    )
    for i in range(6):
        httpx.post(router.url + "/v1/completions", json={"prompt": f"q{i}"}, timeout=20).raise_for_status()
    assert fakes[2].behavior.served() == served_before + 2


def test_least_load_follows_replica_metrics(fakes: list[Fake], make_router: RouterFactory) -> None:
    fakes[0].behavior.waiting, fakes[0].behavior.running = 10, 8
    fakes[1].behavior.running, fakes[1].behavior.kv_usage = 8, 0.9
    router = make_router([f.url for f in fakes], policy="least_load")
    for i in range(5):
        response = httpx.post(router.url + "/v1/completions", json={"prompt": f"p{i}"}, timeout=20)
        assert response.headers["x-tailserve-replica"] == "2"
    assert (
        _metric(router.url, "tailserve_router_decisions_total", policy="least_load", reason="least_load") == 5
    )


def test_hash_and_prefix_keep_affinity(fakes: list[Fake], make_router: RouterFactory) -> None:
    hashed = make_router([f.url for f in fakes], policy="hash")
    placed = {
        httpx.post(hashed.url + "/v1/completions", json={"prompt": f"p{i}", "user": "alice"}).headers[
            "x-tailserve-replica"
        ]
        for i in range(5)
    }
    by_header = {
        httpx.post(
            hashed.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Session-Id": "bob"}
        ).headers["x-tailserve-replica"]
        for _ in range(5)
    }
    assert len(placed) == 1 and len(by_header) == 1
    prefix = make_router([f.url for f in fakes], policy="prefix", prefix_block_chars=16)
    system = "You are a helpful assistant. " * 4
    urls = {
        httpx.post(
            prefix.url + "/v1/chat/completions",
            json={"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]},
        ).headers["x-tailserve-replica"]
        for i in range(6)
    }
    assert len(urls) == 1
    assert _metric(prefix.url, "tailserve_router_decisions_total", policy="prefix", reason="prefix_hit") == 5


def _wait_for(condition: object, timeout_s: float) -> bool:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def test_client_disconnect_mid_stream_releases_the_replica(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    release = threading.Event()  # never set while the client reads: the replica holds the stream
    for fake in fakes:
        fake.behavior.hold_after_first = release
    router = make_router([f.url for f in fakes])
    body = {"model": "fake", "prompt": "p", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=20) as response:
        replica = response.headers["x-tailserve-replica"]  # the metrics label is the same index
        lines = response.iter_lines()  # kept referenced: dropping it would close the response early
        assert next(lines).startswith("data: ")
        assert _metric(router.url, "tailserve_router_replica_in_flight", replica=replica) == 1
    # The client went away: the router closes its upstream stream and forgets the request.
    assert _wait_for(
        lambda: _metric(router.url, "tailserve_router_replica_in_flight", replica=replica) == 0, 10
    )
    release.set()


def test_responses_api_streams_are_relayed_to_their_last_event(
    fakes: list[Fake], make_router: RouterFactory
) -> None:
    """/v1/responses streams end with `response.completed`, not [DONE]: relayed whole, and the
    replica stays in rotation."""
    router = make_router([fakes[0].url], max_attempts=1)
    body = {"model": "fake", "input": "hello", "max_output_tokens": 3, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=20) as response:
            assert response.status_code == 200
            events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
        assert events[0] == "response.created" and events[-1] == "response.completed", events
        assert events.count("response.output_text.delta") == len("[r0]xxx")
    assert _metric(router.url, "tailserve_router_replica_healthy", replica="0") == 1
    assert _metric(router.url, "tailserve_router_requests_total", replica="0", status="200") == 2
    plain = httpx.post(router.url + "/v1/responses", json={**body, "stream": False}, timeout=20)
    assert plain.status_code == 200 and plain.json()["output_text"] == "[r0]xxx"
