"""`tailserve serve --replicas N`: child flags, ports, GPUs, readiness, and children ending with it."""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tailserve.cli import build_parser
from tailserve.router import launcher
from tests.router.fake_replica import free_port
from tests.server.harness import running_process, tailserve_command

ROOT = Path(__file__).resolve().parents[2]


def test_strip_own_flags_keeps_the_rest() -> None:
    argv = ["--model", "dummy:tiny", "--replicas", "3", "--port=9000", "--host", "0.0.0.0", "--no-warmup"]
    assert launcher.strip_own_flags(argv + ["--api-key", "s3cret"]) == [
        "--model",
        "dummy:tiny",
        "--no-warmup",
    ]


def test_replica_flags_from_argv_or_namespace() -> None:
    args = argparse.Namespace(model="dummy:tiny", port=8000, host="h", replicas=2, no_warmup=True, dtype=None)
    from_argv = launcher.replica_flags(args, ["tailserve", "serve", "--model", "m", "--replicas", "2"])
    assert from_argv == ["--model", "m"]
    assert launcher.replica_flags(args, ["pytest"]) == ["--model", "dummy:tiny", "--no-warmup"]


def test_namespace_flags_round_trip_through_the_serve_parser() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "dummy:tiny", "--replicas", "2", "--no-prefix-caching"])
    child = parser.parse_args(["serve", *launcher.flags_from_namespace(args), "--port", "1234"])
    for name, value in vars(args).items():
        if name not in {"port", "replicas", "func", "api_key"}:
            assert getattr(child, name) == value, name
    assert child.replicas == 1


def test_consecutive_free_ports_skips_busy_ones() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = launcher.consecutive_free_ports(2, taken - 1)
    assert taken not in ports and ports[1] == ports[0] + 1
    assert launcher.consecutive_free_ports(1, 20000, avoid=20000) != [20000]


def test_child_env_pins_one_gpu_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    gpus = launcher.visible_gpus()
    assert gpus == ["2", "5"]
    assert [launcher.child_env(i, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2", "5", "2"]
    assert launcher.child_env(0, ["0"])["CUDA_VISIBLE_DEVICES"] == "2,5"  # one GPU: left as is
    assert launcher.child_env(0, [], api_key="k")[launcher.API_KEY_ENV] == "k"


def _fake(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.router.fake_replica", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_wait_ready_and_terminate() -> None:
    ports = [free_port(), free_port()]
    children = [_fake(p) for p in ports]
    try:
        launcher.wait_ready([f"http://127.0.0.1:{p}" for p in ports], children, timeout_s=60)
    finally:
        launcher.terminate(children, grace_s=10)
    assert all(c.returncode is not None for c in children)


def test_wait_ready_fails_fast_when_a_child_exits() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3"):
        launcher.wait_ready(["http://127.0.0.1:9"], [dead], timeout_s=60)


def test_serve_replicas_end_to_end() -> None:
    # The replicas take the ports right above the router's. A port from free_port() is an ephemeral
    # one, and the test's own /ready polls open connections from ephemeral source ports, which can
    # take a replica's port before the replica binds it (seen once in a full suite). Below the
    # ephemeral range, only listeners compete.
    port = launcher.consecutive_free_ports(3, random.randrange(20000, 30000))[0]
    cmd = tailserve_command("serve", "--model", "dummy:tiny", "--replicas", "2")
    cmd += ["--port", str(port), "--log-level", "warning", "--drain-timeout", "2"]
    with running_process(cmd, port, ready_timeout_s=180, env={"OMP_NUM_THREADS": "1"}) as router:
        rows = httpx.get(router.base + "/router/replicas").json()["replicas"]
        replica_ports = [int(r["url"].rsplit(":", 1)[1]) for r in rows]
        assert len(rows) == 2 and replica_ports[1] == replica_ports[0] + 1
        body = {"model": "dummy-tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(router.base + "/v1/completions", json=body, timeout=60).json()["choices"]
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=60) == 0  # the router drains and exits 0, as the server does
    for p in replica_ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
