"""tailserve on Ray Serve, on a local Ray cluster this module starts once and stops (loopback only):
two engine replicas behind Ray Serve's HTTP proxy answer the official openai client, streamed and
not, with tailserve's own errors and admission's 429; a replica killed under load costs no request
that had not started, and ends the streams it was serving with an error event and [DONE].
Marked `ray` (skip with -m 'not ray'); skipped without ray[serve]."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tailserve.integrations.ray_autoscaling import POLICY_PATH  # noqa: E402
from tailserve.integrations.ray_serve import build_app, serve_configs  # noqa: E402
from tailserve.router.proxy import REPLICA_HEADER  # noqa: E402

pytestmark = pytest.mark.ray
READY_TIMEOUT_S = 180.0  # a start-up deadline on a shared 2-core box, not a performance bound
STEP_TIMEOUT_S = 60.0  # the most any awaited response, event or end of stream may take here
# Random weights in SmolLM2-135M's shape: slow enough on a CPU (tens of tokens a second) that a
# stream of a few hundred tokens is still running when the test acts on it.
MODEL = "dummy-smollm2-135m"
ENGINE_ARGS = {
    "model": "dummy:smollm2-135m",
    "max_model_len": 1024,
    "kv_cache_memory": "64MiB",
    "no_warmup": "true",
    # A lax TPOT target: two replicas of these weights share a loaded 2-core box at 100+ ms a token,
    # and TPOT admission would refuse what the tests send to see replicas serve (one test sets a
    # tight TTFT target to see admission refuse).
    "slo_tpot": 60,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


METRICS_PORT = _free_port()  # Ray's metrics agent's Prometheus page
METRICS_REPORT_MS = 1000


def _wait_ready(base: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while httpx.get(f"{base}/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "replicas never ready"
        time.sleep(0.2)


def _engine_replicas_running(app: str) -> int:
    status = serve.status().applications.get(app)
    return 0 if status is None else int(status.deployments["engine"].replica_states.get("RUNNING", 0))


def _wait_running(app: str, replicas: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while _engine_replicas_running(app) < replicas:
        assert time.monotonic() < deadline, f"{app}: {replicas} engine replicas never ran"
        time.sleep(0.2)


def _ray_metrics_page(prefix: str, replica: object) -> str:
    """The line of Ray's metrics export (this node's metrics agent) starting with `prefix` and tagged
    with `replica`, once Ray has reported it (it reports every METRICS_REPORT_MS)."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        try:
            text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
        except httpx.HTTPError:
            text = ""  # the agent is still starting
        tag = f'replica="{replica}"'
        lines = [line for line in text.splitlines() if line.startswith(prefix) and tag in line]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, "Ray never exported the replica's metric"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster with Serve's proxy on loopback; the base URL of the proxy."""
    port = _free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": METRICS_REPORT_MS},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def proxy(cluster: str) -> str:
    """tailserve's app (2 engine replicas) at the proxy's root."""
    args = {**ENGINE_ARGS, "num_replicas": 2, "num_cpus": 0}
    serve.run(build_app(args), name="tailserve", route_prefix="/")
    _wait_ready(cluster)
    return cluster


def test_two_replicas_run(proxy: str) -> None:
    status = serve.status().applications["tailserve"]
    assert status.deployments["engine"].replica_states.get("RUNNING") == 2
    assert status.deployments["tailserve"].replica_states.get("RUNNING") == 1  # the ingress


def test_openai_client_through_ray_serve(proxy: str) -> None:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    done = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:  # tailserve's own 400, unchanged
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"top_k": -5})
    assert bad.value.body is not None and "top_k" in str(bad.value.body)


