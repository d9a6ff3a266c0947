"""GPU catalog: spec-sheet entries, forgiving lookup, user files in JSON and TOML, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailserve.plan.catalog import GpuCatalog, build_catalog
from tailserve.plan.errors import PlanError


@pytest.mark.parametrize(
    ("name", "memory_gib", "bandwidth_gb_s"),
    [
        ("T4", 16, 320),
        ("RTX 3090", 24, 936),
        ("V100S", 32, 1134),
        ("A100 40GB", 40, 1555),
        ("A100 80GB", 80, 2039),
        ("H100 SXM 80GB", 80, 3350),
        ("H200 141GB", 141, 4800),
    ],
)
def test_builtin_cards_match_the_spec(name: str, memory_gib: float, bandwidth_gb_s: float) -> None:
    gpu = GpuCatalog().get(name)
    assert (gpu.memory_gib, gpu.bandwidth_gb_s) == (memory_gib, bandwidth_gb_s)


def test_dense_tflops_only_where_the_card_has_tensor_cores() -> None:
    catalog = GpuCatalog()
    assert "bf16" not in catalog.get("T4").dense_tflops  # Turing: fp16 only
    assert "fp8" not in catalog.get("A100 80GB").dense_tflops  # Ampere: no fp8
    assert catalog.get("H100").dense_tflops["bf16"] == 989  # dense, not the 1979 sparse headline
    assert catalog.get("H200").dense_tflops["fp8"] == 1979


@pytest.mark.parametrize("spelling", ["h100", "H100-SXM", "h100 sxm 80gb", "H100_SXM_80GB"])
def test_lookup_ignores_case_and_separators(spelling: str) -> None:
    assert GpuCatalog().get(spelling).name == "H100 SXM 80GB"


def test_unknown_gpu_lists_the_catalog() -> None:
    with pytest.raises(PlanError, match=r"unknown GPU 'B300'.*H200 141GB"):
        GpuCatalog().get("B300")


def test_catalog_specs_cannot_be_edited() -> None:
    with pytest.raises(TypeError):
        GpuCatalog().get("T4").dense_tflops["fp8"] = 1.0  # type: ignore[index]


def test_user_toml_adds_a_card(tmp_path: Path) -> None:
    path = tmp_path / "gpus.toml"
    path.write_text(
        '[[gpu]]\nname = "L40S"\nmemory_gib = 48\nbandwidth_gb_s = 864\naliases = ["l40s-48"]\n'
        "[gpu.dense_tflops]\nbf16 = 362\nfp8 = 733\n"
    )
    gpu = build_catalog(path).get("l40s-48")
    assert (gpu.name, gpu.memory_bytes, gpu.dense_tflops["fp8"]) == ("L40S", 48 << 30, 733)


def test_user_json_overrides_a_builtin(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps([{"name": "T4", "memory_gib": 15, "bandwidth_gb_s": 300}]))
    catalog = build_catalog(path)
    assert catalog.get("t4").memory_gib == 15
    assert catalog.names().count("T4") == 1


@pytest.mark.parametrize(
    ("suffix", "text", "message"),
    [
        (".json", "{", "not valid json"),
        (".toml", "[[gpu]\n", "not valid toml"),
        (".json", '{"gpus": [{"name": "X"}]}', "lacks 'memory_gib'"),
        (".json", '{"gpus": [{"name": "X", "memory_gib": 8, "bandwidth_gb_s": -1}]}', "must be positive"),
        (
            ".json",
            '{"gpus": [{"name": "X", "memory_gib": 8, "bandwidth_gb_s": 1, "dense_tflops": {"fp4": 9}}]}',
            "fp4",
        ),
        (".json", '{"cards": []}', "expected a list"),
    ],
)
def test_malformed_catalog_file_is_a_clear_error(
    tmp_path: Path, suffix: str, text: str, message: str
) -> None:
    path = tmp_path / f"gpus{suffix}"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        build_catalog(path)
