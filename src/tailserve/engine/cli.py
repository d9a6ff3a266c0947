"""`tailserve generate`: run prompts through the engine offline and print the completions."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="print completions of prompts (offline)"
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default="default", help="HF directory, .gguf file, default, or dummy:<preset>")
    p.add_argument(
        "--chat", action="store_true", help="send each prompt as a user turn through the chat template"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--weight-format", default="auto", help="auto, fp32, bf16, int4 or int8")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp32 or bf16")
    p.add_argument(
        "--force-weight-format", action="store_true", help="serve it even if it fails the quality gate"
    )
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)  # old spelling of --weight-format
    p.add_argument("--device", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over N processes")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import logging

    from tailserve.config import EngineConfig, ModelConfig, from_flags
    from tailserve.engine import LLM, SamplingParams
    from tailserve.errors import TailserveError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = from_flags(SamplingParams, args)
        # --seed seeds the sampling here; ModelConfig's seed is the dummy weights'.
        llm = LLM(config=EngineConfig(model=from_flags(ModelConfig, args, seed=ModelConfig.seed)))
        try:
            outputs = llm.generate(args.prompts, params, chat=args.chat)
        finally:
            llm.close()
    except TailserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(out.text)
    return 0
