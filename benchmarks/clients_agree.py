"""Do third-party benchmark clients agree with `tailserve bench`? One tailserve server (core 0, one
thread) measured in turn by `tailserve bench`, `vllm bench serve`, NVIDIA aiperf and guidellm (each on
core 1, its CPU time recorded), all sending the same prompts at the same Poisson arrival times, then
one table of TTFT / TPOT / E2E means, P50s and P99s with 95% intervals from each tool's per-request data.

Steps (each its own command, so a shared box can take a lock around each client in turn):
    prepare   the workload: N prompts of exactly --input-len tokens, vLLM's Poisson schedule, one file per tool
    serve     start the server (taskset -c 0, --num-threads 1), wait until ready, warm it up; with --fake
              the scripted server of tests/bench instead (known latencies: each client's own error)
    client    run one client (tailserve | vllm | aiperf | guidellm) against it; --label/--cpus/--env for variants
    stop      stop the server
    table     the comparison table from every client run found in --out
    all       all of the above in one go (~4.5 min per client)

    .venv/bin/python benchmarks/clients_agree.py all --out bench-results/clients
The third-party tools live in venvs of their own (--guidellm, --aiperf, TAILSERVE_BENCH_VENVS for vLLM);
see docs/BENCH.md, "Third-party clients on the same server", for the definitions each tool uses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from loadgen import raise_priority
from machine import cpu_shares, cpu_times, git_commit, machine_line
from proc import get_json, http_status, post_json, thread_env

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
HF_DIR = ROOT / "benchmarks" / ".models" / "smollm2-hf"
CLIENTS = ("tailserve", "vllm", "aiperf", "guidellm")
FAKE_MODEL, FAKE_TTFT_S, FAKE_GAP_S = "SmolLM2-135M-Instruct", 0.060, 0.016  # the scripted server's answer
CLIENT_ENV = {**thread_env(1), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


@dataclass(frozen=True)
class Workload:
    """What every client sends: `requests` prompts of `input_len` tokens, each answered with `output_len`
    tokens (ignore_eos), at vLLM's Poisson send times for `rate` and `seed` (workload.json keeps them)."""

    requests: int
    rate: float
    seed: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Request:
    """One request as a tool recorded it, in seconds; `sent_s` is relative to the tool's first send."""

    sent_s: float
    ttft_s: float
    e2e_s: float
    output_tokens: int
    tool_tpot_s: float | None  # the tool's own per-request TPOT / ITL figure, as it defines it

    @property
    def tpot_s(self) -> float:
        """One definition for all tools: (E2E - TTFT) / (output tokens - 1)."""
        return (self.e2e_s - self.ttft_s) / max(1, self.output_tokens - 1)


# ---------------------------------------------------------------- prepare


def vllm_poisson_offsets(requests: int, rate: float, seed: int) -> list[float]:
    """The send times `vllm bench serve --request-rate RATE --seed SEED` uses (serve.py get_request:
    np.random.seed(seed), gamma(1, 1/rate) gaps, cumulated, scaled so the last is requests / rate),
    shifted so the first is 0. Replaying them lets the other tools send at vLLM's times."""
    np.random.seed(seed)
    gaps = [float(np.random.gamma(shape=1.0, scale=1.0 / rate)) for _ in range(requests)]
    times = np.cumsum(gaps)
    times *= (requests / rate) / times[-1]
    return [float(t - times[0]) for t in times]


