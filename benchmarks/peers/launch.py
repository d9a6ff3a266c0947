"""Command lines for every server a benchmark starts: tailserve (fcfs / slo), `transformers serve`
(with and without continuous batching), llama.cpp's server and vLLM's CPU engine, each matched to
the same limits as closely as its flags allow. Builds commands only; proc.py runs them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from proc import thread_env

from peers.envs import HF_DIR, PEERS_PYTHON, TAILSERVE, VLLM_PYTHON

LLAMACPP_SERVER = Path(__file__).with_name("llamacpp_server.py")
GREEDY: dict[str, Any] = {"temperature": 0}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What every server gets: threads, concurrent sequences, tokens per forward step, context per sequence."""

    threads: int = 2
    max_seqs: int = 16
    step_tokens: int = 256
    ctx_per_seq: int = 2048


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One server under test: how to start it, when it is ready, what the bench must send it."""

    key: str
    label: str
    command: list[str]
    env: dict[str, str]
    ready_path: str
    bench_args: list[str]
    extra_body: dict[str, Any]
    notes: str


def tailserve(
    policy: str,
    port: int,
    limits: Limits,
    slo: tuple[float, float] | None = None,
    extra_args: tuple[str, ...] = (),
    kv_cache_memory: str = "1536MiB",
    prefix_caching: bool = False,
    key: str | None = None,
    label: str | None = None,
) -> ServerSpec:
    """`tailserve serve` of the default model (prefix caching off unless asked); `slo` = (TTFT s,
    TPOT s) targets; `key` / `label` name a variant with `extra_args` (default ts-POLICY)."""
    command = [str(TAILSERVE), "serve", "--model", "default", "--schedule-policy", policy]
    command += [
        "--port",
        str(port),
        "--max-num-seqs",
        str(limits.max_seqs),
        "--num-threads",
        str(limits.threads),
    ]
    command += ["--max-num-batched-tokens", str(limits.step_tokens), "--kv-cache-memory", kv_cache_memory]
    command += [] if prefix_caching else ["--no-prefix-caching"]
    command += ["--log-level", "warning"]
    caching = "prefix caching on (hashed full KV blocks)" if prefix_caching else "prefix caching off"
    notes = f"default weight format (the gate's pick), paged KV pool {kv_cache_memory}, {caching}"
    if slo is not None:
        command += ["--slo-ttft", f"{slo[0]:g}", "--slo-tpot", f"{slo[1]:g}"]
        notes += (
            ", told the SLO (--slo-ttft/--slo-tpot: admission control answers 429 when the predicted "
            "wait breaks the TTFT target; `slo` also orders and caps prefill by it)"
        )
    command += list(extra_args)
    if extra_args:
        notes += f", extra flags `{' '.join(extra_args)}`"
    return ServerSpec(
        key=key or f"ts-{policy}",
        label=label or f"tailserve ({policy})",
        command=command,
        env=thread_env(limits.threads),
        ready_path="/ready",
        bench_args=[],
        extra_body=GREEDY,
        notes=notes,
    )


def tailserve_at_defaults(
    port: int,
    threads: int,
    extra_args: tuple[str, ...] = (),
    model: str = "default",
    prefix_caching: bool = False,
    key: str = "tailserve",
    label: str = "tailserve",
) -> ServerSpec:
    """`tailserve serve` at its own defaults (scheduler, step budget, admission, KV pool) but for
    the engine threads, prefix caching (off unless asked) and `extra_args`."""
    command = [str(TAILSERVE), "serve", "--model", model, "--port", str(port), "--num-threads", str(threads)]
    command += [] if prefix_caching else ["--no-prefix-caching"]
    command += ["--log-level", "warning", *extra_args]
    caching = "prefix caching on" if prefix_caching else "prefix caching off"
    flags = f", extra flags `{' '.join(extra_args)}`" if extra_args else ""
    return ServerSpec(
        key=key,
        label=label,
        command=command,
        env=thread_env(threads),
        ready_path="/ready",
        bench_args=[],
        extra_body=GREEDY,
        notes=f"its defaults, {threads} engine thread(s), {caching}{flags}",
    )


# `transformers serve` with continuous batching's block sharing (its prefix cache) off unless
# BLOCK_SHARING=1. Benchmarks repeat the same seeded prompts, so a prefix cache would serve later
# runs from memory; the CLI has no flag for it. Every server runs without one (tailserve
# --no-prefix-caching, llama.cpp cache_prompt off, vLLM --no-enable-prefix-caching) except in a
# workload that is about prefix reuse.
HF_LAUNCH = """
import os, sys
from transformers import ContinuousBatchingConfig
from transformers.cli.transformers import main
post_init = ContinuousBatchingConfig.__post_init__
def no_block_sharing(self):
    post_init(self)
    self.allow_block_sharing = False
if os.environ.get("BLOCK_SHARING") != "1":
    ContinuousBatchingConfig.__post_init__ = no_block_sharing
