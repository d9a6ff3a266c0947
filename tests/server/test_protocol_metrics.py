"""The model-server protocol's vLLM-named series on /metrics (what the Kubernetes inference gateway's
endpoint picker reads by default), read with Prometheus' own text parser from a real server with real
requests queued and running, and checked against the engine's published state of that moment."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine
from tailserve.engine.stats import EngineStats
from tailserve.server.config import ServerConfig
from tailserve.weights.loader import LoadedModel
from tests.server.harness import threaded_server

BLOCK_SIZE = 16
MAX_NUM_SEQS = 2
NUM_REQUESTS = 6  # 2 run, 4 wait: both gauges non-zero at once


@dataclass(frozen=True)
class Series:
    """One sample: its labels and value."""

    labels: dict[str, str]
    value: float


def _protocol_series(page: str) -> dict[str, list[Series]]:
    """Every sample of the vllm: families on a /metrics page, by family name."""
    out: dict[str, list[Series]] = {}
    for family in text_string_to_metric_families(page):
        if family.name.startswith("vllm:"):
            assert family.type == "gauge", family.name
            out[family.name] = [Series(dict(s.labels), s.value) for s in family.samples]
    return out


def _only(series: dict[str, list[Series]], name: str, model: str) -> float:
    (sample,) = series[name]
    assert sample.labels == {"model_name": model}
    return sample.value


def _check_page_shows(series: dict[str, list[Series]], stats: EngineStats, model: str) -> None:
    assert _only(series, "vllm:num_requests_waiting", model) == stats.num_waiting
    assert _only(series, "vllm:num_requests_running", model) == stats.num_running
    usage = _only(series, "vllm:kv_cache_usage_perc", model)
    assert usage == stats.kv_blocks_used / stats.kv_blocks_total
    assert 0.0 <= usage <= 1.0


def test_vllm_named_gauges_equal_the_engine_state_under_load(smol: LoadedModel) -> None:
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=512),
        cache=CacheConfig(kv_cache_memory_bytes=16 << 20, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=MAX_NUM_SEQS, slo_ttft_s=600.0, slo_tpot_s=60.0
        ),
    )
    engine = AsyncEngine(config, loaded=smol)
    errors: list[BaseException] = []
    loaded: list[EngineStats] = []  # snapshots the page was checked against with requests waiting

    def run(client: openai.OpenAI, index: int) -> None:
        try:
            client.completions.create(
                model=engine.model_name,
                prompt=[(index * 131 + k * 7) % 30000 + 50 for k in range(40)],
                max_tokens=16,
                extra_body={"ignore_eos": True},
            )
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with threaded_server(engine, ServerConfig()) as base, httpx.Client(base_url=base, timeout=60) as http:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        threads = [threading.Thread(target=run, args=(client, i)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 240  # a hang guard, not a performance bound
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            before = engine.stats()
            page = http.get("/metrics").text
            # The same snapshot object before and after: the engine published nothing during the
            # scrape, so the page must show exactly this state.
            if engine.stats() is before and before.num_waiting > 0 and before.num_running > 0:
                _check_page_shows(_protocol_series(page), before, engine.model_name)
                loaded.append(before)
            time.sleep(0.02)  # leave the GIL to the engine between scrapes
        for t in threads:
            t.join(timeout=60)
        idle_page = http.get("/metrics").text
    assert not errors, errors
    assert loaded, "never scraped with requests both running and waiting"
    assert max(s.num_running for s in loaded) == MAX_NUM_SEQS
    assert max(s.kv_blocks_used for s in loaded) > 0

    series = _protocol_series(idle_page)
    idle = engine.stats()
    assert idle.num_running == idle.num_waiting == idle.kv_blocks_used == 0
    _check_page_shows(series, idle, engine.model_name)
    # Both tailserve's own names and vLLM's are on the page, from the same snapshot.
    own = {f.name: f.samples[0].value for f in text_string_to_metric_families(idle_page) if f.samples}
    assert own["tailserve_kv_blocks_capacity"] == idle.kv_blocks_total
    (cache_info,) = series["vllm:cache_config_info"]
    assert cache_info.value == 1.0
    assert cache_info.labels["block_size"] == str(BLOCK_SIZE)
    assert cache_info.labels["num_gpu_blocks"] == str(idle.kv_blocks_total)
    # No adapters: the one LoRA series has both adapter lists empty (the EPP skips it without error).
    (lora,) = series["vllm:lora_requests_info"]
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value > 0
