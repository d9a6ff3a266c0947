"""Three replica processes behind the router; one is killed mid-run and restarted.

Runs against fake replica processes always, and against real `tailserve serve --model dummy:tiny`
replicas when the server is installed. No accepted request may be lost: each completes, or (only if
its stream had started on the killed replica) ends with a clean SSE error event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.router.conftest import FAST, RouterFactory
from tests.router.fake_replica import free_port
from tests.server.harness import wait_ready

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def replica_command(kind: str, port: int, name: str) -> list[str]:
    """The command line of one replica process."""
    if kind == "real":
        return [sys.executable, "-m", "tailserve.cli", "serve", "--model", "dummy:tiny", "--port", str(port)]
    return [
        sys.executable,
        "-m",
        "tests.router.fake_replica",
        "--port",
        str(port),
        "--name",
        name,
        "--token-delay",
        "0.005",
    ]


@dataclass
class ReplicaProcess:
    """One replica process on a fixed port (restartable on the same port)."""

    kind: str
    port: int
    name: str
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            replica_command(self.kind, self.port, self.name),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_ready(self.url, START_TIMEOUT_S, self.process)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module", params=["fake", "real"])
def replicas(request: pytest.FixtureRequest) -> Iterator[list[ReplicaProcess]]:
    kind = request.param
    procs = [ReplicaProcess(kind, free_port(), f"r{i}") for i in range(3)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def _model(router_url: str) -> str:
    return str(httpx.get(router_url + "/v1/models", timeout=10).json()["data"][0]["id"])


def test_openai_client_through_router(replicas: list[ReplicaProcess], make_router: RouterFactory) -> None:
    router = make_router([r.url for r in replicas])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = _model(router.url)
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text_stream = client.completions.create(model=model, prompt="abc", max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in text_stream if c.choices)


@dataclass
class Outcome:
    """What the client saw of one request."""

    replica: str
    completed: bool
    clean_error_after_output: bool
    detail: str


def _send(router_url: str, model: str, i: int) -> Outcome:
    stream = i % 2 == 0
    body = {
        "model": model,
        "prompt": f"request {i}: " + "lorem ipsum " * 4,
        "max_tokens": 12,
        "stream": stream,
    }
    try:
        response = httpx.post(router_url + "/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as exc:
        return Outcome("", False, False, f"transport error {exc!r}")
    replica = response.headers.get("x-tailserve-replica", "")
    if response.status_code != 200:
        return Outcome(replica, False, False, f"HTTP {response.status_code}: {response.text[:200]}")
    if not stream:
        return Outcome(replica, bool(response.json()["choices"]), False, "json")
    payloads = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    if payloads[-1:] != ["[DONE]"]:
        return Outcome(replica, False, False, f"stream without [DONE]: {payloads[-3:]}")
    events = [json.loads(p) for p in payloads[:-1]]
    errors = [e for e in events if "error" in e]
    if not errors:
        return Outcome(replica, True, False, "stream")
    clean = len(errors) == 1 and "error" in events[-1] and "choices" in events[0]
    return Outcome(replica, False, clean, f"stream error {errors}")


def _healthy(router_url: str, replica_url: str) -> float:
    for row in httpx.get(router_url + "/router/replicas", timeout=5).json()["replicas"]:
        if row["url"] == replica_url:
            return 1.0 if row["healthy"] else 0.0
    raise KeyError(replica_url)


def _wait_for(condition: object, timeout_s: float) -> bool:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def test_kill_one_replica_mid_run(replicas: list[ReplicaProcess], make_router: RouterFactory) -> None:
    router = make_router([r.url for r in replicas], policy="least_load")
    model = _model(router.url)
    victim = replicas[1]
    victim_index = "1"  # the router names replicas by position, never by internal URL
    total = 48
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(_send, router.url, model, i) for i in range(total)]
        # Kill once the run is well under way, while requests are in flight.
        assert _wait_for(lambda: sum(f.done() for f in futures) >= total // 4, 120)
        victim.kill()
        outcomes = [f.result() for f in futures]

    lost = [o for o in outcomes if not o.completed and not o.clean_error_after_output]
    assert not lost, lost
    broken = [o for o in outcomes if o.clean_error_after_output]
    # Only streams that had started on the killed replica may end in an (clean) error.
    assert all(o.replica == victim_index for o in broken), broken

    bound_s = (FAST["unhealthy_threshold"] + 3) * FAST["health_interval_s"] + FAST["health_timeout_s"] + 2
    assert _wait_for(lambda: _healthy(router.url, victim.url) == 0.0, bound_s)
    after = [_send(router.url, model, i) for i in range(6)]
    assert all(o.completed and o.replica != victim_index for o in after), after

    victim.start()
    victim.wait_ready()
    assert _wait_for(lambda: _healthy(router.url, victim.url) == 1.0, bound_s)
    back = [_send(router.url, model, 100 + i) for i in range(9)]
    assert all(o.completed for o in back), back
    assert any(o.replica == victim_index for o in back)
