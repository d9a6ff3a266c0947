"""`vllm serve`'s flags on `tailserve serve`: each one is the same, mapped, accepted with no effect
(logged once at start) or refused (exit 2 naming it), so a vLLM command line never loses a flag
silently. The table below is the one docs/SERVER.md shows; serve's own parser holds the same and
mapped flags, this module registers the rest. Imports nothing heavy; never loads a model.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from tailserve.errors import ConfigError

Kind = Literal["same", "mapped", "no effect", "refused"]


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: what tailserve does with it and why. `ok_values`: for a flag accepted with no
    effect, the values that keep it so (any other value is refused); None: any value."""

    flag: str
    kind: Kind
    why: str
    tailserve: str = ""  # the tailserve flag it is, or maps to
    takes_value: bool = True
    ok_values: frozenset[str] | None = None

    @property
    def dest(self) -> str:
        return "vllm_" + self.flag.removeprefix("--").replace("-", "_")


def _ok(*values: str) -> frozenset[str]:
    return frozenset(values)


_NO_HUB = "tailserve loads a local directory or .gguf file only; it downloads nothing"
_CORS = "tailserve sends no CORS headers: put a gateway in front for browser clients"

FLAGS: tuple[VllmFlag, ...] = (
    # Same name, same meaning: serve's own flags.
    VllmFlag("MODEL (positional)", "same", "the model directory, as `--model`", "MODEL / --model"),
    VllmFlag("--model", "same", "HF directory, .gguf file, `default` or `dummy:<preset>`", "--model"),
    VllmFlag(
        "--served-model-name",
        "same",
        "one name (vLLM takes several: a second is exit 2)",
        "--served-model-name",
    ),
    VllmFlag(
        "--host", "same", "bind address (vLLM binds all interfaces by default, tailserve loopback)", "--host"
    ),
    VllmFlag("--port", "same", "", "--port"),
    VllmFlag("--api-key", "same", "Bearer token; also read from VLLM_API_KEY as vLLM", "--api-key"),
    VllmFlag("--max-model-len", "same", "", "--max-model-len"),
    VllmFlag("--tensor-parallel-size", "same", "", "--tensor-parallel-size"),
    VllmFlag("--max-num-seqs", "same", "", "--max-num-seqs"),
    VllmFlag("--max-num-batched-tokens", "same", "the per-step token budget", "--max-num-batched-tokens"),
    VllmFlag("--gpu-memory-utilization", "same", "", "--gpu-memory-utilization"),
    VllmFlag("--block-size", "same", "8 to 128", "--block-size"),
    VllmFlag(
        "--kv-cache-dtype", "same", "auto, fp32 or bf16; vLLM's fp8 choices are refused", "--kv-cache-dtype"
    ),
    VllmFlag("--enforce-eager", "same", "no CUDA graphs", "--enforce-eager"),
    VllmFlag("--ssl-certfile", "same", "TLS, served by uvicorn as vLLM", "--ssl-certfile"),
    VllmFlag("--ssl-keyfile", "same", "", "--ssl-keyfile"),
    VllmFlag("--ssl-ca-certs", "same", "", "--ssl-ca-certs"),
    VllmFlag(
        "--ssl-cert-reqs", "same", "0 none, 1 optional, 2 required (client certificates)", "--ssl-cert-reqs"
    ),
    VllmFlag(
        "--enable-ssl-refresh",
        "same",
        "the certificate files are re-read into the live TLS context when they change",
        "--enable-ssl-refresh",
    ),
    VllmFlag("--root-path", "same", "the ASGI root path behind a path-prefixing proxy", "--root-path"),
    # Mapped: a vLLM name or meaning onto tailserve's.
    VllmFlag(
        "--dtype",
        "mapped",
        "compute dtype: float32/float -> --weight-format fp32; bfloat16 -> bf16 activations (bf16 "
        "weights unless --weight-format int4/int8); auto -> tailserve's choice; half/float16 refused "
        "(no fp16 kernels)",
        "--weight-format",
    ),
    VllmFlag(
        "--enable-prefix-caching / --no-enable-prefix-caching",
        "mapped",
        "prefix caching is on by default, as vLLM",
        "--no-prefix-caching",
        takes_value=False,
    ),
    VllmFlag(
        "--chat-template",
        "mapped",
        "a Jinja file, or the template itself in one line, replaces the tokenizer's",
        "--chat-template",
    ),
    VllmFlag(
        "--generation-config",
        "mapped",
        "auto: the model's generation_config.json; vllm: none (server defaults); a folder: its file",
        "--generation-config",
    ),
    VllmFlag("--kv-cache-memory-bytes", "mapped", "the KV pool's size in bytes", "--kv-cache-memory"),
    VllmFlag(
        "--scheduling-policy",
        "mapped",
        "fcfs -> --schedule-policy fcfs; priority refused (tailserve orders by SLO deadline and class)",
        "--schedule-policy",
    ),
    VllmFlag(
        "--disable-uvicorn-access-log", "mapped", "no access log line per request", "", takes_value=False
    ),
    VllmFlag("--disable-fastapi-docs", "mapped", "no /openapi.json", "", takes_value=False),
    # Accepted with no effect: tailserve already behaves as the flag asks, or the flag only tunes
    # something tailserve does not have. Logged once at start.
    VllmFlag(
        "--disable-log-requests", "no effect", "tailserve never logs request contents", takes_value=False
    ),
    VllmFlag(
        "--enable-log-requests", "no effect", "tailserve never logs request contents", takes_value=False
    ),
    VllmFlag(
        "--disable-log-stats",
        "no effect",
        "tailserve logs no periodic stats (see /metrics)",
        takes_value=False,
    ),
    VllmFlag("--max-log-len", "no effect", "tailserve never logs prompts"),
    VllmFlag(
        "--enable-auto-tool-choice",
        "no effect",
        "tool_choice auto is always served when a request has tools",
        takes_value=False,
    ),
    VllmFlag(
        "--tool-call-parser",
        "no effect",
        "tailserve parses Hermes-style <tool_call> JSON blocks (the hermes parser); other parsers refused",
        ok_values=_ok("hermes"),
    ),
    VllmFlag(
        "--trust-remote-code",
        "no effect",
        "tailserve runs its own model code, never a repository's",
        takes_value=False,
    ),
    VllmFlag("--download-dir", "no effect", _NO_HUB),
    VllmFlag("--seed", "no effect", "sampling is seeded per request (`seed`); unseeded requests differ"),
    VllmFlag("--swap-space", "no effect", "preemption recomputes; nothing is swapped to CPU memory"),
    VllmFlag(
        "--enable-chunked-prefill", "no effect", "prompts are always prefilled in chunks", takes_value=False
    ),
    VllmFlag("--max-seq-len-to-capture", "no effect", "decode CUDA graphs cover every running batch size"),
    VllmFlag(
        "--disable-custom-all-reduce",
        "no effect",
        "tensor parallelism uses torch.distributed's all-reduce",
        takes_value=False,
    ),
    VllmFlag(
        "--disable-frontend-multiprocessing",
        "no effect",
        "the HTTP front and engine share one process",
        takes_value=False,
    ),
    VllmFlag(
        "--enable-prompt-tokens-details",
        "no effect",
        "usage always has prompt_tokens_details.cached_tokens",
        takes_value=False,
    ),
    VllmFlag("--enable-server-load-tracking", "no effect", "load is always on /metrics", takes_value=False),
    VllmFlag(
        "--chat-template-content-format",
        "no effect",
        "text parts are joined into a string for every template",
    ),
    VllmFlag(
        "--enable-request-id-headers",
        "no effect",
        "X-Request-Id always comes back, and names the response's id",
        takes_value=False,
    ),
    VllmFlag("--uvicorn-log-level", "no effect", "--log-level sets uvicorn's level too"),
    VllmFlag("--max-logprobs", "no effect", "top_logprobs is limited to 20 (OpenAI's limit)"),
    VllmFlag(
        "--long-prefill-token-threshold",
        "no effect",
        "the SLO scheduler sizes prompt chunks by the TPOT target (--slo-tpot)",
    ),
    VllmFlag("--max-num-partial-prefills", "no effect", "the SLO scheduler orders prefills by deadline"),
    VllmFlag("--max-long-partial-prefills", "no effect", "the SLO scheduler orders prefills by deadline"),
    VllmFlag(
        "--load-format",
        "no effect",
        "safetensors or .gguf, found by the loader",
        ok_values=_ok("auto", "safetensors"),
    ),
    VllmFlag(
        "--tokenizer-mode", "no effect", "the model's Hugging Face tokenizer", ok_values=_ok("auto", "hf")
    ),
    VllmFlag(
        "--distributed-executor-backend",
        "no effect",
        "tensor-parallel ranks are local processes",
        ok_values=_ok("mp", "uni"),
    ),
    VllmFlag("--pipeline-parallel-size", "no effect", "no pipeline parallelism: only 1", ok_values=_ok("1")),
    VllmFlag(
        "--data-parallel-size",
        "no effect",
        "one engine per process: use --replicas N for more",
        ok_values=_ok("1"),
    ),
    VllmFlag("--api-server-count", "no effect", "one HTTP front per engine", ok_values=_ok("1")),
    VllmFlag(
        "--response-role", "no effect", "the assistant's role is `assistant`", ok_values=_ok("assistant")
    ),
    VllmFlag("--cpu-offload-gb", "no effect", "weights stay on the device", ok_values=_ok("0")),
    # Refused: tailserve cannot honour what the flag asks.
    VllmFlag("--no-enable-chunked-prefill", "refused", "prompts are always chunked", takes_value=False),
    VllmFlag(
        "--quantization", "refused", "pre-quantized checkpoints are not loaded: use --weight-format int4|int8"
    ),
    VllmFlag("--tokenizer", "refused", "the tokenizer is the model directory's own"),
    VllmFlag("--revision", "refused", _NO_HUB),
    VllmFlag("--tokenizer-revision", "refused", _NO_HUB),
    VllmFlag("--code-revision", "refused", _NO_HUB),
    VllmFlag("--hf-overrides", "refused", "the model's config.json is read as it is"),
    VllmFlag("--rope-scaling", "refused", "the model's config.json is read as it is"),
    VllmFlag("--num-gpu-blocks-override", "refused", "size the KV pool with --kv-cache-memory"),
    VllmFlag("--override-generation-config", "refused", "use --generation-config with a folder"),
    VllmFlag("--enable-lora", "refused", "no LoRA adapters", takes_value=False),
    VllmFlag("--lora-modules", "refused", "no LoRA adapters"),
    VllmFlag("--speculative-config", "refused", "no speculative decoding"),
    VllmFlag("--kv-transfer-config", "refused", "no disaggregated prefill / KV transfer"),
    VllmFlag("--reasoning-parser", "refused", "reasoning content is not split from the answer"),
    VllmFlag("--limit-mm-per-prompt", "refused", "text models only"),
    VllmFlag("--enable-sleep-mode", "refused", "no sleep mode", takes_value=False),
    VllmFlag("--allowed-origins", "refused", _CORS),
    VllmFlag("--allowed-methods", "refused", _CORS),
    VllmFlag("--allowed-headers", "refused", _CORS),
    VllmFlag("--allow-credentials", "refused", _CORS, takes_value=False),
    VllmFlag("--middleware", "refused", "no user ASGI middleware"),
    VllmFlag(
        "--otlp-traces-endpoint", "refused", "no OpenTelemetry export (see /metrics and tailserve_timings)"
    ),
    VllmFlag("--return-tokens-as-token-ids", "refused", "logprob tokens are always text", takes_value=False),
    VllmFlag("--headless", "refused", "the engine always has its HTTP front", takes_value=False),
    VllmFlag("--config", "refused", "no YAML config file: pass flags"),
)

