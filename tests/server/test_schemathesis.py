"""schemathesis (property-based fuzzing from /openapi.json) against a live server: no 5xx, every
status and body as the schema documents it (so every 4xx is OpenAI error JSON), streams included.
A bounded, seeded run: about 25 examples per operation plus schemathesis' coverage cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.harness import serve_process

pytest.importorskip("schemathesis")
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def _with_served_model(schema: dict, name: str) -> dict:
    """The schema with `model` pinned to the served name, so generated requests reach generation
    instead of stopping at 404 (any other name is a documented 404, tested elsewhere)."""
    for model in schema["components"]["schemas"].values():
        if "model" in model.get("properties", {}) and model.get("title", "").endswith("Request"):
            model["properties"]["model"] = {"const": name}
    return schema


def test_fuzzing_finds_no_5xx_and_no_schema_violation(tmp_path: Path) -> None:
    args = ["--model", "dummy:tiny", "--max-model-len", "256", "--slo-ttft", "60", "--slo-tpot", "60"]
    with serve_process(args) as server:
        (name,) = [m["id"] for m in httpx.get(f"{server.base}/v1/models").json()["data"]]
        schema = _with_served_model(httpx.get(f"{server.base}/openapi.json").json(), name)
        path = tmp_path / "openapi.json"
        path.write_text(json.dumps(schema))
        run = subprocess.run(
            [str(SCHEMATHESIS), "run", str(path), "--url", server.base, "--checks", CHECKS]
            + ["--max-examples", "25", "--seed", "41", "--workers", "1", "--request-timeout", "60"]
            + ["--no-color", "--continue-on-failure", "--phases", "examples,coverage,fuzzing"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert server.proc.poll() is None, server.log()
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    operations = sum(
        method in ("get", "post", "put", "patch", "delete")
        for route in schema["paths"].values()
        for method in route
    )
    assert operations >= 11, schema["paths"].keys()
    assert f"{operations} selected" in run.stdout  # every documented operation was fuzzed
