"""In-process engine figures, no HTTP server and so no load generator: what a step costs at one
thread against N, what per-request features cost a decode step, and `LLM.generate`'s throughput
against transformers' `generate` on the same weights. Never run beside another measurement.

    .venv/bin/python benchmarks/engine_steps.py threads --threads 1 2     # --rounds 1 --steps 3 smoke-runs it
    .venv/bin/python benchmarks/engine_steps.py features                  # --steps 2 --warmup 1
    .venv/bin/python benchmarks/engine_steps.py offline --batches 1 8 32  # --batches 1 --output-tokens 4 --repeats 1
    .venv/bin/python benchmarks/engine_steps.py commits --base 4845155   # --rounds 1 --steps 2 --model dummy:tiny
    .venv/bin/python benchmarks/engine_steps.py commits --base 4845155 --rows 3 --context 2000 --threads 2  # long contexts

- `threads`: per thread count, its own engine (each runner steps on its own count): a decode step of
  1 stream and of R streams, and the prefill step of one P-token prompt. The counts alternate round
  by round (A B, B A, ...), so the machine's drift falls on each; a cell is the median over rounds of
  each round's median, the rounds shown beside it.
- `features`: R streams decoding together, plain (temperature sampling) against every row asking
  for penalties, logprobs=5 and a JSON-schema grammar; the median step of each and their ratio
  (issue 14's target: at most 1.25x).
- `commits`: this tree against another commit (a git worktree made for the run): a decode step of 1
  stream and of R, and the prefill step of a P-token prompt, each round in a fresh process per tree
  with that tree's source first on the path, the trees alternating; for "no slowdown" claims.
- `offline`: the same chat prompts of varied length through transformers' `generate` (padded static
  batches, float32 weights dequantized by tailserve's loader) and `LLM.generate` (its
  --weight-format), greedy, alternating; by default generation stops at EOS and only useful tokens
  count (a static batch keeps computing rows that already ended), with --ignore-eos every request
  makes exactly --output-tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from hf_models import hf_model
from machine import git_commit, machine_line
from step_timer import decode_steps_ms, engine_for, prefill_step_ms, timed_decode_steps

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLM
from tailserve.engine.llm_engine import LLMEngine
from tailserve.engine.request import GrammarSpec, SamplingParams
from tailserve.weights.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM  # imported by hf_models only when `offline` runs


# ----- threads ------------------------------------------------------------------------------------
def threads_table(rounds: Mapping[tuple[int, str], Sequence[float]], threads: Sequence[int]) -> list[str]:
    """Markdown rows: per figure, each count's median of its per-round medians (the rounds in
    brackets), and the first count's median over each other count's."""
    figures = list(dict.fromkeys(name for _, name in rounds))
    base = threads[0]
    lines = [
        f"| figure | {' | '.join(f'{n} thread(s) ms' for n in threads)} | "
        + " | ".join(f"{base}/{n}" for n in threads[1:])
        + " |",
        "| --- |" + " ---: |" * (2 * len(threads) - 1),
    ]
    for name in figures:
        med = {n: statistics.median(rounds[(n, name)]) for n in threads}
        cells = [f"{med[n]:.1f} ({', '.join(f'{v:.1f}' for v in rounds[(n, name)])})" for n in threads]
        ratios = [f"{med[base] / med[n]:.2f}x" for n in threads[1:]]
        lines.append(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return lines


def run_threads(args: argparse.Namespace) -> list[str]:
    engines = {n: engine_for(args.model, args.rows, args.prompt, threads=n) for n in args.threads}
    first = engines[args.threads[0]]
    header = f"{first.model_name}, weight format {first.weight_format}, threads {args.threads}, {args.rounds} rounds"
    print(header, flush=True)
    figures = (
        "decode step, 1 stream",
        f"decode step, {args.rows} streams",
        f"prefill step, {args.prompt} tokens",
    )
    rounds: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for n in args.threads if rnd % 2 == 0 else list(reversed(args.threads)):
            engine = engines[n]
            samples = {
                figures[0]: decode_steps_ms(engine, 1, args.steps, args.warmup),
                figures[1]: decode_steps_ms(engine, args.rows, args.steps, args.warmup),
                figures[2]: prefill_step_ms(engine, args.prompt, max(3, args.steps // 6))[1:],
            }
            for name, values in samples.items():
                rounds.setdefault((n, name), []).append(statistics.median(values))
            medians = ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in samples.items())
            print(f"round {rnd + 1}, {n} thread(s): {medians}", flush=True)
    return [header, "", *threads_table(rounds, args.threads)]


# ----- commits ------------------------------------------------------------------------------------
def commit_round(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One round of step_timer.py's worker on `tree`'s source (its src/ first on the path)."""
    cmd = [sys.executable, str(Path(__file__).with_name("step_timer.py")), "--model", args.model]
    cmd += ["--weight-format", args.weight_format, "--rows", str(args.rows), "--prompt", str(args.prompt)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--context", str(args.context)]
    cmd += [] if args.threads is None else ["--threads", str(args.threads)]
    cmd += ["--policy", args.policy]
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"step_timer on {tree} failed: {done.stderr.strip()[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(report["source"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the worker imported {report['source']}, not {tree}'s tailserve")
    figures: dict[str, float] = report["figures"]
    return figures