def prepare(out: Path, load: Workload, tokenizer_dir: Path) -> None:
    """Prompts of exactly input_len tokens (tailserve bench's corpus cutter) and vLLM's schedule, written
    in each tool's input format."""
    from tailserve.bench.corpus import PromptSource
    from tailserve.bench.tokenizers import load_tokenizer

    source = PromptSource(load_tokenizer(str(tokenizer_dir)))
    rng = np.random.default_rng(load.seed)
    prompts: list[str] = []
    while len(prompts) < load.requests:  # a cut that re-encodes one token short is drawn again
        prompt = source.cut(load.input_len, rng)
        if source.tokenizer.count(prompt) == load.input_len:
            prompts.append(prompt)
    offsets = vllm_poisson_offsets(load.requests, load.rate, load.seed)
    out.mkdir(parents=True, exist_ok=True)
    n = load.output_len
    rows: dict[str, list[dict[str, Any]]] = {
        "tailserve-trace.jsonl": [
            {"timestamp": t, "prompt": p, "output_tokens": n} for t, p in zip(offsets, prompts, strict=True)
        ],
        "aiperf-trace.jsonl": [
            {"text": p, "timestamp": round(t * 1000, 3), "output_length": n}
            for t, p in zip(offsets, prompts, strict=True)
        ],
        "guidellm-trace.jsonl": [
            {
                "prompt": p,
                "prompt_tokens_count": load.input_len,
                "output_tokens_count": n,
                "relative_timestamp": t,
            }
            for t, p in zip(offsets, prompts, strict=True)
        ],
    }
    for name, lines in rows.items():
        (out / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    sharegpt = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": ""}]} for p in prompts
    ]
    (out / "vllm-prompts.json").write_text(json.dumps(sharegpt))
    (out / "workload.json").write_text(json.dumps({**asdict(load), "offsets_s": offsets}, indent=1))


# ---------------------------------------------------------------- server


def serve(out: Path, port: int, core: str) -> None:
    """tailserve on `core` with one compute thread, detached (pid in server.pid), ready and warmed up."""
    log = (out / "server.log").open("ab")
    command = ["taskset", "-c", core, str(PYTHON), "-m", "tailserve.cli", "serve", "--model", "default"]
    command += ["--port", str(port), "--num-threads", "1", "--log-level", "warning"]
    # the clients send the same prompts: no client may find another's prompts in the prefix cache
    command += ["--disable-uvicorn-access-log", "--no-enable-prefix-caching"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    (out / "server.pid").write_text(str(proc.pid))
    (out / "server.port").write_text(str(port))
    deadline = time.monotonic() + 300
    while http_status(f"http://127.0.0.1:{port}/ready") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(out)
            raise SystemExit(f"server did not become ready (log: {out / 'server.log'})")
        time.sleep(0.5)
    model = get_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"]
    # the first steps pay one-off costs (allocations, caches): none of them in a client's figures
    for _ in range(4):
        body = {"model": model, "prompt": "warm up " * 60, "max_tokens": 16, "ignore_eos": True}
        post_json(f"http://127.0.0.1:{port}/v1/completions", body)


def serve_fake(out: Path, core: str, load: Workload) -> None:
    """The scripted SSE server of tests/bench (FAKE_TTFT_S, then a token every FAKE_GAP_S, from each
    request's arrival) instead of tailserve: the latencies are known, so what differs between clients is
    the clients. It logs each request's arrival and chunk emission times (GET /_log)."""
    command = ["taskset", "-c", core, str(PYTHON), str(ROOT / "tests" / "bench" / "fake_server.py")]
    command += ["--model", FAKE_MODEL]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True, cwd=ROOT, text=True)
    (out / "server.pid").write_text(str(proc.pid))
    assert proc.stdout is not None
    port = int(proc.stdout.readline().split()[1])
    (out / "server.port").write_text(str(port))
    (out / "server.fake").write_text(json.dumps(fake_script(load)))
    post_json(f"http://127.0.0.1:{port}/_script", fake_script(load))  # type: ignore[arg-type]


def fake_script(load: Workload) -> list[dict[str, Any]]:
    return [{"ttft_s": FAKE_TTFT_S, "itl_s": FAKE_GAP_S, "tokens": load.output_len}]


def stop(out: Path) -> None:
    pid_file = out / "server.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink()
    for name in ("server.port", "server.fake"):
        (out / name).unlink(missing_ok=True)


