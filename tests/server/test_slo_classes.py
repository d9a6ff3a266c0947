"""Per-request SLO classes over HTTP with the official openai client: a request's own targets
(`extra_body`), its class by name or by vLLM's integer priority, API-key and model-name defaults,
per-class counters in /metrics, and bad values refused with a 400 naming the field. On the real
model, interactive requests get their first token before batch requests queued ahead of them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import AsyncEngine
from tailserve.errors import ConfigError
from tailserve.server.config import ServerConfig
from tailserve.server.slo_classes import SloClasses
from tailserve.weights.loader import LoadedModel
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server
from tests.server.test_app_fake import metric

CLASSES = {
    "classes": {"batch": {"ttft_ms": 20000}, "bulk": {"ttft_ms": 60000, "tpot_ms": 1000}},
    "api_keys": {"sk-batch": "batch", "sk-live": "interactive"},
}


def _classes(tmp_path: Path, data: dict[str, Any]) -> SloClasses:
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(data))
    return SloClasses.load(path, SchedulerConfig(slo_ttft_s=2.0))


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def _complete(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(model="fake-model", prompt="hi", max_tokens=2, extra_body=extra or None)


@pytest.fixture
def loaded_fake(tmp_path: Path) -> Iterator[tuple[str, FakeEngine]]:
    """A fake engine that predicts a 5 s wait for everyone, behind a 2 s --slo-ttft."""
    engine = FakeEngine(wait_estimate_s=5.0, scheduler=SchedulerConfig(slo_ttft_s=2.0))
    config = ServerConfig(api_key="sk-main", slo_classes=_classes(tmp_path, CLASSES))
    with threaded_server(engine, config) as base:
        yield base, engine


def test_admission_is_by_each_request_own_target(loaded_fake: tuple[str, FakeEngine]) -> None:
    base, _ = loaded_fake
    main = _client(base, "sk-main")
    with pytest.raises(openai.RateLimitError):
        _complete(main)  # the default class, interactive: 5 s predicted > 2 s
    with pytest.raises(openai.RateLimitError):
        _complete(main, priority=-1)  # vLLM's integer: below 0 is interactive
    assert _complete(main, slo={"ttft_ms": 10000}).choices[0].text
    assert _complete(main, priority="batch").choices[0].text  # 20 s target
    assert _complete(main, priority=3).choices[0].text  # vLLM's integer: above 0 is batch
    with pytest.raises(openai.RateLimitError):
        _complete(main, priority="batch", slo={"ttft_ms": 1000})  # its own target beats its class's
    # The key's class is the default of its requests; a request may still ask for another one.
    assert _complete(_client(base, "sk-batch")).choices[0].text
    with pytest.raises(openai.RateLimitError):
        _complete(_client(base, "sk-live"))
    assert _complete(_client(base, "sk-live"), priority="bulk").choices[0].text
    with pytest.raises(openai.AuthenticationError):
        _complete(_client(base, "sk-unknown"))
    met = metric(base, "tailserve_slo_requests_total", {"slo_class": "batch", "result": "met"})
    assert met == 3  # priority "batch", priority 3, key sk-batch (the fake's first token is instant)
    assert metric(base, "tailserve_slo_requests_total", {"slo_class": "bulk", "result": "met"}) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"slo": {"ttft_ms": -5}}, "slo.ttft_ms"),
        ({"slo": {"tpot_ms": 0}}, "slo.tpot_ms"),
        ({"slo": {"ttft_ms": "fast"}}, "slo.ttft_ms"),
        ({"slo": {"deadline_ms": 100}}, "slo.deadline_ms"),
        ({"slo": 500}, "slo"),
        ({"priority": "gold"}, "priority"),
        ({"priority": True}, "priority"),
    ],
)
def test_bad_slo_values_are_400_naming_the_field(
    loaded_fake: tuple[str, FakeEngine], extra: dict[str, Any], param: str
) -> None:
    base, engine = loaded_fake
    calls = engine.generate_calls  # the warm-up's
    with pytest.raises(openai.BadRequestError) as err:
        _complete(_client(base, "sk-batch"), **extra)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param
    assert engine.generate_calls == calls  # nothing was queued


def test_model_name_default_class(tmp_path: Path) -> None:
    engine = FakeEngine(wait_estimate_s=5.0, scheduler=SchedulerConfig(slo_ttft_s=2.0))
    classes = _classes(tmp_path, {"models": {"fake-model": "batch"}})
    with threaded_server(engine, ServerConfig(slo_classes=classes)) as base:
        assert _complete(_client(base, "unused")).choices[0].text  # batch by its model name: 20 s
        with pytest.raises(openai.RateLimitError):
            _complete(_client(base, "unused"), priority="interactive")


@pytest.mark.parametrize(
    "data",
    [
        {"classes": {"fast": {"ttft_ms": -1}}},
        {"classes": {"fast": {"ttft_s": 1}}},
        {"default": "gold"},
        {"api_keys": {"sk-x": "gold"}},
        {"models": ["batch"]},
        {"tiers": {}},
    ],
)
def test_bad_class_files_are_config_errors(tmp_path: Path, data: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--slo-classes"):
        _classes(tmp_path, data)


def test_interactive_requests_get_first_tokens_before_queued_batch_ones(smol: LoadedModel) -> None:
    """Four batch prompts queue first; an interactive prompt of the same length arriving after them
    is prefilled first (prompt x target ordering), so the user sees its first token earlier."""
    config = EngineConfig(
        model=ModelConfig(model="default", dtype="float32", device="cpu", max_model_len=1024),
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, slo_ttft_s=60.0),
    )
    engine = AsyncEngine(config, loaded=smol)
    first_token: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(client: openai.OpenAI, name: str, index: int, priority: str) -> None:
        prompt = [(index * 997 + k * 13) % 40000 + 100 for k in range(240)]
        try:
            stream = client.completions.create(
                model=engine.model_name,
                prompt=prompt,
                max_tokens=2,
                stream=True,
                extra_body={"priority": priority},
            )
            for _ in stream:
                first_token.setdefault(name, time.monotonic())
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with threaded_server(engine, ServerConfig()) as base:
        client = _client(base, "unused")
        batch = [threading.Thread(target=run, args=(client, f"b{i}", i, "batch")) for i in range(4)]
        for t in batch:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = engine.stats()
            if stats.num_waiting + stats.num_running >= 4:
                break
            time.sleep(0.005)
        interactive = threading.Thread(target=run, args=(client, "i", 9, "interactive"))
        interactive.start()
        for t in [*batch, interactive]:
            t.join(timeout=300)
    assert not errors
    later = [b for b in ("b0", "b1", "b2", "b3") if first_token[b] > first_token["i"]]
    assert len(later) >= 3, first_token  # at most the one already mid-prefill got in first


def test_serve_flags_reach_the_configs(tmp_path: Path) -> None:
    """`tailserve serve --slo-classes FILE --prefill-floor --past-saving-share --urgent-slack`; a bad
    file, share or slack is a ConfigError (the command prints it and exits 2)."""
    from tailserve.cli import build_parser
    from tailserve.server.cli import configs_from_args

    path = tmp_path / "slo.json"
    path.write_text(json.dumps(CLASSES))
    flags = [
        "serve",
        "--slo-ttft",
        "3",
        "--slo-classes",
        str(path),
        "--prefill-floor",
        "0",
        "--past-saving-share",
        "0.5",
        "--urgent-slack",
        "1",
    ]
    engine, server = configs_from_args(build_parser().parse_args(flags))
    assert (engine.scheduler.prefill_floor, engine.scheduler.past_saving_share) == (0.0, 0.5)
    assert engine.scheduler.urgent_slack == 1.0
    assert server.slo_classes is not None
    assert server.slo_classes.classes["interactive"].ttft_s == 3.0  # built-in: --slo-ttft
    assert server.slo_classes.classes["batch"].ttft_s == 20.0  # the file's
    assert server.slo_classes.api_keys["sk-batch"] == "batch"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="--slo-classes"):
        configs_from_args(build_parser().parse_args(flags))
    with pytest.raises(ConfigError, match="--past-saving-share"):
        configs_from_args(build_parser().parse_args(["serve", "--past-saving-share", "0"]))
    with pytest.raises(ConfigError, match="--urgent-slack"):
        configs_from_args(build_parser().parse_args(["serve", "--urgent-slack", "1.5"]))