def commits_table(rounds: Mapping[tuple[str, str], Sequence[float]], names: Sequence[str]) -> list[str]:
    """Markdown rows: per figure, each tree's median of its round medians (rounds in brackets), the
    second over the first, and the spread of the first's rounds (max / min) to read the ratio against."""
    figures = list(dict.fromkeys(name for _, name in rounds))
    base, head = names
    lines = [
        f"| figure | {base} ms | {head} ms | {head} / {base} | {base} spread (max/min) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for fig in figures:
        a, b = rounds[(base, fig)], rounds[(head, fig)]
        cells = [f"{statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})" for v in (a, b)]
        ratio = statistics.median(b) / statistics.median(a)
        lines.append(f"| {fig} | {cells[0]} | {cells[1]} | {ratio:.3f} | {max(a) / min(a):.3f} |")
    return lines


def run_commits(args: argparse.Namespace) -> list[str]:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(base_tree), args.base], check=True
        )
        try:
            trees = {args.base: base_tree, "HEAD": root}
            names = list(trees)
            rounds: dict[tuple[str, str], list[float]] = {}
            for rnd in range(args.rounds):
                for name in names if rnd % 2 == 0 else list(reversed(names)):
                    figures = commit_round(trees[name], args)
                    for fig, ms in figures.items():
                        rounds.setdefault((name, fig), []).append(ms)
                    print(
                        f"round {rnd + 1}, {name}: "
                        + ", ".join(f"{k} {v:.1f} ms" for k, v in figures.items()),
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(base_tree)], check=False
            )
    header = (
        f"{args.base} against HEAD (the working tree), {args.rounds} rounds, each a fresh process per tree"
    )
    return [header, "", *commits_table(rounds, names)]


# ----- features -----------------------------------------------------------------------------------
# At least 100 integers: every row stays inside its grammar for the whole measurement.
SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
    "required": ["values"],
    "additionalProperties": False,
}


def feature_params(featured: bool, seed: int, max_tokens: int) -> SamplingParams:
    """Plain: temperature sampling and nothing else. Featured: the same plus penalties, logprobs and a grammar."""
    if not featured:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=5,
        grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
    )