def core_busy_s() -> dict[str, float]:
    """Busy seconds (user + nice + system + irq + softirq) and steal of each core so far, from /proc/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    busy: dict[str, float] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            v = [int(x) for x in fields[:8]]
            busy[name] = (v[0] + v[1] + v[2] + v[5] + v[6]) / tick
            busy[name + "_steal"] = v[7] / tick
    return busy


def server_cpu_s(out: Path) -> float | None:
    """The server process's user + system CPU seconds so far (None when it is not running)."""
    try:
        fields = (
            Path(f"/proc/{int((out / 'server.pid').read_text())}/stat").read_text().rsplit(")", 1)[1].split()
        )
    except (OSError, ValueError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- clients


def client_command(
    name: str, out: Path, label: str, port: int, load: Workload, tools: argparse.Namespace
) -> list[str]:
    url = f"http://127.0.0.1:{port}"
    run = out / label
    if name == "tailserve":
        command = [
            str(PYTHON),
            "-m",
            "tailserve.cli",
            "bench",
            "--base-url",
            url,
            "--endpoint",
            "completions",
        ]
        trace = out / "tailserve-trace.jsonl"
        if tools.trace_from:  # another client's actual send times and prompts
            trace = trace_from_guidellm(out, tools.trace_from, load.output_len)
        command += ["--tokenizer", str(tools.tokenizer), "--trace", str(trace)]
        return command + ["--warmup", "0", "--no-html", "--no-progress", "--out", str(run)]
    if name == "vllm":
        command = [
            str(PYTHON),
            "-m",
            "peers.vllm_bench",
            "--base-url",
            url,
            "--input-len",
            str(load.input_len),
        ]
        command += ["--output-len", str(load.output_len), "--num-prompts", str(load.requests)]
        command += [
            "--request-rate",
            f"{load.rate:g}",
            "--seed",
            str(load.seed),
            "--tokenizer",
            str(tools.tokenizer),
        ]
        return command + ["--dataset", str(out / "vllm-prompts.json"), "--out", str(run) + ".json"]
    model = get_json(f"{url}/v1/models")["data"][0]["id"]
    if name == "aiperf":
        command = [
            str(tools.aiperf),
            "profile",
            "--model",
            model,
            "--url",
            url,
            "--endpoint-type",
            "completions",
        ]
        command += [
            "--streaming",
            "--tokenizer",
            str(tools.tokenizer),
            "--input-file",
            str(out / "aiperf-trace.jsonl"),
        ]
        command += [
            "--custom-dataset-type",
            "single_turn",
            "--fixed-schedule",
            "--fixed-schedule-auto-offset",
        ]
        command += ["--extra-inputs", "ignore_eos:true", "--random-seed", str(load.seed), "--ui-type", "none"]
        return command + ["--output-artifact-dir", str(run), "--no-server-metrics", "--no-gpu-telemetry"]
    if name == "guidellm":
        command = [str(tools.guidellm), "run", "--backend"]
        command += [f"kind=openai_http,target={url},model={model},request_format=/v1/completions"]
        if tools.guidellm_profile == "poisson":  # its own arrivals at the same rate, same prompts in order
            command += [
                "--profile",
                f"kind=poisson,rate={load.rate:g}",
                "--seed",
                f"kind=static,value={load.seed}",
            ]
            command += ["--constraint", f"kind=max_requests,count={load.requests}"]
        else:
            command += ["--profile", "kind=replay,schedule_turn=timestamp"]
        command += ["--data", f"kind=json_file,path={out / 'guidellm-trace.jsonl'}"]
        command += ["--tokenizer", f"kind=hf_auto,model={tools.tokenizer}"]
        return command + ["--output", f"kind=json,path={run}.json", "--disable-progress"]
    raise SystemExit(f"unknown client {name!r}: one of {', '.join(CLIENTS)}")


def trace_from_guidellm(out: Path, label: str, output_len: int) -> Path:
    """A `tailserve bench` trace of what a guidellm run really sent: its requests' start times and prompts."""
    doc = json.loads((out / f"{label}.json").read_text())
    runs = doc["benchmarks"][0]["requests"]
    rows = [r for kind in ("successful", "errored", "incomplete") for r in runs[kind]]
    lines = [
        {
            "timestamp": r["request_start_time"],
            "prompt": json.loads(r["request_args"])["body"]["prompt"],
            "output_tokens": output_len,
        }
        for r in rows
    ]
    path = out / f"{label}-sent.trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in sorted(lines, key=lambda x: x["timestamp"])))
    return path


def run_client(
    name: str,
    out: Path,
    label: str,
    port: int,
    load: Workload,
    tools: argparse.Namespace,
    cpus: str,
    env: list[str],
) -> None:
    """One client pinned to `cpus`; its own and the server's CPU seconds go to LABEL.cpu.json."""
    if (out / "server.port").exists():
        port = int((out / "server.port").read_text())
    command = ["taskset", "-c", cpus, *client_command(name, out, label, port, load, tools)]
    extra = dict(item.split("=", 1) for item in env)
    child_env = {**os.environ, **CLIENT_ENV, "PYTHONPATH": str(ROOT / "benchmarks"), **extra}
    # aiperf 0.13.0 offline takes a tokenizer directory for a hub id and fails to load it
    if name == "aiperf":
        child_env.pop("HF_HUB_OFFLINE")
        child_env.pop("TRANSFORMERS_OFFLINE")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_before, machine_before, cores_before, t0 = (
        server_cpu_s(out),
        cpu_times(),
        core_busy_s(),
        time.monotonic(),
    )
    with (out / f"{label}.console.txt").open("wb") as console:
        rc = subprocess.run(
            command,
            stdout=console,
            stderr=subprocess.STDOUT,
            env=child_env,
            preexec_fn=raise_priority,
            cwd=ROOT,
        ).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic() - t0
    server_after = server_cpu_s(out)
    cores = {k: v - cores_before.get(k, 0.0) for k, v in core_busy_s().items()}
    cpu: dict[str, Any] = {
        "client": name,
        "cpus": cpus,
        "env": extra,
        "rc": rc,
        "wall_s": wall,
        "user_s": after.ru_utime - before.ru_utime,
        "sys_s": after.ru_stime - before.ru_stime,
        "server_cpu_s": None
        if server_before is None or server_after is None
        else server_after - server_before,
        "machine": cpu_shares(machine_before, cpu_times()),
        "core_busy_s": cores,  # everything on each core over the run: server + client + anyone else
        "command": command,
    }
    (out / f"{label}.cpu.json").write_text(json.dumps(cpu, indent=1))
    if (out / "server.fake").exists():  # what the scripted server saw and sent, then a fresh log
        (out / f"{label}.server.json").write_text(json.dumps(get_json(f"http://127.0.0.1:{port}/_log")))
        post_json(f"http://127.0.0.1:{port}/_script", fake_script(load))  # type: ignore[arg-type]
    print(f"{label}: rc {rc}, {wall:.0f} s, client CPU {cpu['user_s'] + cpu['sys_s']:.1f} s", flush=True)
    if rc != 0:
        raise SystemExit(f"{label} failed: see {out / (label + '.console.txt')}")


# ---------------------------------------------------------------- per-request data, one reader per tool


def read_tailserve(path: Path) -> list[Request]:
    rows = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("ok")]
    t0 = min(r["sent_s"] for r in rows)
    return [Request(r["sent_s"] - t0, r["ttft_s"], r["e2e_s"], r["output_tokens"], r["tpot_s"]) for r in rows]


