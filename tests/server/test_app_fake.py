"""The HTTP layer against FakeEngine on a real loopback port: auth, limits, admission, readiness, disconnects.

These are the paths that are hard to provoke on purpose with a real model (a predicted SLO miss, a
slow warm-up, a disconnect while still queued); test_server.py covers the real engine end to end.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import logging
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailserve.config import SchedulerConfig
from tailserve.engine.tpot_model import TpotPrice
from tailserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server, wait_ready

GOOD = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def metric(base: str, name: str, labels: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{base}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (
                labels is None or all(sample.labels.get(k) == v for k, v in labels.items())
            ):
                return float(sample.value)
    raise KeyError(name)


def wait_until(check: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_api_key_required_on_v1_but_not_on_probes() -> None:
    with threaded_server(FakeEngine(), ServerConfig(api_key="s3cret")) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{base}/v1/completions", json=GOOD, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ok = httpx.post(f"{base}/v1/completions", json=GOOD, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert metric(base, "tailserve_request_errors_total", {"status": "401"}) == 4


def test_body_limit_by_header_and_by_bytes_received() -> None:
    engine = FakeEngine()
    with threaded_server(engine, ServerConfig(max_body_bytes=2048)) as base:
        big = json.dumps({**GOOD, "prompt": "x" * 5000})
        r = httpx.post(f"{base}/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks() -> object:
            yield big[:1000].encode()
            yield big[1000:].encode()

        r = httpx.post(f"{base}/v1/completions", content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413
        assert engine.generate_calls == 1  # only the warm-up
        assert httpx.post(f"{base}/v1/completions", json=GOOD).status_code == 200


def test_not_ready_until_warm_up_finishes() -> None:
    engine = FakeEngine()
    engine.gate.clear()  # the warm-up request waits here, however slowly this test's requests go
    with threaded_server(engine, ready=False) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.get(f"{base}/ready")
        assert r.status_code == 503
        r = httpx.post(f"{base}/v1/completions", json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert metric(base, "tailserve_ready") == 0
        engine.gate.set()
        wait_ready(base, 10)
        assert httpx.post(f"{base}/v1/completions", json=GOOD).status_code == 200
        assert metric(base, "tailserve_ready") == 1
        assert metric(base, "tailserve_requests_rejected_total", {"reason": "not_ready"}) == 1
        # the warm-up request is not in the latency histograms
        assert metric(base, "tailserve_e2e_request_latency_seconds_count") == 1


def test_a_full_collection_no_longer_walks_what_start_up_made_once_ready() -> None:
    """A full garbage collection walks every tracked object while every other thread waits for the
    GIL (60-70 ms for the default model's start-up heap): once ready, the server has moved what
    start-up made out of its reach, so a collection while serving walks only what serving made."""
    gc.unfreeze()
    made_at_start_up = [[i] for i in range(1000)]
    try:
        with threaded_server(FakeEngine()) as base:
            assert httpx.get(f"{base}/ready").status_code == 200
            walked = {id(o) for o in gc.get_objects()}
            assert not any(id(o) in walked for o in made_at_start_up)
            assert httpx.post(f"{base}/v1/completions", json=GOOD).status_code == 200
    finally:
        gc.unfreeze()


def test_predicted_slo_miss_is_429_with_retry_after() -> None:
    engine = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=2.0))
    with threaded_server(engine) as base:
        engine.wait_estimate_s = 5.5
        r = httpx.post(f"{base}/v1/completions", json=GOOD)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "4"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "slo"
        assert engine.generate_calls == 1
        assert metric(base, "tailserve_requests_rejected_total", {"reason": "slo"}) == 1
        engine.wait_estimate_s = 0.1
        assert httpx.post(f"{base}/v1/completions", json=GOOD).status_code == 200


def test_each_response_reports_the_tpot_admission_priced_for_it() -> None:
    """`admission_tpot_estimate_s`: the request's own TPOT by the price admission decided on (0
    where nothing priced it), for both the streamed and the non-streamed response; a refusal by
    that price says what it predicted."""
    engine = FakeEngine(scheduler=SchedulerConfig(slo_tpot_s=0.03))
    with threaded_server(engine) as base:
        r = httpx.post(f"{base}/v1/completions", json=GOOD)
        assert r.json()["tailserve_timings"]["admission_tpot_estimate_s"] == 0.0
        engine.tpot_price = TpotPrice(0.021, 0.012, 0.03, (), first_end_s=1.0)
        r = httpx.post(f"{base}/v1/completions", json=GOOD)
        assert r.json()["tailserve_timings"]["admission_tpot_estimate_s"] == pytest.approx(0.021)
        body = {**GOOD, "stream": True, "stream_options": {"include_usage": True}}
        chunks = [json.loads(line[6:]) for line in httpx.post(f"{base}/v1/completions", json=body).text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert chunks[-1]["tailserve_timings"]["admission_tpot_estimate_s"] == pytest.approx(0.021)
        engine.tpot_price = TpotPrice(0.034, 0.012, 0.03, (), first_end_s=1.0)  # its own would miss
        r = httpx.post(f"{base}/v1/completions", json=GOOD)
        assert r.status_code == 429 and r.json()["error"]["code"] == "slo_tpot"
        assert "predicted TPOT 34.0 ms over its target of 30.0 ms" in r.json()["error"]["message"]


def test_queue_bound_rejects_bursts_and_admitted_requests_complete() -> None:
    engine = FakeEngine(max_running=1, step_s=0.01, scheduler=SchedulerConfig(max_waiting=2, max_num_seqs=1))

    async def burst(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {**GOOD, "max_tokens": 10}
            return await asyncio.gather(
                *(client.post(f"{base}/v1/completions", json=body) for _ in range(12))
            )

    with threaded_server(engine) as base:
        responses = asyncio.run(burst(base))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        assert codes.count(200) >= 2  # the queue's 2 (a request waits until the engine starts it)
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        assert metric(base, "tailserve_requests_rejected_total", {"reason": "queue_full"}) == codes.count(429)


def _open_stream(base: str, body: dict[str, object]) -> socket.socket:
    """A raw HTTP/1.1 streaming request, so the test controls exactly when the connection drops."""
    url = urlparse(base)
    sock = socket.create_connection((url.hostname, url.port))
    payload = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    return sock


def test_disconnect_mid_stream_aborts_and_frees_blocks() -> None:
    engine = FakeEngine(step_s=0.01)
    with threaded_server(engine) as base:
        sock = _open_stream(base, {**GOOD, "max_tokens": 400, "stream": True})
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
        assert engine.blocks_used > 0
        sock.close()
        assert wait_until(lambda: not engine.running and engine.blocks_used == 0)
        (request_id,) = [r for r in engine.finished_reasons if not r.startswith("warmup-")]
        assert engine.finished_reasons[request_id] in ("abort", "closed")
        assert wait_until(
            lambda: metric(base, "tailserve_requests_finished_total", {"finish_reason": "abort"}) == 1
        )
        assert httpx.post(f"{base}/v1/completions", json=GOOD).status_code == 200


def test_disconnect_while_queued_or_non_streamed_aborts() -> None:
    engine = FakeEngine(max_running=1, step_s=0.01)
    with threaded_server(engine) as base:
        hog = _open_stream(base, {**GOOD, "max_tokens": 400, "stream": True})
        assert wait_until(lambda: len(engine.running) == 1)
        queued = _open_stream(base, {**GOOD, "max_tokens": 400, "stream": True})
        assert wait_until(lambda: len(engine.waiting) == 1)
        queued.close()
        assert wait_until(lambda: not engine.waiting)
        hog.close()
        assert wait_until(lambda: not engine.running and engine.blocks_used == 0)
        plain = _open_stream(base, {**GOOD, "max_tokens": 400})
        assert wait_until(lambda: len(engine.running) == 1)
        plain.close()
        assert wait_until(lambda: not engine.running and engine.blocks_used == 0)
        assert metric(base, "tailserve_request_errors_total", {"status": "499"}) >= 2


def test_two_apps_in_one_process_keep_separate_metrics() -> None:
    with threaded_server(FakeEngine()) as a, threaded_server(FakeEngine(model_name="other")) as b:
        assert httpx.post(f"{a}/v1/completions", json=GOOD).status_code == 200
        assert metric(a, "tailserve_e2e_request_latency_seconds_count") == 1
        assert metric(b, "tailserve_e2e_request_latency_seconds_count") == 0
        assert httpx.get(f"{b}/v1/models").json()["data"][0]["id"] == "other"
        r = httpx.post(f"{b}/v1/completions", json=GOOD)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_unknown_routes_and_methods_get_openai_errors() -> None:
    with threaded_server(FakeEngine()) as base:
        r = httpx.get(f"{base}/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = httpx.get(f"{base}/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert httpx.get(f"{base}/v1/models/fake-model").json()["id"] == "fake-model"
        assert httpx.get(f"{base}/v1/models/nope").status_code == 404


def test_burst_gets_429_exactly_where_the_predicted_wait_passes_the_target() -> None:
    """FakeEngine predicts `requests queued ahead x step_s`. With the engine stalled, a burst of 12
    must admit exactly the requests whose prediction is within the 2 s target: 0.5 s x k <= 2 for
    k = 0..4 ahead, so 5 in and 7 refused, however the burst interleaves."""
    engine = FakeEngine(step_s=0.5, max_running=8, scheduler=SchedulerConfig(slo_ttft_s=2.0))

    async def burst(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.ensure_future(client.post(f"{base}/v1/completions", json={**GOOD, "max_tokens": 1}))
                for _ in range(12)
            ]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 7 or len(engine.waiting) < 5:
                assert time.monotonic() < deadline, (sum(t.done() for t in tasks), len(engine.waiting))
                await asyncio.sleep(0.02)
            engine.gate.set()  # the engine moves again: the admitted ones finish
            return await asyncio.gather(*tasks)

    with threaded_server(engine) as base:
        engine.gate.clear()
        responses = asyncio.run(burst(base))
        codes = [r.status_code for r in responses]
        assert codes.count(200) == 5 and codes.count(429) == 7, codes
        for r in responses:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "slo"
                assert int(r.headers["retry-after"]) >= 1
        # Each admitted response reports the TTFT admission predicted for it: 0.5 s per request ahead.
        estimates = sorted(
            r.json()["tailserve_timings"]["admission_estimate_s"] for r in responses if r.status_code == 200
        )
        assert estimates == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
        assert metric(base, "tailserve_requests_rejected_total", {"reason": "slo"}) == 7


def test_unexpected_error_is_a_counted_500_logged_once_and_the_connection_survives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    with threaded_server(engine) as base:
        engine.explode_on = "boom"
        url = urlparse(base)
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                conn.request("POST", "/v1/completions", body=json.dumps({**GOOD, "prompt": "boom"}))
                sock = conn.sock
                r = conn.getresponse()
                body = json.loads(r.read())
                assert r.status == 500 and body["error"]["type"] == "server_error"
                assert "scripted bug" not in json.dumps(body)  # no internals to the client
                conn.request("POST", "/v1/completions", body=json.dumps(GOOD))
                ok = conn.getresponse()
                assert ok.status == 200
                ok.read()
                assert conn.sock is sock, "the keep-alive connection was dropped after the 500"
        conn.close()
        tracebacks = [
            rec for rec in caplog.records if rec.exc_info and "scripted bug" in str(rec.exc_info[1])
        ]
        assert len(tracebacks) == 3  # once per error
        assert metric(base, "tailserve_request_errors_total", {"status": "500"}) == 3


def test_oversized_unauthenticated_body_is_413_and_bearer_is_case_insensitive() -> None:
    with threaded_server(FakeEngine(), ServerConfig(api_key="k3y", max_body_bytes=2048)) as base:
        big = json.dumps({**GOOD, "prompt": "x" * 5000})
        r = httpx.post(f"{base}/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(f"{base}/v1/completions", json=GOOD, headers={"Authorization": f"{scheme} k3y"})
            assert r.status_code == 200, scheme
        assert (
            httpx.post(
                f"{base}/v1/completions", json=GOOD, headers={"Authorization": "bearer no"}
            ).status_code
            == 401
        )


def test_content_types_other_than_json_get_415() -> None:
    engine = FakeEngine()
    with threaded_server(engine) as base:
        body = json.dumps(GOOD)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
            r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": content_type})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert engine.generate_calls == 1  # only the warm-up ran
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": content_type})
            assert r.status_code == 200, content_type
        # No Content-Type at all is still read as JSON (curl -d without -H, many scripts).
        url = urlparse(base)
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
        conn.request("POST", "/v1/completions", body=body)
        assert conn.getresponse().status == 200
        conn.close()
