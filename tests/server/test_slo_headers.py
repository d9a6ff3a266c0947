"""The gateway's per-request SLO headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`) over HTTP with the official
openai client (`extra_headers`): what a user sees is the target admission and the scheduler used
(`tailserve_timings.slo_ttft_s` / `slo_tpot_s`, a 429 or not, the per-class counters). Untrusted, a
header may loosen the caller's class but never tighten it; with --trust-request-slo (or its old name
--trust-slo-headers) it may. A header beats the body's `slo` target it names; bad values are 400s
naming the header and queue nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tailserve.config import SchedulerConfig
from tailserve.server.config import ServerConfig
from tailserve.server.slo_classes import SloClasses
from tests.server.fake_engine import FakeEngine
from tests.server.harness import serve_process, threaded_server
from tests.server.test_app_fake import metric

# interactive: --slo-ttft 2 s, --slo-tpot 150 ms (SchedulerConfig's); batch: 20 s and 600 ms.
CLASSES = {"classes": {"batch": {"ttft_ms": 20000}}, "api_keys": {"sk-batch": "batch"}}
TTFT, TPOT = "x-slo-ttft-ms", "x-slo-tpot-ms"


def _server(tmp_path: Path, trusted: bool) -> tuple[FakeEngine, ServerConfig]:
    """A fake engine that predicts a 5 s wait for everyone: a 2 s target is refused, 10 s admitted."""
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(CLASSES))
    scheduler = SchedulerConfig(slo_ttft_s=2.0)
    engine = FakeEngine(wait_estimate_s=5.0, scheduler=scheduler)
    config = ServerConfig(
        api_key="sk-main", slo_classes=SloClasses.load(path, scheduler), trust_request_slo=trusted
    )
    return engine, config


@pytest.fixture
def untrusted(tmp_path: Path) -> Iterator[tuple[str, FakeEngine]]:
    engine, config = _server(tmp_path, trusted=False)
    with threaded_server(engine, config) as base:
        yield base, engine


def _complete(base: str, key: str, headers: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    """The effective targets the server reports in `tailserve_timings`; RateLimitError on a 429."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    out = client.completions.create(
        model="fake-model", prompt="hi", max_tokens=2, extra_headers=headers, extra_body=body or None
    )
    timings = (out.model_extra or {})["tailserve_timings"]
    assert isinstance(timings, dict)
    return timings


def test_untrusted_headers_loosen_but_never_tighten_the_callers_class(
    untrusted: tuple[str, FakeEngine],
) -> None:
    base, _ = untrusted
    with pytest.raises(openai.RateLimitError):
        _complete(base, "sk-main")  # interactive: 5 s predicted > 2 s
    loose = _complete(base, "sk-main", {TTFT: "10000", TPOT: "400"})
    assert (loose["slo_class"], loose["slo_ttft_s"], loose["slo_tpot_s"]) == ("interactive", 10.0, 0.4)
    # The batch key asks for 1 s and 10 ms: raised to its class's 20 s and 600 ms, so admitted.
    capped = _complete(base, "sk-batch", {TTFT: "1000", TPOT: "10"})
    assert (capped["slo_class"], capped["slo_ttft_s"], capped["slo_tpot_s"]) == ("batch", 20.0, 0.6)
    # One header alone leaves the other target to the class.
    only_tpot = _complete(base, "sk-batch", {TPOT: "2500"})
    assert (only_tpot["slo_ttft_s"], only_tpot["slo_tpot_s"]) == (20.0, 2.5)
    assert metric(base, "tailserve_slo_requests_total", {"slo_class": "batch", "result": "met"}) == 2


def test_a_header_beats_the_bodys_target_it_names(untrusted: tuple[str, FakeEngine]) -> None:
    base, _ = untrusted
    both = _complete(base, "sk-main", {TTFT: "10000"}, slo={"ttft_ms": 1000, "tpot_ms": 300})
    assert (both["slo_ttft_s"], both["slo_tpot_s"]) == (10.0, 0.3)  # TTFT from the header, TPOT from the body
    with pytest.raises(openai.RateLimitError):
        # The body asks for 10 s, the header for 1 s (raised to the class's 2 s): the header's 2 s wins.
        _complete(base, "sk-main", {TTFT: "1000"}, slo={"ttft_ms": 10000})


def test_trusted_headers_may_tighten(tmp_path: Path) -> None:
    engine, config = _server(tmp_path, trusted=True)
    with threaded_server(engine, config) as base:
        with pytest.raises(openai.RateLimitError) as err:
            _complete(base, "sk-batch", {TTFT: "1000"})  # batch's 20 s would admit it; 1 s does not
        assert "target of 1.00s" in err.value.message
        tight = _complete(base, "sk-batch", {TTFT: "9000", TPOT: "50"})
        assert (tight["slo_class"], tight["slo_ttft_s"], tight["slo_tpot_s"]) == ("batch", 9.0, 0.05)


BAD_VALUES = ["fast", "-5", "0", "0.0", "1e3", "nan", "inf", "+100", "100ms", "", "3600001", "9" * 400]


@pytest.mark.parametrize("header", [TTFT, TPOT])
@pytest.mark.parametrize("value", BAD_VALUES)
def test_bad_header_values_are_400_naming_the_header(
    untrusted: tuple[str, FakeEngine], header: str, value: str
) -> None:
    base, engine = untrusted
    calls = engine.generate_calls
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(
        f"{base}/v1/completions", json=body, headers={"authorization": "Bearer sk-main", header: value}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", header)
    assert engine.generate_calls == calls  # nothing was queued


def test_a_repeated_header_is_400(untrusted: tuple[str, FakeEngine]) -> None:
    base, engine = untrusted
    calls = engine.generate_calls
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
    headers = [
        ("authorization", "Bearer sk-main"),
        ("content-type", "application/json"),
        (TTFT, "5000"),
        (TTFT, "9000"),
    ]
    r = httpx.post(f"{base}/v1/completions", content=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == TTFT
    assert engine.generate_calls == calls


def test_serve_flag_on_the_real_engine(tmp_path: Path) -> None:
    """`tailserve serve --trust-request-slo` on dummy:tiny: the chat stream and the non-streamed
    completion report the header's targets, tighter than the default class; so does the body's."""
    args = ["--model", "dummy:tiny", "--no-warmup", "--slo-ttft", "60", "--trust-request-slo"]
    with serve_process(args) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        headers = {TTFT: "30000", TPOT: "75"}
        out = client.completions.create(model="dummy-tiny", prompt="a", max_tokens=2, extra_headers=headers)
        timings = (out.model_extra or {})["tailserve_timings"]
        assert (timings["slo_class"], timings["slo_ttft_s"], timings["slo_tpot_s"]) == (
            "interactive",
            30.0,
            0.075,
        )
        stream = client.chat.completions.create(
            model="dummy-tiny",
            messages=[{"role": "user", "content": "a"}],
            max_tokens=2,
            stream=True,
            extra_headers=headers,
        )
        finals = [
            c.model_extra["tailserve_timings"]
            for c in stream
            if (c.model_extra or {}).get("tailserve_timings")
        ]
        assert [(t["slo_ttft_s"], t["slo_tpot_s"]) for t in finals] == [(30.0, 0.075)]
        body = {"slo": {"ttft_ms": 20000}}
        out = client.completions.create(model="dummy-tiny", prompt="a", max_tokens=2, extra_body=body)
        assert (out.model_extra or {})["tailserve_timings"]["slo_ttft_s"] == 20.0