def read_vllm(path: Path) -> list[Request]:
    doc = json.loads(path.with_suffix(".json").read_text())
    starts, ttfts, itls, lens = doc["start_times"], doc["ttfts"], doc["itls"], doc["output_lens"]
    t0 = min(starts)
    out: list[Request] = []
    for start, ttft, gaps, n in zip(starts, ttfts, itls, lens, strict=True):
        if not ttft or n < 1:
            continue
        e2e = ttft + sum(gaps)  # vLLM's latency: the last chunk's arrival (its ITLs are the chunk gaps)
        out.append(Request(start - t0, ttft, e2e, n, (e2e - ttft) / max(1, n - 1)))
    return out


def read_aiperf(path: Path) -> list[Request]:
    [export] = path.glob("**/profile_export.jsonl")
    out: list[Request] = []
    rows = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    t0 = min(r["metadata"]["request_start_ns"] for r in rows)
    for r in rows:
        m = r["metrics"]
        if "time_to_first_token" not in m or r.get("error"):
            continue
        ms = {k: v["value"] for k, v in m.items() if isinstance(v, dict) and "value" in v}
        itl = ms.get("inter_token_latency")
        out.append(
            Request(
                (r["metadata"]["request_start_ns"] - t0) / 1e9,
                ms["time_to_first_token"] / 1e3,
                ms["request_latency"] / 1e3,
                # the server's count (usage); aiperf's own OSL re-tokenizes the text, which can differ
                int(ms.get("usage_completion_tokens", ms["output_sequence_length"])),
                None if itl is None else itl / 1e3,
            )
        )
    return out