def feature_steps_ms(engine: LLMEngine, featured: bool, rows: int, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each engine step once all `rows` chat requests decode together."""
    for i in range(rows):
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List {i + 20} numbers as JSON."}]
        )
        params = feature_params(featured, i, warmup + steps + 64)
        engine.add_request(f"{'f' if featured else 'p'}{i}-{time.monotonic_ns()}", prompt, params)
    return timed_decode_steps(engine, rows, warmup, steps)


def run_features(args: argparse.Namespace) -> list[str]:
    engine = engine_for(args.model, args.rows, 2048, args.threads, args.weight_format, args.device)
    header = (
        f"{engine.model_name}, {args.rows} streams, weight format {engine.weight_format}, "
        f"torch threads {torch.get_num_threads()}, {args.device}"
    )
    print(header, flush=True)
    plain = feature_steps_ms(engine, False, args.rows, args.warmup, args.steps)
    featured = feature_steps_ms(engine, True, args.rows, args.warmup, args.steps)
    p, f = statistics.median(plain), statistics.median(featured)
    return [
        header,
        f"plain step     median {p:8.2f} ms  (min {min(plain):.2f})",
        f"featured step  median {f:8.2f} ms  (min {min(featured):.2f})  penalties + logprobs=5 + JSON schema",
        f"ratio {f / p:.3f}x (target <= 1.25x)",
    ]


# ----- offline ------------------------------------------------------------------------------------
TOPICS = [
    "the history of the printing press",
    "how vaccines train the immune system",
    "why the sky is blue",
    "the rules of chess",
    "how a bill becomes law",
    "the water cycle",
    "what makes bread rise",
    "how GPS finds your position",
]
CONTEXT = (
    "Background notes: the committee met on Tuesday to review the quarterly figures, the new hiring "
    "plan, the budget for the spring conference and the feedback gathered from customers in the north. "
)


def offline_prompts(model: LoadedModel, n: int) -> list[list[int]]:
    """Chat prompts from ~40 to ~150 tokens: context of a different length before each question."""
    prompts = []
    for i in range(n):
        context = CONTEXT * ((i * 7) % 4)
        msg = [{"role": "user", "content": f"{context}Explain {TOPICS[i % len(TOPICS)]} in a few sentences."}]
        prompts.append(model.tokenizer.apply_chat_template(msg))
    return prompts


def useful_tokens(row: Sequence[int], eos: frozenset[int]) -> int:
    """Tokens up to and including the first EOS (all of them when none is)."""
    for i, t in enumerate(row):
        if t in eos:
            return i + 1
    return len(row)


def run_hf(
    hf: LlamaForCausalLM, prompts: list[list[int]], out_tokens: int, ignore_eos: bool, eos: frozenset[int]
) -> tuple[float, int]:
    """Seconds and useful output tokens of one padded static batch through transformers' generate."""
    width = max(len(p) for p in prompts)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=out_tokens,
            min_new_tokens=out_tokens if ignore_eos else None,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None if ignore_eos else sorted(eos),
        )
    elapsed = time.perf_counter() - start
    rows = out[:, width:].tolist()
    return elapsed, sum(len(r) if ignore_eos else useful_tokens(r, eos) for r in rows)


