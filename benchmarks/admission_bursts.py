"""Admission on bursts of long prompts against a running server: of the requests it admits, how
many miss the TTFT target it was told, and how far `admission_estimate_s` was from the TTFT.

Issue 40's probes of main: 30 prompts of ~2,000 tokens at once on a fresh server (21 admitted, TTFT
up to 50.9 s against estimates of at most 1.82 s), 20 distinct 1,030-token prompts (all admitted,
the last TTFT 14.7 s against 1.16 s), and, on a server that had seen bursts, 60 of ~2,000 (60 of 60
admitted with estimates of 0.0, waits up to 127 s). Each burst here sends distinct prompts (no
prefix is shared, so the prefix cache serves nothing), streams each answer (TTFT is the first
content chunk), and waits for the server to drain before the next.

    .venv/bin/tailserve serve --port 8013 &        # the server under test, at its defaults
    .venv/bin/python benchmarks/admission_bursts.py --base-url http://127.0.0.1:8013 --out bench-results/bursts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

TOKENS_PER_WORD = 1.64  # these words in SmolLM2's tokenizer
BURSTS = ((30, 2000), (20, 1030), (60, 2000))  # (requests, prompt tokens), sent in this order
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
]


def prompt(tokens: int, salt: int) -> str:
    """About `tokens` tokens of words no other burst request shares (a distinct first word)."""
    rng = random.Random(salt)
    words = round((tokens - 4) / TOKENS_PER_WORD)
    return f"request {salt}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client: httpx.AsyncClient, url: str, model: str, text: str, target_s: float) -> dict[str, Any]:
    body = {"model": model, "prompt": text, "max_tokens": 16, "stream": True, "temperature": 0}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "ttft_s": None, "estimate_s": None}
        estimate = prompt_tokens = None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            timings = chunk.get("tailserve_timings") or {}
            estimate = timings.get("admission_estimate_s", estimate)
            prompt_tokens = timings.get("prompt_tokens", prompt_tokens)
    return {
        "status": 200,
        "ttft_s": ttft,
        "estimate_s": estimate,
        "prompt_tokens": prompt_tokens,
        "missed": ttft is not None and ttft > target_s,
    }


async def burst(
    url: str, model: str, n: int, tokens: int, salt: int, target_s: float
) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        jobs = [one(client, url, model, prompt(tokens, salt + i), target_s) for i in range(n)]
        return list(await asyncio.gather(*jobs))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--ttft-target", type=float, default=2.0, help="the server's --slo-ttft (default 2)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    url = args.base_url.rstrip("/").removesuffix("/v1")
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    report = []
    for k, (n, tokens) in enumerate(BURSTS):
        rows = asyncio.run(burst(url, model, n, tokens, 1000 * (k + 1), args.ttft_target))
        admitted = [r for r in rows if r["status"] == 200]
        missed = [r for r in admitted if r["missed"]]
        summary = {
            "requests": n,
            "prompt_words": tokens,
            "admitted": len(admitted),
            "refused_429": sum(r["status"] == 429 for r in rows),
            "other_status": sorted({r["status"] for r in rows} - {200, 429}),
            "admitted_missed": len(missed),
            "max_ttft_s": max((r["ttft_s"] or 0.0 for r in admitted), default=None),
            "max_estimate_s": max((r["estimate_s"] or 0.0 for r in admitted), default=None),
            "rows": rows,
        }
        report.append(summary)
        print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
        time.sleep(5)  # let the server drain and settle
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
