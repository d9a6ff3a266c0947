"""A real server on the default model in fp32, shared by the echo / best_of tests and the lm-eval test
(their values are checked against the fp32 in-process engine of tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.harness import serve_process

FP32_ARGS = [
    "--model",
    "default",
    "--weight-format",
    "fp32",
    "--max-model-len",
    "512",
    "--kv-cache-memory",
    "64MiB",
]


@pytest.fixture(scope="session")
def smol_fp32() -> Iterator[str]:
    """Base URL of `tailserve serve` on SmolLM2 in fp32 (lax TTFT and TPOT targets: the box is shared,
    and these tests are not about admission)."""
    with serve_process([*FP32_ARGS, "--slo-ttft", "60", "--slo-tpot", "60"], ready_timeout_s=240) as server:
        yield server.base
