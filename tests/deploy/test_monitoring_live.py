"""A live `tailserve serve --model dummy:tiny` behind a live `tailserve route`: both /metrics pages
pass `promtool check metrics`, expose the contract of docs/INTERFACES.md with its types, and
carry every metric the alert rules and the dashboard query.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.contract import PROMETHEUS_BUILTINS, REPO, contract, dcgm_field_names, referenced_names

PROMTOOL = shutil.which("promtool")
READY_TIMEOUT_S = 120.0  # a start-up deadline, not a performance assertion
LATENCY_HISTOGRAMS = (
    "tailserve_time_to_first_token_seconds",
    "tailserve_time_per_output_token_seconds",
    "tailserve_inter_token_latency_seconds",
    "tailserve_e2e_request_latency_seconds",
    "tailserve_queue_time_seconds",
)
# promtool lint problems that come from docs/INTERFACES.md itself (none since the gauge was renamed
# tailserve_kv_blocks_capacity).
CONTRACT_LINT: tuple[str, ...] = ()
# The model-server protocol's series keep vLLM's names, colon included: the gateway's endpoint picker
# reads them by those names (server/metrics.py).
VLLM_PROTOCOL_NAMES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
)
PROTOCOL_LINT = tuple(f"{name} metric names should not contain ':'" for name in VLLM_PROTOCOL_NAMES)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tailserve() -> list[str]:
    venv = REPO / ".venv" / "bin" / "tailserve"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "tailserve.cli"]


@dataclass(frozen=True)
class Scrapes:
    """The /metrics pages of the live server and router after one routed request, and its reply."""

    server: str
    router: str
    completion: dict[str, Any]


def _wait_ready(process: subprocess.Popen[bytes], base: str, log: Path) -> None:
    """Poll GET /ready until 200; fail with the log tail if the process dies or the deadline passes."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(base_url=base, timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                pytest.fail(f"{process.args!r} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if client.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{base} not ready after {READY_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    """Start a server and a router in front of it, send one completion through the router, scrape both."""
    logs = Path(tmp_path_factory.mktemp("live"))
    server_port, router_port = _free_port(), _free_port()
    server_url, router_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{router_port}"
    commands = {
        "serve": ["serve", "--model", "dummy:tiny", "--host", "127.0.0.1", "--port", str(server_port)],
        "route": ["route", "--replica", server_url, "--host", "127.0.0.1", "--port", str(router_port)],
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for (name, args), url in zip(commands.items(), (server_url, router_url), strict=True):
            log = logs / f"{name}.log"
            with log.open("w") as log_file:
                processes.append(
                    subprocess.Popen(
                        [*_tailserve(), *args], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT
                    )
                )
            _wait_ready(processes[-1], url, log)
        with httpx.Client(timeout=30.0) as client:
            reply = client.post(
                router_url + "/v1/completions",
                json={"model": "dummy-tiny", "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True},
            )
            assert reply.status_code == 200, reply.text
            pages = [client.get(url + "/metrics") for url in (server_url, router_url)]
        assert all(page.status_code == 200 for page in pages)
        yield Scrapes(server=pages[0].text, router=pages[1].text, completion=reply.json())
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def exposed_names(text: str) -> dict[str, str]:
    """Metric name -> type as a scraper sees it (counters under their `_total` name)."""
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        names[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return names


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
@pytest.mark.parametrize("target", ["server", "router"])
def test_live_metrics_pass_promtool(scrapes: Scrapes, target: str) -> None:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=getattr(scrapes, target),
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert [p for p in problems if p not in CONTRACT_LINT + PROTOCOL_LINT] == []


def test_every_metric_the_rules_and_dashboard_query_is_exposed(scrapes: Scrapes) -> None:
    """tailserve metrics on the live server or router; DCGM series (no GPU here) among the field names
    of the pinned dcgm-exporter."""
    exposed = set(exposed_names(scrapes.server)) | set(exposed_names(scrapes.router)) | PROMETHEUS_BUILTINS
    dcgm = {name for name in referenced_names() if name.startswith("DCGM_")}
    assert dcgm, "the GPU row and alerts query no DCGM field"
    assert referenced_names() - dcgm - exposed == set()
    assert dcgm - dcgm_field_names() == set()


def test_the_whole_contract_is_exposed_with_its_types(scrapes: Scrapes) -> None:
    exposed = {"server": exposed_names(scrapes.server), "router": exposed_names(scrapes.router)}
    for name, metric in contract().items():
        assert exposed[metric.owner].get(name) == metric.kind, f"{metric.owner}: {name}"


def test_latency_histograms_observed_the_request_and_resolve_1ms_to_120s(scrapes: Scrapes) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scrapes.server)}
    for name in LATENCY_HISTOGRAMS:
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert min(bounds) <= 0.001 and max(b for b in bounds if b != float("inf")) >= 120, name
    e2e = families["tailserve_e2e_request_latency_seconds"].samples
    assert next(s.value for s in e2e if s.name.endswith("_count")) >= 1


def test_step_metrics_count_the_steps_the_request_took(scrapes: Scrapes) -> None:
    """One request alone on the server after warm-up: one step for its prompt (it fits the step
    budget) that samples the first token, then one decode-only step per further token."""
    timings = scrapes.completion["tailserve_timings"]
    output, computed_prompt = timings["output_tokens"], timings["prompt_tokens"] - timings["cached_tokens"]
    assert output == 8
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrapes.server)
        for s in family.samples
    }

    def by_kind(sample: str) -> dict[str, float]:
        return {k: values[(sample, (("kind", k),))] for k in ("decode_only", "mixed", "prefill_only")}

    assert by_kind("tailserve_step_duration_seconds_count") == {
        "decode_only": output - 1,
        "mixed": 0,
        "prefill_only": 1,
    }
    assert by_kind("tailserve_step_tokens_sum") == {
        "decode_only": output - 1,
        "mixed": 0,
        "prefill_only": computed_prompt,
    }
    paths = {path: values[("tailserve_steps_total", (("path", path),))] for path in ("cuda_graph", "eager")}
    assert paths == {"cuda_graph": 0, "eager": output}  # CPU: every step eager
    busy = values[("tailserve_engine_busy_seconds_total", ())]
    assert busy > 0
    assert busy == pytest.approx(sum(by_kind("tailserve_step_duration_seconds_sum").values()))
    assert 0 < values[("tailserve_engine_busy_ratio", ())] <= 1