_REGISTERED = tuple(f for f in FLAGS if f.kind in ("no effect", "refused"))


def register(parser: argparse.ArgumentParser) -> None:
    """Add the vLLM flags serve has no flag of its own for, in a help group of their own."""
    group = parser.add_argument_group("vLLM flags accepted with no effect or refused (docs/SERVER.md)")
    for f in _REGISTERED:
        help_text = f"{f.kind}: {f.why}"
        if f.takes_value:
            group.add_argument(f.flag, dest=f.dest, default=None, metavar="VALUE", help=help_text)
        else:
            group.add_argument(
                f.flag, dest=f.dest, action="store_const", const=True, default=None, help=help_text
            )


def given(args: argparse.Namespace) -> Iterator[tuple[VllmFlag, object]]:
    """The registered vLLM flags on this command line, with their values."""
    for f in _REGISTERED:
        value = getattr(args, f.dest, None)
        if value is not None:
            yield f, value


def check(args: argparse.Namespace) -> list[str]:
    """ConfigError naming the first refused flag (or a value outside a no-effect flag's own);
    else the log lines, one per flag accepted with no effect."""
    notes = []
    for f, value in given(args):
        shown = f.flag if value is True else f"{f.flag} {value}"
        if f.kind == "refused":
            raise ConfigError(f"{f.flag} (vLLM's) is refused: {f.why}")
        if f.ok_values is not None and str(value) not in f.ok_values:
            ok = ", ".join(sorted(f.ok_values))
            raise ConfigError(f"{shown} (vLLM's) is refused: {f.why} (accepted: {ok})")
        notes.append(f"{shown} (vLLM's) has no effect: {f.why}")
    return notes


def markdown_table() -> str:
    """The docs/SERVER.md table: vLLM flag | tailserve | kind | why."""
    rows = ["| vLLM flag | tailserve | kind | why |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        target = f"`{f.tailserve}`" if f.tailserve else ""
        rows.append(f"| `{f.flag}` | {target} | {f.kind} | {f.why} |")
    return "\n".join(rows)