class Stream:
    """A completion stream read event by event (`data:` payloads, parsed unless [DONE])."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.replica = response.headers[REPLICA_HEADER]
        self._lines = response.aiter_lines()
        self.events: list[object] = []

    async def next_event(self) -> object:
        async def read() -> object:
            async for line in self._lines:
                if line.startswith("data: "):
                    payload = line[6:]
                    return payload if payload == "[DONE]" else json.loads(payload)
            return None  # the connection ended

        event = await asyncio.wait_for(read(), STEP_TIMEOUT_S)
        self.events.append(event)
        return event

    async def to_end(self) -> list[object]:
        while self.events[-1:] not in (["[DONE]"], [None]):
            await self.next_event()
        return self.events


async def open_stream(http: httpx.AsyncClient, max_tokens: int, prompt: str = "a story") -> Stream:
    """A started stream: its first token has arrived."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = http.build_request("POST", "/v1/completions", json=body)
    response = await asyncio.wait_for(http.send(request, stream=True), STEP_TIMEOUT_S)
    assert response.status_code == 200
    stream = Stream(response)
    assert isinstance(await stream.next_event(), dict)
    return stream


def test_admission_429_passes_through_unchanged(cluster: str) -> None:
    """One replica with one sequence slot, busy with a long stream, refuses a request whose wait it
    predicts past the 0.5 s TTFT target: the client gets tailserve's 429 (OpenAI error JSON,
    Retry-After) as the replica sent it. The stream's client leaves, the replica aborts it and
    serves the next request."""
    args = {**ENGINE_ARGS, "num_cpus": 0, "max_num_seqs": 1, "slo_ttft": 0.5}
    serve.run(build_app(args), name="one", route_prefix="/one")
    base = f"{cluster}/one"
    try:
        _wait_ready(base)

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=STEP_TIMEOUT_S) as http:
                running = await open_stream(http, max_tokens=1000)  # ~15 s of decoding here
                body = {"model": MODEL, "prompt": "next", "max_tokens": 3}
                refused = await http.post("/v1/completions", json=body)
                await running.response.aclose()  # the client leaves: the replica aborts its request
                deadline = time.monotonic() + STEP_TIMEOUT_S
                while "tailserve_requests_running 0.0" not in (await http.get("/metrics")).text:
                    assert time.monotonic() < deadline, "the abandoned stream kept running"
                    await asyncio.sleep(0.05)
                return refused, await http.post("/v1/completions", json=body)

        refused, later = asyncio.run(scenario())
        shown = serve.get_deployment_handle("engine", app_name="one").export_metrics.remote().result()
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "slo", error
        assert "exceeds the time-to-first-token target of 0.50s" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["content-type"] == "application/json"
        assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 3
        # What the replica's Ray metrics now show (tagged with this replica by Ray Serve).
        assert shown["replica"] == refused.headers[REPLICA_HEADER] == later.headers[REPLICA_HEADER]
        assert shown["tailserve_requests_rejected{slo}"] == 1
        assert shown["tailserve_requests_finished{length}"] == 1
        assert shown["tailserve_requests_running"] == shown["tailserve_requests_waiting"] == 0
        assert shown["tailserve_time_to_first_token_seconds_count"] == 1  # an abort records none
        agent = _ray_metrics_page("ray_tailserve_requests_rejected", shown["replica"])
        assert 'reason="slo"' in agent and agent.rstrip().endswith("1.0"), agent
    finally:
        serve.delete("one")


def test_ray_serve_llm_prefix_router_places_tailserve_requests(cluster: str) -> None:
    """Ray Serve LLM's PrefixCacheAffinityRouter as the engine deployment's router
    (router=prefix_cache_affinity): requests sharing a long system prompt all go where the first
    went; a request without a prompt (GET /v1/models) is placed by power of two choices."""
    args = {"model": "dummy:tiny", "no_warmup": "true", "num_cpus": 0, "num_replicas": 2}
    serve.run(build_app({**args, "router": "prefix_cache_affinity"}), name="llm", route_prefix="/llm")
    base = f"{cluster}/llm"
    try:
        _wait_running("llm", 2)
        _wait_ready(base)
        system = ("Answer every question in one short sentence. " * 20)[:768]
        replicas = set()
        for i in range(6):
            body = {"model": "dummy-tiny", "prompt": f"{system}Question {i}?", "max_tokens": 1}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=STEP_TIMEOUT_S)
            assert response.status_code == 200, response.text
            replicas.add(response.headers[REPLICA_HEADER])
        assert len(replicas) == 1
        models = httpx.get(f"{base}/v1/models", timeout=STEP_TIMEOUT_S)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "dummy-tiny"
    finally:
        serve.delete("llm")


