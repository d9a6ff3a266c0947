"""Offline throughput: tailserve's LLM.generate vs transformers' generate (padded static batches).

Same weights (SmolLM2-135M-Instruct GGUF; transformers gets them dequantized to float32, tailserve
in its --weight-format), same chat prompts of varied length, greedy, in one process and one run. By default generation stops at EOS or max tokens, as users run
it, and only useful tokens count (a static batch keeps computing rows that already ended); with
--ignore-eos every request makes exactly --output-tokens tokens (pure step efficiency).
Usage: python benchmarks/offline_throughput.py [--batches 1 8 32] [--ignore-eos] [--threads 2]
       [--weight-format auto|fp32|bf16|int4|int8]   (transformers always runs float32)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

import torch
from hf_models import hf_model
from transformers import LlamaForCausalLM

from tailserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tailserve.engine import LLM, SamplingParams
from tailserve.model.loader import LoadedModel, load_model

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


def make_prompts(model: LoadedModel, n: int) -> list[list[int]]:
    """Chat prompts from ~40 to ~150 tokens: context of a different length before each question."""
    tok = model.tokenizer
    prompts = []
    for i in range(n):
        context = CONTEXT * ((i * 7) % 4)
        msg = [{"role": "user", "content": f"{context}Explain {TOPICS[i % len(TOPICS)]} in a few sentences."}]
        prompts.append(tok.apply_chat_template(msg))
    return prompts


def useful_tokens(row: list[int], eos: frozenset[int]) -> int:
    """Tokens up to and including the first EOS."""
    for i, t in enumerate(row):
        if t in eos:
            return i + 1
    return len(row)


def run_hf(
    hf: LlamaForCausalLM, prompts: list[list[int]], out_tokens: int, ignore_eos: bool, eos: frozenset[int]
) -> tuple[float, int]:
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
    tokens = sum(len(r) if ignore_eos else useful_tokens(r, eos) for r in rows)
    return elapsed, tokens


def run_ours(llm: LLM, prompts: list[list[int]], out_tokens: int, ignore_eos: bool) -> tuple[float, int]:
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=ignore_eos)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-tokens", type=int, default=128, help="max tokens per request")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="every request makes exactly --output-tokens"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating runs per engine; the median is kept"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--weight-format", default="auto", help="tailserve's weights: auto, fp32, bf16, int4, int8"
    )
    parser.add_argument("--json", default=None, help="also write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("default", torch.float32)  # transformers' copy (and the prompts' tokenizer)
    hf = hf_model(model)
    config = EngineConfig(
        model=ModelConfig(
            model="default",
            weight_format=args.weight_format,
            device="cpu",
            max_model_len=2048,
            num_threads=args.threads,
        ),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(args.batches)),
    )
    llm = LLM(config=config)  # loads its own weights in the format asked for
    eos = model.tokenizer.eos_token_ids
    warm = make_prompts(model, 2)
    run_hf(hf, warm, 4, True, eos)
    run_ours(llm, warm, 4, True)
    rows = []
    for batch in args.batches:
        prompts = make_prompts(model, batch)
        hf_tps_runs, our_tps_runs = [], []
        hf_tokens = our_tokens = 0
        for _ in range(args.repeats):  # alternate so machine noise hits both alike
            seconds, hf_tokens = run_hf(hf, prompts, args.output_tokens, args.ignore_eos, eos)
            hf_tps_runs.append(hf_tokens / seconds)
            seconds, our_tokens = run_ours(llm, prompts, args.output_tokens, args.ignore_eos)
            our_tps_runs.append(our_tokens / seconds)
        hf_tps, our_tps = statistics.median(hf_tps_runs), statistics.median(our_tps_runs)
        row = {
            "batch": batch,
            "prompt_tokens_mean": sum(map(len, prompts)) / batch,
            "max_output_tokens": args.output_tokens,
            "ignore_eos": args.ignore_eos,
            "transformers_output_tokens": hf_tokens,
            "tailserve_output_tokens": our_tokens,
            "transformers_tok_s": round(hf_tps, 1),
            "tailserve_tok_s": round(our_tps, 1),
            "ratio": round(our_tps / hf_tps, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    mode = "EOS ignored" if args.ignore_eos else "stop at EOS"
    print(
        f"{platform.machine()}, {args.threads} threads, tailserve {args.weight_format}, {mode}, {datetime.now(UTC):%Y-%m-%d}"
    )
    print("| batch | transformers tok/s | tailserve tok/s | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch']} | {r['transformers_tok_s']} | {r['tailserve_tok_s']} | {r['ratio']}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "date": datetime.now(UTC).isoformat(),
                    "threads": args.threads,
                    "weight_format": args.weight_format,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
