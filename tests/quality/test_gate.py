"""The quality gate on the real default model: fp32 agrees with itself exactly, bf16 passes, a broken
format fails and is refused, results are cached (and re-measured when the thresholds change), and
`tailserve eval` exits 0 / 1 / 2. Plans are small (a few hundred tokens) so the file stays quick."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tailserve.errors import ConfigError
from tailserve.model.transformer import TransformerLM
from tailserve.quality.cache import fingerprint
from tailserve.quality.evaluate import EvalPlan
from tailserve.quality.gate import (
    GateThresholds,
    QualityGate,
    build_format_model,
    candidate_formats,
    choose_weight_format,
)
from tailserve.weights.loader import LoadedModel

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread here: on 2 busy cores a second thread made every step wait for a descheduled one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = EvalPlan(tokens=128, window_tokens=32, prefill_chunk_tokens=8, greedy_prompts=2, greedy_tokens=4)
# 512 rows a phase: bf16's ~97% top-1 clears the per-phase 95% by ~3 standard errors.
SMALL = EvalPlan(tokens=1024, window_tokens=64, prefill_chunk_tokens=16, greedy_prompts=4, greedy_tokens=8)
LENIENT = GateThresholds(min_top1=0.8, max_ppl_ratio=1.05)  # TINY's 64 rows a phase are too few for 95%


def scrambled_scales(
    loaded: LoadedModel, weight_format: str, kv: str, max_positions: int, device: torch.device
) -> TransformerLM:
    """Test-only broken format: every linear weight's groups of 32 inputs scaled by a random factor
    in [0.25, 1.75], as if int4 block scales had been read from the wrong place."""
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, w in loaded.weights.items():
        if name.endswith("proj.weight"):
            n, k = w.shape
            factor = 0.25 + 1.5 * torch.rand(n, k // 32, 1, generator=gen)
            w = (w.view(n, k // 32, 32) * factor).view(n, k)
        weights[name] = w
    broken = LoadedModel(loaded.name, loaded.arch, weights, loaded.tokenizer, loaded.load_s)
    return build_format_model(broken, "bf16", "bf16", max_positions, device)


@pytest.fixture(scope="module")
def references(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 reference traces of both plans, traced once for the module (tests copy them)."""
    cache = tmp_path_factory.mktemp("references")
    for plan in (TINY, SMALL):
        QualityGate("default", CPU, plan=plan, cache_dir=cache, loaded=smol).reference_trace()
    return cache


@pytest.fixture
def cache(references: Path, tmp_path: Path) -> Path:
    """An empty result cache holding only the fp32 reference traces."""
    for f in references.glob("reference-*.json"):
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def gate(loaded: LoadedModel, cache: Path, plan: EvalPlan = TINY, **kwargs: object) -> QualityGate:
    return QualityGate("default", CPU, plan=plan, cache_dir=cache, loaded=loaded, **kwargs)  # type: ignore[arg-type]


def test_fp32_against_itself_is_exact(smol: LoadedModel, cache: Path) -> None:
    r = gate(smol, cache).result("fp32")
    assert r.top1 == 1.0 and r.ppl_ratio == 1.0
    assert r.prefill_top1 == r.decode_top1 == 1.0 and r.greedy_identical == 1.0
    assert r.passed and r.tokens == TINY.scored_tokens and r.kv_cache_dtype == "fp32"
    assert 1.0 < r.ppl_ref < 1000.0  # real text through a real model, not noise


def test_bf16_passes_the_gate(smol: LoadedModel, cache: Path) -> None:
    r = gate(smol, cache, SMALL).result("bf16")
    assert r.passed, r.summary()
    assert r.top1 >= 0.95 and r.ppl_ratio <= 1.01
    assert r.prefill_top1 < 1.0 or r.decode_top1 < 1.0  # bf16 really ran: not the fp32 model again


def test_broken_format_fails_and_is_refused_unless_forced(smol: LoadedModel, cache: Path) -> None:
    g = gate(smol, cache, SMALL, build=scrambled_scales)
    r = g.result("bf16")
    assert not r.passed
    assert r.top1 < 0.95 or r.ppl_ratio > 1.01, r.summary()
    # The failing figures are now cached for bf16: the start-up hook refuses it, or serves it if forced.
    with pytest.raises(ConfigError, match="--force-weight-format"):
        choose_weight_format("default", "bf16", CPU, cache_dir=cache, plan=SMALL, loaded=smol)
    forced = choose_weight_format(
        "default", "bf16", CPU, force=True, cache_dir=cache, plan=SMALL, loaded=smol
    )
    assert forced.weight_format == "bf16" and forced.gate is not None and not forced.gate.passed