# Ray deprecates metrics_interval_s, but it is still what sets how often replicas report.
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_queue_depth_autoscaling_adds_a_replica_when_requests_wait(cluster: str) -> None:
    """One engine replica with one sequence slot and the queue-depth autoscaling policy: three
    streams leave two requests waiting in the engine, so Ray starts a second replica and it runs."""
    scaling = {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0,
        "look_back_period_s": 1.0,
        "metrics_interval_s": 0.2,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_waiting": 1}},
    }
    args = {**ENGINE_ARGS, "num_cpus": 0, "max_num_seqs": 1, "slo_ttft": 1000, "autoscaling_config": scaling}
    serve.run(build_app(args), name="scaled", route_prefix="/scaled")
    base = f"{cluster}/scaled"
    try:
        _wait_ready(base)
        assert _engine_replicas_running("scaled") == 1

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=STEP_TIMEOUT_S) as http:
                body = {"model": MODEL, "prompt": "a story", "max_tokens": 1000, "ignore_eos": True}
                streams = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
                try:
                    await asyncio.to_thread(_wait_running, "scaled", 2)
                finally:
                    for stream in streams:  # the clients leave; the replicas abort their requests
                        stream.cancel()
                    await asyncio.gather(*streams, return_exceptions=True)

        asyncio.run(scenario())
    finally:
        serve.delete("scaled")


def test_a_hot_prefix_stays_on_one_replica_and_the_rest_spreads(proxy: str) -> None:
    """tailserve's placement as Ray's request router: requests sharing a long system prompt all go
    where it is cached; unrelated prompts (no full prefix block) go to the least loaded in turn."""
    system = ("Answer every question in one short sentence. " * 20)[:768]  # 3 prefix blocks of 256 chars

    def replica_for(prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        response = httpx.post(f"{proxy}/v1/completions", json=body, timeout=STEP_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    assert len({replica_for(f"{system}Question {i}?") for i in range(6)}) == 1
    assert len({replica_for(f"Question {i}?") for i in range(6)}) == 2


def test_a_replica_killed_under_load(proxy: str) -> None:
    """Streams on both replicas; one replica's actor is killed. Its streams end with an error event
    and [DONE], the other's go on to their end, and requests sent meanwhile are all served (by the
    survivor: a request no replica started is retried on another). Runs last: it costs a replica."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=proxy, timeout=STEP_TIMEOUT_S) as http:
            streams = await asyncio.gather(*(open_stream(http, 200, f"story {i}") for i in range(6)))
            replicas = {s.replica for s in streams}
            assert len(replicas) == 2, "Ray's router put every stream on one replica"
            victim = streams[0].replica
            ray.kill(ray.get_actor(f"SERVE_REPLICA::tailserve#engine#{victim}", namespace="serve"))
            body = {"model": MODEL, "prompt": "after", "max_tokens": 4}
            later = [http.post("/v1/completions", json=body) for _ in range(4)]
            ends, served = await asyncio.gather(
                asyncio.gather(*(s.to_end() for s in streams)), asyncio.gather(*later)
            )
            for stream, events in zip(streams, ends, strict=True):
                assert events[-1] == "[DONE]", events[-3:]
                last = events[-2]
                assert isinstance(last, dict)
                if stream.replica == victim:
                    assert last["error"]["code"] == "replica_stream_failed", last
                else:
                    assert last["choices"][0]["finish_reason"] == "length", last
            for response in served:
                assert response.status_code == 200, response.text
                assert response.headers[REPLICA_HEADER] != victim
                assert response.json()["usage"]["completion_tokens"] == 4

    asyncio.run(scenario())


def test_flags_are_tailserve_serve_flags() -> None:
    engine, server = serve_configs({"model": "dummy:tiny", "max-num-seqs": 8, "no_warmup": "true"})
    assert engine.model.model == "dummy:tiny" and engine.scheduler.max_num_seqs == 8 and not server.warmup
