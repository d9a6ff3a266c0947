"""`tailserve plan` / `tailserve doctor` from the command line: reports, JSON, exit codes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tailserve.plan import cli


def run(argv: list[str]) -> int:
    """Parse with only the plan package's sub-commands and run the handler."""
    parser = argparse.ArgumentParser(prog="tailserve")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_plan_report_shows_both_kv_formulas_and_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(["plan", "--model", "Llama-3-70B", "--gpu", "H200", "--dtype", "fp16", "--context", "8192"]) == 0
    )
    out = capsys.readouterr().out
    assert "141.11 GB total" in out
    assert "0.328 MB = 2 x 80 layers x 8 KV heads x 128 head_dim x 2 B" in out
    assert "2.62 MB = 2 x 80 layers x 8192 hidden x 2 B" in out
    assert "overstates KV 8.0x" in out
    assert "verdict" in out and "batch    1" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--json", "--concurrency", "8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpu"]["name"] == "H200 141GB"
    assert doc["kv_bytes_per_token"] == 131072
    assert 3.4e-3 <= doc["floor_batch1"]["tpot_floor_s"] <= 3.8e-3
    assert doc["fits"] and doc["meets_slo"]
    assert doc["floor_at_concurrency"]["batch"] == 8


def test_plan_with_config_json_and_user_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_attention_heads": 9,
                "num_hidden_layers": 30,
                "num_key_value_heads": 3,
                "vocab_size": 49152,
                "tie_word_embeddings": True,
                "max_position_embeddings": 8192,
            }
        )
    )
    catalog = tmp_path / "gpus.toml"
    catalog.write_text('[[gpu]]\nname = "L4"\nmemory_gib = 24\nbandwidth_gb_s = 300\n')
    assert run(["plan", "--model", str(config), "--gpu", "L4", "--gpu-catalog", str(catalog), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == 134_515_008
    assert doc["floor_batch1"]["compute_s"] is None  # no TFLOPS in the user entry: memory floor only


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "Llama-3.1-8B", "--gpu", "B300"], "unknown GPU 'B300'"),
        (["--model", "not-a-model", "--gpu", "H100"], "neither a preset"),
        (["--model", "Llama-3.1-8B", "--gpu", "H100", "--gpus", "0"], "num_gpus must be at least 1"),
    ],
)
def test_plan_bad_input_exits_non_zero_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_malformed_config_through_the_real_entry_point(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 4096}')
    result = subprocess.run(
        [sys.executable, "-m", "tailserve.cli", "plan", "--model", str(config), "--gpu", "H100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "missing required key 'num_attention_heads'" in result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_json_always_lists_host_findings(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    checks = {f["check"] for f in doc["findings"]}
    assert {"gpus", "mps", "cuda_launch_blocking", "cpu_governor"} <= checks
    assert all(f["severity"] in {"ok", "info", "warn", "critical"} for f in doc["findings"])
