"""The worker routes SGLang's model gateway calls (sglang-router 0.3.2): the fields it reads to
register a worker and weigh its load, the cache flush it broadcasts (refused while requests run,
unless forced), and, when the gateway is installed, the official openai client through the real
gateway binary in front of two tailserve replicas; a replica's 429 is retried on the other one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine
from tailserve.server.config import ServerConfig
from tailserve.weights.loader import LoadedModel
from tests.server.fake_engine import FakeEngine
from tests.server.harness import REPO, serve_process, threaded_server

READY_TIMEOUT_S = 120.0  # start-up deadlines, not performance bounds


def test_registration_routes_carry_what_the_gateway_reads() -> None:
    engine = FakeEngine(scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    with threaded_server(engine) as base, httpx.Client(base_url=base, timeout=30) as http:
        info = http.get("/server_info").json()
        assert http.get("/get_server_info").json() == info  # the legacy name the gateway falls back to
        assert info["served_model_name"] == "fake-model" and isinstance(info["model_path"], str)
        assert info["dp_size"] == 1 and isinstance(info["version"], str)
        assert info["max_total_tokens"] == engine.kv_blocks_total * engine.config.cache.block_size
        assert info["max_prefill_tokens"] == 128 and info["max_running_requests"] == 8
        model = http.get("/model_info").json()
        assert http.get("/get_model_info").json() == model
        assert model["is_generation"] is True and isinstance(model["model_path"], str)


def test_get_load_is_the_per_rank_array_with_kv_tokens() -> None:
    """0.3.2 reads an array (one entry per data-parallel rank) and sums `num_tokens`."""
    engine = FakeEngine()
    with threaded_server(engine) as base:
        engine.running, engine.waiting, engine.blocks_used = {"a", "b"}, {"c"}, 5
        load = httpx.get(f"{base}/get_load", timeout=30).json()
    block_size = engine.config.cache.block_size
    assert load == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 5 * block_size}]


def test_flush_cache_empties_the_prefix_cache_and_is_refused_while_requests_run(smol: LoadedModel) -> None:
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=1024),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
    )
    engine = AsyncEngine(config, loaded=smol)
    pool = engine.engine.scheduler.kv.pool
    body = {"model": engine.model_name, "prompt": list(range(5, 69)), "max_tokens": 2}
    try:
        with threaded_server(engine, ServerConfig()) as base, httpx.Client(base_url=base, timeout=60) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            assert len(pool.cached_keys()) >= 3  # the prompt's full blocks
            assert http.post("/flush_cache").json() == {"flushed": True}
            assert pool.cached_keys() == []

            # A long stream keeps a request running: a plain flush is refused, a forced one is not.
            long = {**body, "max_tokens": 600, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=long) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
                assert next(lines).startswith("data: ")  # its first token: it holds blocks now
                refused = http.post("/flush_cache")
                assert refused.status_code == 409
                assert refused.json()["error"]["code"] == "requests_in_flight"
                assert http.post("/flush_cache", params={"force": "true"}).json() == {"flushed": True}
                assert pool.cached_keys() == []
    finally:
        engine.close()


# ----- the real gateway --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Gateway:
    base: str
    workers: list[str]


@contextmanager
def sglang_gateway(workers: list[str], log_path: Path, policy: str = "cache_aware") -> Iterator[Gateway]:
    """`sglang-router launch` (the package's own binary) on loopback, ready, then stopped."""
    pytest.importorskip(
        "sglang_router", reason="sglang-router not installed (pip install sglang-router==0.3.2)"
    )
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_router", "launch", "--worker-urls", *workers]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--log-level", "warn"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
    base = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                try:
                    ready = httpx.get(f"{base}/readiness", timeout=5)
                    if ready.status_code == 200 and ready.json().get("healthy_workers") == len(workers):
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.2)
            yield Gateway(base, workers)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Two `tailserve serve --model dummy:tiny` replicas behind SGLang's gateway (cache_aware)."""
    pytest.importorskip(
        "sglang_router", reason="sglang-router not installed (pip install sglang-router==0.3.2)"
    )
    log = tmp_path_factory.mktemp("sglang") / "gateway.log"
    args = ["--model", "dummy:tiny", "--no-kernel-warmup"]
    with serve_process(args) as a, serve_process(args) as b, sglang_gateway([a.base, b.base], log) as gw:
        yield gw


def test_the_gateway_registers_both_replicas_by_their_model_and_load(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.base, timeout=30) as http:
        workers = http.get("/workers").json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(gateway.workers)
        assert {w["model_id"] for w in workers} == {"dummy-tiny"}  # from /server_info's served_model_name
        loads = http.get("/get_loads").json()["workers"]
        assert sorted(entry["worker"] for entry in loads) == sorted(gateway.workers)
        assert all(entry["load"] >= 0 for entry in loads)  # -1: the gateway could not read /get_load
        flushed = http.post("/flush_cache").json()
        assert flushed["status"] == "success" and flushed["workers_flushed"] == 2


def test_openai_client_through_the_gateway(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="dummy-tiny", prompt="Hello there", max_tokens=5, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model="dummy-tiny",
            prompt="Hello there",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="dummy-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    streamed = client.chat.completions.create(
        model="dummy-tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:  # a replica's 400 comes back as it was
        client.completions.create(model="dummy-tiny", prompt="x", max_tokens=2, extra_body={"top_k": -5})
    assert bad.value.body is not None and "top_k" in str(bad.value.body)


def test_the_gateway_retries_a_replica_429_on_the_other(tmp_path: Path) -> None:
    """One replica refuses everything (admission predicts a 5 s wait behind a 2 s target). Under
    round_robin the gateway retries a 429 on the next replica, so every request succeeds there; the
    refusing one counted each refusal (docs/ROUTER.md: what this does to admission)."""
    refuse = ["--wait-estimate-s", "5"]
    with (
        serve_process(refuse, fake=True) as busy,
        serve_process([], fake=True) as idle,
        sglang_gateway([busy.base, idle.base], tmp_path / "gateway.log", "round_robin") as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw.base}/v1", api_key="unused", max_retries=0)
        for _ in range(6):
            reply = client.completions.create(model="fake-model", prompt="hi", max_tokens=3)
            assert reply.choices[0].text
        metrics = httpx.get(f"{busy.base}/metrics", timeout=30).text
    rejected = [
        line for line in metrics.splitlines() if line.startswith("tailserve_requests_rejected_total{")
    ]
    assert rejected and sum(float(line.split()[-1]) for line in rejected) >= 1