def read_guidellm(path: Path) -> list[Request]:
    doc = json.loads(path.with_suffix(".json").read_text())
    requests = doc["benchmarks"][0]["requests"]["successful"]
    t0 = min(r["request_start_time"] for r in requests)
    out: list[Request] = []
    for r in requests:
        e2e = r["request_latency"]  # request_end - request_start
        n = int(r["output_tokens"])
        # its own "time_per_output_token_ms" is E2E / output tokens (TTFT included)
        out.append(Request(r["request_start_time"] - t0, r["time_to_first_token_ms"] / 1e3, e2e, n, e2e / n))
    return out


READERS: dict[str, Callable[[Path], list[Request]]] = {
    "tailserve": read_tailserve,
    "vllm": read_vllm,
    "aiperf": read_aiperf,
    "guidellm": read_guidellm,
}


# ---------------------------------------------------------------- statistics and the table


def order_stat_interval(
    values: Sequence[float], q: float, level: float = 0.95
) -> tuple[float | None, float | None]:
    """A distribution-free interval for the q-quantile (0 < q < 1): sorted values at binomial ranks
    around n*q, `tailserve bench`'s method; an end is None when n is too small to have one."""
    from tailserve.bench.intervals import percentile_interval

    interval: tuple[float | None, float | None] = percentile_interval(sorted(values), q * 100, level)
    return interval