def test_auto_serves_the_fastest_format_that_passed(smol: LoadedModel, cache: Path) -> None:
    candidates = candidate_formats(CPU)
    assert candidates and candidates[-1] == "bf16"
    broken = gate(smol, cache, build=scrambled_scales, thresholds=LENIENT)
    for fmt in candidates:
        assert not broken.result(fmt).passed  # every candidate cached as failing...
    auto = {"cache_dir": cache, "plan": TINY, "thresholds": LENIENT}
    assert choose_weight_format("default", "auto", CPU, **auto).weight_format == "fp32"  # type: ignore[arg-type]
    good = gate(smol, cache, thresholds=LENIENT)
    assert good.result("bf16", use_cache=False).passed  # ...then bf16 measured for real
    choice = choose_weight_format("default", "auto", CPU, **auto)  # type: ignore[arg-type]
    assert choice.weight_format == "bf16" and choice.gate is not None and choice.gate.origin == "cache"


def test_cache_is_read_back_and_keyed_by_thresholds(smol: LoadedModel, cache: Path) -> None:
    first = gate(smol, cache)
    measured = first.result("bf16")
    assert measured.origin == "measured" and first.num_measured == 1
    again = gate(smol, cache)
    hit = again.result("bf16")
    assert hit.origin == "cache" and again.num_measured == 0
    assert (hit.top1, hit.ppl_ratio, hit.passed) == (measured.top1, measured.ppl_ratio, measured.passed)
    stricter = gate(smol, cache, thresholds=GateThresholds(min_top1=0.95, max_ppl_ratio=0.5))
    strict = stricter.result("bf16")
    assert strict.origin == "measured" and stricter.num_measured == 1
    assert not strict.passed and strict.top1 == measured.top1  # same figures, different verdict


def test_a_changed_kernel_plan_is_measured_again(
    smol: LoadedModel, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tailserve.model import plans as formats
    from tailserve.model.transformer import FormatPlan

    gate(smol, cache).result("bf16")
    monkeypatch.setitem(formats.PLANS, "bf16", FormatPlan(decode="bf16", prefill="bf16", head="fp32"))
    again = gate(smol, cache)
    assert again.result("bf16").origin == "measured" and again.num_measured == 1


def test_corrupt_or_stale_cache_is_ignored_with_a_warning(
    smol: LoadedModel, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate(smol, cache).result("fp32")
    (path,) = cache.glob("fp32-*.json")
    entry = json.loads(path.read_text())
    caplog.set_level(logging.WARNING)
    path.write_text("{not json")
    assert gate(smol, cache).cached("fp32") is None
    assert "unreadable" in caplog.text
    entry["key"]["model_fingerprint"] = "0" * 64
    path.write_text(json.dumps(entry))
    assert gate(smol, cache).cached("fp32") is None
    assert "stale" in caplog.text
    entry = json.loads(path.read_text())
    entry["key"]["model_fingerprint"] = fingerprint("default")
    entry["result"]["top1"] = "high"
    path.write_text(json.dumps(entry))
    assert gate(smol, cache).cached("fp32") is None
    assert "corrupt" in caplog.text


def test_dummy_and_fp32_skip_the_gate(tmp_path: Path) -> None:
    assert choose_weight_format("dummy:tiny", "bf16", CPU, cache_dir=tmp_path) == ("bf16", None)
    assert choose_weight_format("dummy:tiny", "auto", CPU, cache_dir=tmp_path).gate is None
    assert choose_weight_format("default", "fp32", CPU, cache_dir=tmp_path) == ("fp32", None)
    assert not list(tmp_path.iterdir())  # nothing measured, nothing cached


def _eval(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tailserve.cli", "eval", "--tokens", "64", "--greedy-prompts", "2"]
    cmd += ["--greedy-tokens", "4", "--num-threads", "1", "--cache-dir", str(cache), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def test_eval_cli_exit_codes(tmp_path: Path) -> None:
    ok = _eval(tmp_path, "--weight-format", "fp32", "--json")
    assert ok.returncode == 0, ok.stderr
    row = json.loads(ok.stdout.splitlines()[-1])
    assert row["weight_format"] == "fp32" and row["top1"] == 1.0 and row["passed"]
    failing = _eval(tmp_path, "--weight-format", "bf16", "--max-ppl-ratio", "0.5")  # bf16 cannot meet it
    assert failing.returncode == 1, failing.stderr
    assert "FAIL" in failing.stdout and "ratio" in failing.stdout
    assert _eval(tmp_path, "--model", "dummy:tiny").returncode == 2
    assert _eval(tmp_path, "--model", str(tmp_path / "missing.gguf")).returncode == 2
