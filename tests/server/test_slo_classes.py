"""Per-request SLO classes over HTTP with the official openai client: a request's own targets
(`extra_body`), its class by name or by vLLM's integer priority, API-key and model-name defaults,
per-class counters in /metrics, and bad values refused with a 400 naming the field. The body may
loosen the caller's class but never tighten it unless --trust-request-slo. On the real model,
interactive requests get their first token before batch requests queued ahead of them."""

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
from tailserve.engine.request import SloTarget
from tailserve.errors import ConfigError
from tailserve.server.app import create_app
from tailserve.server.config import ServerConfig
from tailserve.server.slo_classes import SloClasses
from tailserve.weights.loader import LoadedModel
from tests.server.fake_engine import FakeEngine
from tests.server.harness import threaded_server
from tests.server.test_app_fake import metric

# interactive: 2 s and 150 ms (SchedulerConfig's); batch: 20 s and 600 ms (4x); bulk: 60 s and 1 s.
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


def _timings(client: openai.OpenAI, **extra: Any) -> tuple[str, float, float]:
    """The class and targets the request was admitted and scheduled by (`tailserve_timings`)."""
    timings = (_complete(client, **extra).model_extra or {})["tailserve_timings"]
    return timings["slo_class"], timings["slo_ttft_s"], timings["slo_tpot_s"]


def _loaded_fake(tmp_path: Path, trusted: bool = False) -> Iterator[tuple[str, FakeEngine]]:
    """A fake engine that predicts a 5 s wait for everyone, behind a 2 s --slo-ttft."""
    engine = FakeEngine(wait_estimate_s=5.0, scheduler=SchedulerConfig(slo_ttft_s=2.0))
    classes = _classes(tmp_path, CLASSES)
    config = ServerConfig(api_key="sk-main", slo_classes=classes, trust_request_slo=trusted)
    with threaded_server(engine, config) as base:
        yield base, engine


@pytest.fixture
def loaded_fake(tmp_path: Path) -> Iterator[tuple[str, FakeEngine]]:
    yield from _loaded_fake(tmp_path)


@pytest.fixture
def trusted_fake(tmp_path: Path) -> Iterator[tuple[str, FakeEngine]]:
    """As `loaded_fake`, with --trust-request-slo: the body may tighten the caller's class."""
    yield from _loaded_fake(tmp_path, trusted=True)


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
        # Its own target beats its class's, down to the caller's (interactive) 2 s: 5 s > 2 s.
        _complete(main, priority="batch", slo={"ttft_ms": 1000})
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


def test_an_untrusted_body_cannot_tighten_the_callers_class(loaded_fake: tuple[str, FakeEngine]) -> None:
    """A batch key asking for interactive (by name, by vLLM's integer, or by its own targets) is
    admitted, scheduled and counted as batch: 5 s predicted is within batch's 20 s."""
    base, _ = loaded_fake
    batch = _client(base, "sk-batch")
    assert _timings(batch, priority="interactive") == ("batch", 20.0, 0.6)
    assert _timings(batch, priority=-1) == ("batch", 20.0, 0.6)
    assert _timings(batch, slo={"ttft_ms": 1000, "tpot_ms": 10}) == ("batch", 20.0, 0.6)
    assert _timings(batch, priority="interactive", slo={"tpot_ms": 900}) == ("batch", 20.0, 0.9)
    assert _timings(batch, priority="bulk") == ("bulk", 60.0, 1.0)  # looser: granted
    assert metric(base, "tailserve_slo_requests_total", {"slo_class": "batch", "result": "met"}) == 4
    with pytest.raises(KeyError):  # no request ran as interactive
        metric(base, "tailserve_slo_requests_total", {"slo_class": "interactive"})


def test_a_trusted_body_may_tighten(trusted_fake: tuple[str, FakeEngine]) -> None:
    """With --trust-request-slo the same requests run with what they asked: 2 s and 1 s < 5 s."""
    base, _ = trusted_fake
    batch = _client(base, "sk-batch")
    with pytest.raises(openai.RateLimitError):
        _complete(batch, priority="interactive")
    with pytest.raises(openai.RateLimitError):
        _complete(batch, slo={"ttft_ms": 1000})
    assert _timings(batch, slo={"ttft_ms": 9000, "tpot_ms": 50}) == ("batch", 9.0, 0.05)


def test_model_name_default_class(tmp_path: Path) -> None:
    engine = FakeEngine(wait_estimate_s=5.0, scheduler=SchedulerConfig(slo_ttft_s=2.0))
    classes = _classes(tmp_path, {"models": {"fake-model": "batch"}})
    with threaded_server(engine, ServerConfig(slo_classes=classes)) as base:
        assert _timings(_client(base, "unused")) == ("batch", 20.0, 0.6)  # batch by its model name
        # The model's class is the floor as a key's is: asking for interactive runs as batch.
        assert _timings(_client(base, "unused"), priority="interactive") == ("batch", 20.0, 0.6)


