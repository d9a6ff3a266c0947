"""`tailserve serve --tensor-parallel-size N` as a process: the split is logged, a killed worker fails
the requests in flight with a 5xx OpenAI error and the server exits non-zero, SIGTERM drains every
rank, and a size the model cannot split is refused before anything starts.

Real processes and the official `openai` client; dummy weights (ranks start in seconds).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.server.harness import REPO, ServerProcess, serve_process, tailserve_command

TP2 = ["--model", "dummy:tiny", "--tensor-parallel-size", "2", "--kv-cache-memory", "8MiB"]
TP2 += ["--num-threads", "1", "--log-level", "info", "--no-warmup"]


def worker_pids(server: ServerProcess) -> list[int]:
    return [
        int(p) for p in re.findall(r"started tensor-parallel worker rank \d+ \(pid (\d+)\)", server.log())
    ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0, timeout=60)


def test_killing_a_worker_fails_in_flight_requests_and_the_server_exits_non_zero() -> None:
    with serve_process(TP2) as server:
        assert "KV heads split" in server.log()
        (pid,) = worker_pids(server)
        plain: dict[str, object] = {}

        def long_plain() -> None:
            body = {"model": "dummy-tiny", "prompt": "a", "max_tokens": 1500, "ignore_eos": True}
            r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
            plain.update(status=r.status_code, body=r.json())

        thread = threading.Thread(target=long_plain)
        thread.start()
        stream = client(server).completions.create(
            model="dummy-tiny", prompt="b", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        events = iter(stream)
        next(events)  # generating
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in events:
                pass
        thread.join(timeout=30)
        assert time.monotonic() - killed < 20
        assert 500 <= int(str(plain["status"])) < 600, plain
        error = plain["body"]["error"]  # type: ignore[index]
        assert error["type"] and error["message"]
        assert server.proc.wait(timeout=30) != 0
    assert "tensor-parallel worker died" in server.log()


def test_sigterm_drains_every_rank() -> None:
    with serve_process(TP2) as server:
        (pid,) = worker_pids(server)
        stream = client(server).completions.create(
            model="dummy-tiny", prompt="c", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        events = iter(stream)
        first = next(events)
        metrics = httpx.get(f"{server.base}/metrics").text
        server.proc.send_signal(signal.SIGTERM)
        rest = list(events)
        text = first.choices[0].text + "".join(e.choices[0].text for e in rest if e.choices)
        finish = [e.choices[0].finish_reason for e in rest if e.choices and e.choices[0].finish_reason]
        assert finish == ["length"] and len(text) > 0
        for name in ("tailserve_tp_allreduce_seconds", "tailserve_tp_compute_seconds"):
            counts = re.findall(rf'^{name}_count{{kind="\w+"}} (\S+)$', metrics, re.M)
            assert sum(float(c) for c in counts) >= 1, name
        assert server.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the worker outlived the server"


def test_a_size_the_model_cannot_split_is_refused_before_anything_starts() -> None:
    cmd = tailserve_command("serve", "--model", "dummy:tp-qwen2", "--tensor-parallel-size", "4")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 2
    assert "does not divide the model's 14 query heads" in done.stderr
    assert "started tensor-parallel worker" not in done.stderr