def nearest_rank(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def mean_interval(values: Sequence[float], level: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
    """Bootstrap percentile interval of the mean (seeded, so a table is reproducible)."""
    xs = np.asarray(values)
    rng = np.random.default_rng(0)
    means = xs[rng.integers(0, len(xs), size=(resamples, len(xs)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def describe(values: Sequence[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "mean": float(np.mean(ms)),
        "mean_ci": mean_interval(ms),
        "p50": nearest_rank(ms, 0.50),
        "p50_ci": order_stat_interval(ms, 0.50),
        "p99": nearest_rank(ms, 0.99),
        "p99_ci": order_stat_interval(ms, 0.99),
    }


def fmt_ci(ci: tuple[float | None, float | None]) -> str:
    lo, hi = ("-" if v is None else f"{v:.1f}" for v in ci)
    return f"[{lo}, {hi}]"


def send_pattern(sent_s: Sequence[float]) -> str:
    """How Poisson the sends were: CV of the gaps (1 for Poisson), the share of gaps within 5 ms of
    the gap before (~1% for Poisson at 1 req/s; sends jitter by a few ms around their due times), and
    the most requests sent within any one second."""
    sent = np.sort(np.asarray(sent_s))
    gaps = np.diff(sent)
    cv = float(np.std(gaps) / np.mean(gaps)) if len(gaps) > 1 else float("nan")
    repeats = float(np.mean(np.abs(np.diff(gaps)) < 5e-3)) if len(gaps) > 2 else float("nan")
    most = int(max(np.searchsorted(sent, t + 1.0) - i for i, t in enumerate(sent)))
    return f"{cv:.2f} / {repeats:.0%} / {most}"


def guidellm_delays(path: Path) -> str | None:
    """guidellm's own record of how late it sent: request_start - targeted_start, mean and max ms."""
    doc = json.loads(path.with_suffix(".json").read_text())
    rows = doc["benchmarks"][0]["requests"]["successful"]
    late = [r["info"]["timings"]["request_start"] - r["info"]["timings"]["targeted_start"] for r in rows]
    return f"{np.mean(late) * 1e3:.1f} / {np.max(late) * 1e3:.1f}" if late else None


def paired_diffs(ref: Sequence[Request], other: Sequence[Request]) -> list[str]:
    """Median of other[i] - ref[i] for TTFT, TPOT and E2E (ms) with its order-statistic 95% interval;
    '-' when the runs do not hold the same number of requests."""
    if len(ref) != len(other):
        return ["-", "-", "-"]
    cells = []
    for attr in ("ttft_s", "tpot_s", "e2e_s"):
        diffs = [(getattr(b, attr) - getattr(a, attr)) * 1000 for a, b in zip(ref, other, strict=True)]
        cells.append(f"{nearest_rank(diffs, 0.5):+.2f} {fmt_ci(order_stat_interval(diffs, 0.5))}")
    return cells


def against_server_log(out: Path, label: str, requests: Sequence[Request]) -> str | None:
    """Client minus the scripted server's own clock, request by request (i-th send against i-th arrival):
    mean and P99 for TTFT and E2E, mean for TPOT, in ms; None without a server log for the run."""
    path = out / f"{label}.server.json"
    if not path.exists():
        return None
    log = sorted(json.loads(path.read_text()), key=lambda e: e["arrival"])
    mine = sorted(requests, key=lambda r: r.sent_s)
    # a client that leaves its last requests out of its report (guidellm 0.8.1 can drop its last one)
    # is paired with the first arrivals, provided the send and arrival times still line up
    log = log[: len(mine)]
    t_log, t_mine = log[0]["arrival"], mine[0].sent_s
    if any(abs((e["arrival"] - t_log) - (r.sent_s - t_mine)) > 0.05 for r, e in zip(mine, log, strict=False)):
        return f"| {label} | {len(mine)} requests against {len(log)} arrivals: not paired |"
    ttft = [(r.ttft_s - (e["emits"][0] - e["arrival"])) * 1e3 for r, e in zip(mine, log, strict=True)]
    e2e = [(r.e2e_s - (e["emits"][-1] - e["arrival"])) * 1e3 for r, e in zip(mine, log, strict=True)]
    true_tpot = [(e["emits"][-1] - e["emits"][0]) / max(1, len(e["emits"]) - 1) for e in log]
    tpot = [(r.tpot_s - t) * 1e3 for r, t in zip(mine, true_tpot, strict=True)]
    return (
        f"| {label} | {len(mine)} | {np.mean(ttft):+.2f} | {nearest_rank(ttft, 0.99):+.2f} | {np.mean(tpot):+.3f} "
        f"| {np.mean(e2e):+.2f} | {nearest_rank(e2e, 0.99):+.2f} |"
    )


def runs_in(out: Path) -> list[tuple[str, str]]:
    """(label, client) of every finished client run, in the order they ran."""
    found = [(json.loads(p.read_text()), p) for p in out.glob("*.cpu.json")]
    found.sort(key=lambda pair: pair[1].stat().st_mtime)
    return [(p.name.removesuffix(".cpu.json"), doc["client"]) for doc, p in found if doc["rc"] == 0]


def table(out: Path, reference: str = "tailserve") -> str:
    load = json.loads((out / "workload.json").read_text())
    planned = np.asarray(load["offsets_s"])
    lines = [
        f"workload: {load['requests']} requests, {load['input_len']} prompt tokens -> {load['output_len']} "
        f"(ignore_eos), Poisson {load['rate']:g} req/s (vLLM's schedule, seed {load['seed']})",
        "",
        "| client (label) | n | send lag vs schedule, mean / max ms | sends: gap CV / repeated gaps / most in 1 s "
        "| client CPU s (user+sys) | server CPU s "
        "| TTFT mean [95%] | TTFT P50 [95%] | TTFT P99 [95%] | TPOT mean [95%] | TPOT P50 [95%] | TPOT P99 [95%] "
        "| tool's TPOT/ITL mean | E2E mean | E2E P99 [95%] |",
        "| --- " * 15 + "|",
    ]
    stats: dict[str, dict[str, dict[str, Any]]] = {}
    ordered: dict[str, list[Request]] = {}  # each run's requests in send order: request i is the same prompt
    notes: list[str] = []
    for label, client in runs_in(out):
        reqs = READERS[client](out / label)
        ordered[label] = sorted(reqs, key=lambda r: r.sent_s)
        cpu = json.loads((out / f"{label}.cpu.json").read_text())
        sent = np.sort([r.sent_s for r in reqs])
        lag = (sent - planned[: len(sent)]) * 1000 if len(sent) == len(planned) else None
        s = {
            "ttft": describe([r.ttft_s for r in reqs]),
            "tpot": describe([r.tpot_s for r in reqs]),
            "e2e": describe([r.e2e_s for r in reqs]),
        }
        own = [r.tool_tpot_s for r in reqs if r.tool_tpot_s is not None]
        if client == "guidellm":
            notes.append(
                f"{label}: guidellm's own send delay (request_start - targeted_start), mean / max ms: {guidellm_delays(out / label)}"
            )
        stats[label] = s
        lag_text = "-" if lag is None else f"{np.mean(lag - lag.min()):.1f} / {np.max(lag - lag.min()):.1f}"
        server = "-" if cpu["server_cpu_s"] is None else f"{cpu['server_cpu_s']:.1f}"
        t, p, e = s["ttft"], s["tpot"], s["e2e"]
        lines.append(
            f"| {client} ({label}) | {t['n']} | {lag_text} | {send_pattern([r.sent_s for r in reqs])} "
            f"| {cpu['user_s'] + cpu['sys_s']:.1f} | {server} "
            f"| {t['mean']:.1f} {fmt_ci(t['mean_ci'])} | {t['p50']:.1f} {fmt_ci(t['p50_ci'])} "
            f"| {t['p99']:.1f} {fmt_ci(t['p99_ci'])} "
            f"| {p['mean']:.2f} {fmt_ci(p['mean_ci'])} | {p['p50']:.2f} {fmt_ci(p['p50_ci'])} "
            f"| {p['p99']:.2f} {fmt_ci(p['p99_ci'])} "
            f"| {np.mean(own) * 1000 if own else float('nan'):.2f} | {e['mean']:.1f} | {e['p99']:.1f} {fmt_ci(e['p99_ci'])} |"
        )
    lines += ["", *notes] if notes else []
    truth = [row for label, client in runs_in(out) if (row := against_server_log(out, label, ordered[label]))]
    if truth:
        lines += [
            "",
            "client minus the scripted server's own clock (arrival -> first / last chunk written), ms:",
            "",
        ]
        lines += [
            "| client (label) | n | TTFT mean | TTFT P99 | TPOT mean | E2E mean | E2E P99 |",
            "| --- " * 7 + "|",
        ]
        lines += truth
    refs = [label for label, client in runs_in(out) if client == reference]
    if refs:
        ref = stats[refs[0]]
        lines += [
            "",
            f"relative to {refs[0]}: unpaired, the ratio of the figures (P99: is the reference's P99 inside",
        ]
        lines += [
            "the client's interval?); paired, request i against request i (the same prompt at the same due time):"
        ]
        lines += ["the median difference in ms with its 95% interval", ""]
        lines += [
            "| client (label) | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | TPOT P50 | TPOT P99 "
            "| paired TTFT diff, ms | paired TPOT diff, ms | paired E2E diff, ms |",
            "| --- " * 10 + "|",
        ]
        for label, s in stats.items():
            if label == refs[0]:
                continue
            cells = []
            for metric in ("ttft", "tpot"):
                for key in ("mean", "p50"):
                    cells.append(f"{(s[metric][key] / ref[metric][key] - 1) * 100:+.1f}%")
                lo, hi = s[metric]["p99_ci"]
                inside = (lo is None or lo <= ref[metric]["p99"]) and (hi is None or ref[metric]["p99"] <= hi)
                cells.append("inside" if inside else "outside")
            cells += paired_diffs(ordered[refs[0]], ordered[label])
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"machine: {machine_line()}; commit {git_commit()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("step", choices=("prepare", "serve", "client", "stop", "table", "all"))
    parser.add_argument("client", nargs="?", choices=CLIENTS, help="with `client`: which one")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "clients")
    parser.add_argument("--port", type=int, default=18741)
    parser.add_argument("--requests", type=int, default=220)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson req/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--server-core", default="0")
    parser.add_argument(
        "--fake", action="store_true", help="with `serve`: the scripted server, not tailserve"
    )
    parser.add_argument("--cpus", default="1", help="with `client`: the client's cores (taskset list)")
    parser.add_argument("--label", default=None, help="with `client`: the run's name (default: the client's)")
    parser.add_argument("--env", action="append", default=[], help="with `client`: VAR=VALUE for the client")
    parser.add_argument(
        "--guidellm-profile",
        choices=("replay", "poisson"),
        default="replay",
        help="with `client guidellm`: replay the shared schedule, or its own Poisson arrivals at --rate",
    )
    parser.add_argument(
        "--trace-from",
        default=None,
        metavar="LABEL",
        help="with `client tailserve`: replay the send times and prompts of guidellm run LABEL",
    )
    parser.add_argument("--tokenizer", type=Path, default=HF_DIR)
    parser.add_argument("--guidellm", type=Path, default=Path("/tmp/h41-guidellm/bin/guidellm"))
    parser.add_argument("--aiperf", type=Path, default=Path("/tmp/h41-aiperf/bin/aiperf"))
    args = parser.parse_args(argv)
    load = Workload(args.requests, args.rate, args.seed, args.input_len, args.output_len)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.step in ("prepare", "all"):
        prepare(out, load, args.tokenizer)
    if args.step == "all":
        serve(out, args.port, args.server_core)
        try:
            for name in CLIENTS:
                run_client(name, out, name, args.port, load, args, args.cpus, args.env)
        finally:
            stop(out)
    if args.step == "serve":
        if args.fake:
            serve_fake(out, args.server_core, load)
        else:
            serve(out, args.port, args.server_core)
    if args.step == "client":
        if args.client is None:
            parser.error("client needs one of: " + ", ".join(CLIENTS))
        saved = Workload(
            **{k: v for k, v in json.loads((out / "workload.json").read_text()).items() if k != "offsets_s"}
        )
        run_client(args.client, out, args.label or args.client, args.port, saved, args, args.cpus, args.env)
    if args.step == "stop":
        stop(out)
    if args.step in ("table", "all"):
        text = table(out)
        (out / "table.md").write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