def run_ours(llm: LLM, prompts: list[list[int]], out_tokens: int, ignore_eos: bool) -> tuple[float, int]:
    """Seconds and output tokens of `LLM.generate` over the prompts."""
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=ignore_eos)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def run_offline(args: argparse.Namespace) -> list[str]:
    torch.set_num_threads(args.threads)
    model = load_model(args.model, torch.float32)  # transformers' copy (and the prompts' tokenizer)
    hf = hf_model(model)
    config = EngineConfig(
        model=ModelConfig(
            model=args.model, weight_format=args.weight_format, max_model_len=2048, num_threads=args.threads
        ),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(args.batches)),
    )
    llm = LLM(config=config)  # loads its own weights in the format asked for
    eos = model.tokenizer.eos_token_ids
    warm = offline_prompts(model, 2)
    run_hf(hf, warm, 4, True, eos)
    run_ours(llm, warm, 4, True)
    rows = []
    for batch in args.batches:
        prompts = offline_prompts(model, batch)
        hf_tps, our_tps = [], []
        for _ in range(args.repeats):  # alternate so the machine's noise hits both alike
            seconds, hf_tokens = run_hf(hf, prompts, args.output_tokens, args.ignore_eos, eos)
            hf_tps.append(hf_tokens / seconds)
            seconds, our_tokens = run_ours(llm, prompts, args.output_tokens, args.ignore_eos)
            our_tps.append(our_tokens / seconds)
        theirs, ours = statistics.median(hf_tps), statistics.median(our_tps)
        row = {
            "batch": batch,
            "prompt_tokens_mean": sum(map(len, prompts)) / batch,
            "max_output_tokens": args.output_tokens,
            "ignore_eos": args.ignore_eos,
            "transformers_output_tokens": hf_tokens,
            "tailserve_output_tokens": our_tokens,
            "transformers_tok_s": round(theirs, 1),
            "tailserve_tok_s": round(ours, 1),
            "ratio": round(ours / theirs, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            doc = {"rows": rows, "date": datetime.now(UTC).isoformat(), "commit": git_commit()}
            json.dump(doc | {"threads": args.threads, "weight_format": args.weight_format}, f, indent=2)
    mode = "EOS ignored" if args.ignore_eos else "stop at EOS"
    return [
        f"{platform.machine()}, {args.threads} threads, tailserve {args.weight_format}, {mode}",
        "",
        "| batch | transformers tok/s | tailserve tok/s | ratio |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {r['batch']} | {r['transformers_tok_s']} | {r['tailserve_tok_s']} | {r['ratio']}x |"
            for r in rows
        ),
    ]


# ----- command line -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    threads = sub.add_parser("threads", help="engine steps at 1 thread against N, interleaved")
    threads.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to compare")
    threads.add_argument("--rows", type=int, default=16, help="streams of the batched decode step")
    threads.add_argument("--prompt", type=int, default=512, help="tokens of the prefill step")
    threads.add_argument("--rounds", type=int, default=4, help="alternations of the thread counts")
    threads.add_argument("--steps", type=int, default=30, help="timed decode steps per figure and round")
    threads.add_argument("--warmup", type=int, default=5)
    threads.add_argument("--model", default="default")
    threads.set_defaults(run=run_threads)
    commits = sub.add_parser("commits", help="decode and prefill steps of another commit against this tree")
    commits.add_argument("--base", required=True, help="the commit to compare against (git rev)")
    commits.add_argument("--rounds", type=int, default=6, help="alternations of the two trees")
    commits.add_argument("--rows", type=int, default=16, help="streams of the batched decode step")
    commits.add_argument("--prompt", type=int, default=1600, help="tokens of the prefill step")
    commits.add_argument(
        "--context", type=int, default=64, help="prompt tokens of each decoding stream (long contexts: 2000)"
    )
    commits.add_argument("--steps", type=int, default=30, help="timed decode steps per figure and round")
    commits.add_argument("--warmup", type=int, default=5)
    commits.add_argument("--threads", type=int, default=None, help="engine threads (default: as the server)")
    commits.add_argument("--weight-format", default="int4")
    commits.add_argument(
        "--policy",
        default="slo",
        help="the engines' policy: fcfs prefills a prompt past 2,048 tokens in one step",
    )
    commits.add_argument("--model", default="default")
    commits.set_defaults(run=run_commits)
    features = sub.add_parser(
        "features", help="a decode step with penalties, logprobs and a grammar on every row"
    )
    features.add_argument("--rows", type=int, default=16)
    features.add_argument("--steps", type=int, default=40, help="timed decode steps per configuration")
    features.add_argument("--warmup", type=int, default=5)
    features.add_argument("--model", default="default")
    features.add_argument(
        "--weight-format", default="auto", help="as `tailserve serve` (auto: what the gate picks)"
    )
    features.add_argument(
        "--threads", type=int, default=None, help="engine threads (default: as the server picks)"
    )
    features.add_argument("--device", default="cpu")
    features.set_defaults(run=run_features)
    offline = sub.add_parser(
        "offline", help="LLM.generate against transformers' generate on the same weights"
    )
    offline.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    offline.add_argument("--output-tokens", type=int, default=128, help="max tokens per request")
    offline.add_argument(
        "--ignore-eos", action="store_true", help="every request makes exactly --output-tokens"
    )
    offline.add_argument(
        "--repeats", type=int, default=2, help="alternating runs per engine; the median is kept"
    )
    offline.add_argument("--threads", type=int, default=2)
    offline.add_argument(
        "--weight-format", default="auto", help="tailserve's weights: auto, fp32, bf16, int4, int8"
    )
    offline.add_argument("--model", default="default")
    offline.add_argument("--json", default=None, help="also write the rows here")
    offline.set_defaults(run=run_offline)
    args = parser.parse_args(argv)
    counts: list[int] = []
    for name in ("rows", "rounds", "steps", "repeats", "output_tokens", "threads", "batches", "context"):
        value = getattr(args, name, None)
        counts += value if isinstance(value, list) else [] if value is None else [value]
    base = getattr(args, "base", None)
    if base is not None:
        root = Path(__file__).resolve().parents[1]
        found = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if found.returncode != 0:
            parser.error(f"--base {base!r} is not a commit of this repository")
    if any(c < 1 for c in counts):
        parser.error(
            "--rows, --rounds, --steps, --repeats, --output-tokens, --threads, --batches and --context "
            "must be >= 1"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["benchmarks/engine_steps.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        lines = args.run(args)
    except RuntimeError as exc:  # a worker that failed: its own error, no traceback of ours
        print(f"engine_steps: {exc}", file=sys.stderr)
        return 1
    print(f"\n# `{command}` at {stamp} on {machine_line()}, commit {git_commit()}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
