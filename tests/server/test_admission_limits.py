"""What a client reads when one request asks for more generations (prompts x n) than the queue
holds: a 400 when it can never fit, a 429 that says so when it cannot fit now, never a claim that
others are waiting when they are not. The server stack around FakeEngine (small, known limits).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tailserve.config import SchedulerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server

LIMITS = SchedulerConfig(max_waiting=4, max_num_seqs=2)  # one request may ask for 4 generations


def post(base: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions", json={"model": "fake-model", "max_tokens": 2, **body}, timeout=30
    )


def test_a_request_that_can_never_fit_is_a_400_naming_the_limits() -> None:
    engine = FakeEngine(scheduler=LIMITS)
    with threaded_server(engine) as base:
        r = post(base, {"prompt": ["a", "b", "c", "d"], "n": 2})  # 8 generations > 4
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "n" and error["type"] == "invalid_request_error"
        for fact in ("8 generations", "4 prompts x 2", "--max-waiting 4"):
            assert fact in error["message"], error["message"]
        assert "already waiting" not in error["message"]
        r = post(base, {"prompt": ["p"] * 5})  # 5 prompts of one choice: the prompt list is the problem
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert post(base, {"prompt": ["a", "b"], "n": 2}).status_code == 200  # 4 fit on an idle server
        assert engine.stats().num_waiting == 0 and not engine.running


def test_a_request_that_cannot_fit_beside_others_says_so() -> None:
    engine = FakeEngine(scheduler=LIMITS)
    with threaded_server(engine) as base:
        engine.gate.clear()  # a stalled engine: whatever is admitted stays queued

        async def three_waiting_and_one_big() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                body = {"model": "fake-model", "max_tokens": 2}
                small = [
                    asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": "s"}))
                    for _ in range(3)
                ]
                deadline = time.monotonic() + 10
                while engine.stats().num_waiting < 3:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                big = await client.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2})
                engine.gate.set()
                return list(await asyncio.gather(*small)), big

        small, big = asyncio.run(three_waiting_and_one_big())
        assert all(r.status_code == 200 for r in small)
        assert big.status_code == 429, big.text
        error = big.json()["error"]
        assert error["code"] == "queue_full" and int(big.headers["retry-after"]) >= 1
        assert "4 generations" in error["message"] and "limit of 4" in error["message"], error["message"]