sys.argv = ["transformers", *sys.argv[1:]]
main()
"""


def transformers_serve(
    port: int, limits: Limits, continuous_batching: bool, prefix_caching: bool = False
) -> ServerSpec:
    """`transformers serve` of the HF copy, float32; it knows no `ignore_eos`, so an eos id that
    never occurs has the same effect. `prefix_caching` keeps continuous batching's block sharing."""
    command = [str(PEERS_PYTHON), "-c", HF_LAUNCH, "serve", str(HF_DIR), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    key, label = "hf", "transformers serve"
    notes = "float32; one `model.generate()` at a time (no batching): requests queue in the server"
    if continuous_batching:
        kv_tokens = limits.max_seqs * limits.ctx_per_seq
        command += ["--continuous-batching", "--cb-max-batch-tokens", str(limits.step_tokens)]
        command += ["--cb-num-blocks", str(kv_tokens // 256)]
        key, label = "hf-cb", "transformers serve --continuous-batching"
        sharing = (
            "block sharing (its prefix cache) on"
            if prefix_caching
            else ("block sharing (its prefix cache) off through the launcher")
        )
        notes = (
            f"float32; paged KV of {kv_tokens} tokens (256-token pages), {limits.step_tokens} tokens a step; "
            f"{sharing}; no cap on concurrent sequences exposed"
        )
    env = {**thread_env(limits.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if prefix_caching:
        env["BLOCK_SHARING"] = "1"
    return ServerSpec(
        key=key,
        label=label,
        command=command,
        env=env,
        ready_path="/health",
        bench_args=["--no-ignore-eos"],
        extra_body={**GREEDY, "generation_config": json.dumps({"eos_token_id": -1})},
        notes=notes,
    )


def llamacpp(
    port: int, gguf: Path, limits: Limits, key: str = "llamacpp", prefix_caching: bool = False
) -> ServerSpec:
    """llama.cpp's server on the Q4_1 GGUF itself (its native kernels), prompt cache off unless
    `prefix_caching` (then each slot reuses the longest common prefix of its last prompt, and
    prompts leaving a slot are kept in a host-memory cache)."""
    command = [str(PEERS_PYTHON), str(LLAMACPP_SERVER), "--port", str(port), "--gguf", str(gguf)]
    command += ["--threads", str(limits.threads), "--parallel", str(limits.max_seqs)]
    command += ["--step-tokens", str(limits.step_tokens), "--ctx-per-seq", str(limits.ctx_per_seq)]
    command += ["--cache-prompt"] if prefix_caching else []
    caching = "prompt cache on (cache_prompt, 256 MiB host cache)" if prefix_caching else "prompt cache off"
    threads = f"{limits.threads} thread" + ("s" if limits.threads > 1 else "")
    return ServerSpec(
        key=key,
        label=f"llama.cpp server (xllamacpp, {threads})",
        command=command,
        env=thread_env(limits.threads),
        ready_path="/health",
        bench_args=[],
        extra_body={**GREEDY, "cache_prompt": prefix_caching},
        notes=(
            f"{threads}; Q4_1 weights as they are, f16 KV, {limits.max_seqs} slots x {limits.ctx_per_seq} "
            f"tokens, n_batch = n_ubatch = {limits.step_tokens}, continuous batching, {caching}"
        ),
    )


def vllm_cpu(
    port: int,
    limits: Limits,
    max_model_len: int = 4096,
    kv_cache_gib: int = 2,
    prefix_caching: bool = False,
    scheduler_limits: bool = True,
    extra_args: tuple[str, ...] = (),
    key: str = "vllm",
    label: str = "vLLM CPU engine (bf16)",
) -> ServerSpec:
    """vLLM's CPU engine on the HF copy, cast to bf16. Its OpenMP threads are pinned to cores
    0..threads-1; the `vllm` console script fails (the metadata is named `vllm-cpu`), so the API
    server module is run directly. Ready after ~110 s on the 2-core box. `scheduler_limits=False`
    leaves --max-num-seqs and --max-num-batched-tokens at vLLM's defaults (128 and 2048 on CPU)
    unless `extra_args` sets them."""
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR)]
    command += ["--served-model-name", "smollm2-135m", "--dtype", "bfloat16"]
    command += ["--max-model-len", str(max_model_len)]
    if scheduler_limits:
        command += ["--max-num-seqs", str(limits.max_seqs)]
        command += ["--max-num-batched-tokens", str(limits.step_tokens)]
    command += ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if prefix_caching:  # so usage says how many prompt tokens were cached
        command += ["--enable-prompt-tokens-details"]
    command += ["--host", "127.0.0.1", "--port", str(port), *extra_args]
    env = {
        **thread_env(limits.threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "0" if limits.threads == 1 else f"0-{limits.threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    scheduler = (
        f"at most {limits.max_seqs} sequences, {limits.step_tokens} tokens a step"
        if scheduler_limits
        else "its default sequences and tokens a step"
    )
    flags = f", extra flags `{' '.join(extra_args)}`" if extra_args else ""
    # The last --dtype wins (argparse): extra_args may override the bf16 default.
    dtypes = [extra_args[i + 1] for i, a in enumerate(extra_args[:-1]) if a == "--dtype"]
    dtype = "bf16" if not dtypes or dtypes[-1] == "bfloat16" else dtypes[-1]
    return ServerSpec(
        key=key,
        label=label,
        command=command,
        env=env,
        ready_path="/health",
        bench_args=[],
        extra_body=GREEDY,
        notes=(
            f"vllm-cpu 0.32.0, {dtype}, {kv_cache_gib} GiB KV (VLLM_CPU_KVCACHE_SPACE), {limits.threads} "
            f"OpenMP thread(s) pinned, {scheduler}, "
            f"prefix caching {'on (hashed full blocks)' if prefix_caching else 'off'}{flags}"
        ),
    )
