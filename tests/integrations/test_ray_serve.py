"""tailserve on Ray Serve, on a local Ray cluster this test starts and stops (loopback only): two
engine replicas behind Ray Serve's HTTP proxy answer the official openai client, streamed and not,
with tailserve's own errors. Marked `ray` (skip with -m 'not ray'); skipped without ray[serve]."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tailserve.integrations.ray_serve import build_app, serve_configs  # noqa: E402

pytestmark = pytest.mark.ray
READY_TIMEOUT_S = 180.0  # a start-up deadline on a shared 2-core box, not a performance bound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """A local Ray cluster with tailserve's app (2 replicas of dummy:tiny) behind Serve's proxy."""
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": "dummy:tiny", "no_warmup": "true", "num_replicas": 2, "num_cpus": 0}
        serve.run(build_app(args), name="tailserve", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while httpx.get(f"{base}/ready", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "replicas never ready"
            time.sleep(0.2)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_run(proxy: str) -> None:
    status = serve.status().applications["tailserve"]
    replicas = status.deployments["tailserve"].replica_states
    assert replicas.get("RUNNING") == 2


def test_openai_client_through_ray_serve(proxy: str) -> None:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["dummy-tiny"]
    done = client.completions.create(model="dummy-tiny", prompt="Hello there", max_tokens=5, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model="dummy-tiny", prompt="Hello there", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(
        model="dummy-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:  # tailserve's own 400, unchanged
        client.completions.create(model="dummy-tiny", prompt="x", max_tokens=2, extra_body={"top_k": -5})
    assert bad.value.body is not None and "top_k" in str(bad.value.body)


def test_flags_are_tailserve_serve_flags() -> None:
    engine, server = serve_configs({"model": "dummy:tiny", "max-num-seqs": 8, "no_warmup": "true"})
    assert engine.model.model == "dummy:tiny" and engine.scheduler.max_num_seqs == 8 and not server.warmup