@pytest.mark.parametrize(
    ("key", "priority", "slo", "trusted", "expected"),
    [
        ("sk-batch", "interactive", None, False, SloTarget("batch", 20.0, 0.6)),
        ("sk-batch", -1, None, False, SloTarget("batch", 20.0, 0.6)),
        ("sk-batch", 0, None, False, SloTarget("batch", 20.0, 0.6)),
        ("sk-batch", "batch", {"ttft_ms": 60000}, False, SloTarget("batch", 60.0, 0.6)),
        ("sk-batch", None, {"ttft_ms": 1000, "tpot_ms": 10}, False, SloTarget("batch", 20.0, 0.6)),
        ("sk-batch", None, {"ttft_ms": 30000}, False, SloTarget("batch", 30.0, 0.6)),
        # A class tighter in one target only: not granted, its looser TPOT kept.
        ("sk-batch", "snappy", None, False, SloTarget("batch", 20.0, 5.0)),
        # The floor is the caller's class, not the one `priority` names.
        ("sk-main", "batch", {"ttft_ms": 1000}, False, SloTarget("batch", 2.0, 0.6)),
        ("sk-main", 3, None, False, SloTarget("batch", 20.0, 0.6)),
        ("sk-main", "interactive", None, False, SloTarget("interactive", 2.0, 0.15)),
        ("sk-batch", "interactive", None, True, SloTarget("interactive", 2.0, 0.15)),
        ("sk-batch", -1, {"tpot_ms": 50}, True, SloTarget("interactive", 2.0, 0.05)),
        ("sk-batch", "snappy", None, True, SloTarget("snappy", 0.5, 5.0)),
    ],
)
def test_for_request_holds_client_choices_to_the_callers_class(
    tmp_path: Path,
    key: str,
    priority: int | str | None,
    slo: dict[str, Any] | None,
    trusted: bool,
    expected: SloTarget,
) -> None:
    snappy = {"ttft_ms": 500, "tpot_ms": 5000}  # tighter than batch's TTFT, looser than its TPOT
    classes = _classes(tmp_path, {**CLASSES, "classes": {"batch": {"ttft_ms": 20000}, "snappy": snappy}})
    assert classes.for_request(key, "fake-model", priority, slo, trusted=trusted) == expected


def test_an_app_refuses_classes_tighter_than_its_engine_was_built_for(tmp_path: Path) -> None:
    """A program that passes --slo-classes' file to create_app itself: a class tighter than the
    engine's scheduler knows would let a step with no decode run past half its target, so the app
    is refused with a ConfigError that says how to build the engine; built that way, it serves."""
    classes = _classes(
        tmp_path, {"classes": {"snappy": {"ttft_ms": 500}}, "models": {"fake-model": "snappy"}}
    )
    loose = FakeEngine(scheduler=SchedulerConfig(slo_ttft_s=2.0))
    with pytest.raises(ConfigError, match="tightest_ttft_s=0.5"):
        create_app(loose, ServerConfig(slo_classes=classes))
    told = FakeEngine(scheduler=classes.scheduler_config(SchedulerConfig(slo_ttft_s=2.0)))
    with threaded_server(told, ServerConfig(slo_classes=classes)) as base:
        assert _timings(_client(base, "unused"))[:2] == ("snappy", 0.5)


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
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, max_num_seqs=8, slo_ttft_s=60.0, slo_tpot_s=60.0
        ),
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
    """`tailserve serve --slo-classes FILE --prefill-floor --past-saving-share --urgent-slack
    --trust-request-slo`; a bad file, share or slack is a ConfigError (the command prints it and exits 2)."""
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
    assert engine.scheduler.tightest_ttft_s == 3.0  # what bounds a longer step with no decode
    assert not server.trust_request_slo  # off unless asked; the old name still turns it on
    for flag in ("--trust-request-slo", "--trust-slo-headers"):
        assert configs_from_args(build_parser().parse_args([*flags, flag]))[1].trust_request_slo
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="--slo-classes"):
        configs_from_args(build_parser().parse_args(flags))
    with pytest.raises(ConfigError, match="--past-saving-share"):
        configs_from_args(build_parser().parse_args(["serve", "--past-saving-share", "0"]))
    with pytest.raises(ConfigError, match="--urgent-slack"):
        configs_from_args(build_parser().parse_args(["serve", "--urgent-slack", "1.5"]))
