"""`tailserve serve`: flags -> EngineConfig + ServerConfig, then the engine under uvicorn.

Imports nothing heavy at module level (no fastapi, uvicorn, torch or engine): those load inside the
handler, so `tailserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tailserve.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    SCHEDULE_POLICIES,
    WEIGHT_FORMATS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    from_flags,
    parse_bytes,
)
from tailserve.errors import ConfigError, ModelLoadError
from tailserve.http.tls import TlsFiles
from tailserve.server import vllm_flags
from tailserve.server.config import LOG_LEVELS, ServerConfig
from tailserve.server.generation_defaults import GenerationDefaults, model_file, read_generation_defaults
from tailserve.server.slo_classes import SloClasses

log = logging.getLogger("tailserve.server")

# Flag defaults are the configs' own, so `--help` shows what a run gets.
_MODEL, _CACHE, _SCHED, _SERVER = ModelConfig(), CacheConfig(), SchedulerConfig(), ServerConfig()


def register(subparsers: Any) -> None:
    """Add `serve` to the `tailserve` argument tree."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vLLM's `vllm serve MODEL` (or --model)",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help=f"HF dir, .gguf file, 'default' or 'dummy:<preset>' (default: {_MODEL.model})",
    )
    m.add_argument("--served-model-name", default=None, help="name in /v1/models and the 'model' field")
    m.add_argument(
        "--weight-format",
        choices=WEIGHT_FORMATS,
        default="auto",
        help="weights and their kernels; fp32 runs fp32 activations, the rest bf16 (see docs/ENGINE.md)",
    )
    m.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto: the activation dtype"
    )
    m.add_argument(
        "--force-weight-format",
        action="store_true",
        help="serve --weight-format even if it fails the quality gate (see `tailserve eval`)",
    )
    m.add_argument(
        "--dtype",
        choices=DTYPES,
        default=_MODEL.dtype,
        help="vLLM's: the activation dtype. float32/float: fp32 weights too; bfloat16: bf16 weights "
        "unless --weight-format is int4/int8; auto: --weight-format decides; float16/half are refused",
    )
    m.add_argument(
        "--chat-template",
        default=None,
        help="vLLM's: a Jinja chat template file, or the template itself, instead of the tokenizer's",
    )
    m.add_argument(
        "--generation-config",
        default="auto",
        help="vLLM's: where sampling defaults come from: auto (the model's generation_config.json), "
        "vllm (none: the server's), or a folder holding a generation_config.json",
    )
    m.add_argument("--device", choices=DEVICES, default="auto", help="auto: CUDA when available")
    m.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's, <= 8192)"
    )
    m.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    m.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads for the model (default: cores - 1, min 1)"
    )
    m.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N ranks: this process and N-1 workers (gloo on CPU, NCCL on CUDA)",
    )
    c = p.add_argument_group("KV cache")
    c.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (default: 1 GiB on CPU)")
    c.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_CACHE.gpu_memory_utilization,
        help="CUDA: share of device memory for weights and KV pool",
    )
    c.add_argument("--block-size", type=int, default=_CACHE.block_size, help="tokens per KV block")
    c.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's spelling: prefix caching on (the default) or off (--no-enable-prefix-caching)",
    )
    c.add_argument(
        "--kv-cache-memory-bytes", type=int, default=None, help="vLLM's: --kv-cache-memory in bytes"
    )
    c.add_argument(
        "--prefix-cache-seed",
        default=os.environ.get("PYTHONHASHSEED"),
        help="root of the prefix cache's block keys, as vLLM's PYTHONHASHSEED (its default here): set "
        "it to let routers rebuild the keys from tokens; unset, a random root per process",
    )
    c.add_argument(
        "--kv-events-config",
        default=None,
        help="publish prefix-cache events in vLLM's format, with vLLM's JSON (e.g. '{\"enable_kv_cache_events\": "
        'true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'); default off (docs/ROUTER.md)',
    )
    s = p.add_argument_group("scheduler and admission")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_SCHED.max_num_batched_tokens,
        help="per-step token budget",
    )
    s.add_argument(
        "--prefill-step-tokens",
        type=int,
        default=_SCHED.prefill_step_tokens,
        help="prompt tokens a step may carry while no stream decodes (at least the step budget; "
        "0: the step budget). Not where prompt rows run oneDNN (CPUs without AMX) or under tensor parallelism",
    )
    s.add_argument(
        "--max-num-seqs", type=int, default=_SCHED.max_num_seqs, help="most requests running at once"
    )
    s.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default=_SCHED.policy,
        help="slo: deadline-ordered prefill within the TPOT target; fcfs: arrival order (docs/ENGINE.md)",
    )
    s.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=None,
        help="vLLM's: fcfs is --schedule-policy fcfs; priority is refused (slo orders by deadline)",
    )
    s.add_argument(
        "--max-waiting", type=int, default=_SCHED.max_waiting, help="waiting-queue bound; beyond it 429"
    )
    s.add_argument(
        "--slo-ttft",
        type=float,
        default=_SCHED.slo_ttft_s,
        help="TTFT target, seconds; predicted misses get 429",
    )
    s.add_argument(
        "--slo-tpot",
        type=float,
        default=_SCHED.slo_tpot_s,
        help="TPOT target, seconds per token: it bounds each step's time",
    )
    s.add_argument(
        "--no-admission-correction",
        action="store_true",
        help="admit on the engine's TTFT predictions as they are, not scaled by the error learned "
        "from admitted requests (tailserve_admission_correction)",
    )
    s.add_argument(
        "--slo-classes",
        default=None,
        metavar="FILE",
        help="JSON: SLO classes (ttft_ms, tpot_ms) and API key / model name -> class (docs/SERVER.md)",
    )
    s.add_argument(
        "--prefill-floor",
        type=float,
        default=_SCHED.prefill_floor,
        help="slo: share of the step budget prefill keeps beside decodes (0: one block)",
    )
    s.add_argument(
        "--prefill-lane",
        action=argparse.BooleanOptionalAction,
        default=_SCHED.prefill_lane,
        help="CPU, 2+ threads: while streams decode, prompt chunks run on half the threads beside the "
        "decode steps instead of inside them (the steady-tail lane; --no-prefill-lane: one step for all)",
    )
    s.add_argument(
        "--lane-chunk-tokens",
        type=int,
        default=_SCHED.lane_chunk_tokens,
        help="with the prefill lane: most prompt tokens one lane chunk carries (its own budget, apart "
        "from --max-num-batched-tokens, which bounds the steps that decode)",
    )
    s.add_argument(
        "--admission-hold",
        action=argparse.BooleanOptionalAction,
        default=_SCHED.admission_hold,
        help="where a request let in at once would push a stream over its TPOT target, queue its "
        "prompt until a stream is expected to end, if its TTFT target still holds, instead of a 429 "
        "(--no-admission-hold: refuse it)",
    )
    s.add_argument(
        "--pace-lane",
        action=argparse.BooleanOptionalAction,
        default=_SCHED.pace_lane,
        help="with the prefill lane: run a prompt chunk there only where every stream's TPOT target "
        "has room for the slower decode steps beside it, unless a prompt's TTFT deadline needs it "
        "(--no-pace-lane: the lane runs whenever prompt work waits)",
    )
    s.add_argument(
        "--late-prompts-all-threads",
        action=argparse.BooleanOptionalAction,
        default=_SCHED.late_prompts_all_threads,
        help="with the prefill lane: a prompt whose TTFT target would pass on the lane, and not on all "
        "threads, runs on all threads in the decodes' step where every stream's TPOT target has room "
        "for that long step (--no-late-prompts-all-threads: prompts go on the lane while streams decode)",
    )
    s.add_argument(
        "--past-saving-share",
        type=float,
        default=_SCHED.past_saving_share,
        help="slo: share of each step's prefill kept for requests past their TTFT deadline",
    )
    s.add_argument(
        "--urgent-slack",
        type=float,
        default=_SCHED.urgent_slack,
        help="slo: a prompt goes earliest-deadline-first once its slack is under this share of its "
        "TTFT target, shortest (prompt x target) first before (1, the default: deadline order for all)",
    )
    h = p.add_argument_group("HTTP")
    h.add_argument(
        "--host",
        default=_SERVER.host,
        help="bind address: loopback only unless changed (0.0.0.0: all interfaces)",
    )
    h.add_argument("--port", type=int, default=_SERVER.port, help="HTTP port")
    h.add_argument(
        "--api-key",
        default=os.environ.get("TAILSERVE_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="Bearer token (env TAILSERVE_API_KEY, else vLLM's VLLM_API_KEY)",
    )
    h.add_argument("--max-body-bytes", default="4MiB", help="request body limit, e.g. 4MiB (413 beyond)")
    h.add_argument(
        "--cache-salt-from-api-key",
        action="store_true",
        help="derive each request's cache_salt from its API key (and its own cache_salt), so different "
        "keys never share prefix-cache blocks (default off: the request's cache_salt, as vLLM)",
    )
    h.add_argument(
        "--trust-request-slo",
        "--trust-slo-headers",  # its old name, when it covered the headers only
        dest="trust_request_slo",
        action="store_true",
        help="requests come from a trusted front: their x-slo-ttft-ms / x-slo-tpot-ms headers and body "
        "`slo` / `priority` may tighten the caller's SLO class (default off: they may only loosen it; "
        "--trust-slo-headers is the old name)",
    )
    h.add_argument(
        "--drain-timeout",
        type=float,
        default=_SERVER.drain_timeout_s,
        help="seconds to finish in-flight requests on SIGTERM",
    )
    h.add_argument("--log-level", choices=LOG_LEVELS, default=_SERVER.log_level, help="log verbosity")
    h.add_argument(
        "--max-tokens-default",
        type=int,
        default=_SERVER.max_tokens_default,
        help="tokens generated for a request without max_tokens (shown in /v1/models)",
    )
    h.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up (kernels and one generation) before /ready"
    )
    h.add_argument(
        "--no-kernel-warmup",
        action="store_true",
        help="skip creating the CPU prompt-row kernels of every row count before /ready (saves 3-9 s of "
        "start-up on 2 cores; serving then compiles one per new row count, ~20 ms, and its memory grows as it does)",
    )
    h.add_argument(
        "--switch-interval-ms",
        type=float,
        default=_SERVER.switch_interval_s * 1000,
        help="GIL switch interval of the server process (Python's own by default): how long the engine "
        "thread may wait for the GIL back from the HTTP thread after each model call",
    )
    h.add_argument("--replicas", type=int, default=1, help="run N engine replicas behind the router")
    h.add_argument("--root-path", default="", help="ASGI root path behind a path-prefixing proxy")
    h.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    h.add_argument("--disable-fastapi-docs", action="store_true", help="serve no /openapi.json")
    t = p.add_argument_group("TLS (vLLM's flags)")
    t.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    t.add_argument("--ssl-keyfile", default=None, help="its private key (PEM)")
    t.add_argument(
        "--ssl-ca-certs", default=None, help="CA bundle that client certificates are checked against"
    )
    t.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="client certificates: 0 not asked, 1 optional, 2 required",
    )
    t.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="re-read the certificate files when they change (new connections get the new one)",
    )
    vllm_flags.register(p)
    p.set_defaults(func=serve)


def model_from_args(args: argparse.Namespace) -> str:
    """The model: the positional MODEL (vLLM's form) or --model, not two different ones."""
    positional, flag = args.model_positional, args.model
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"two models given: MODEL {positional!r} and --model {flag!r}; pass one")
    return str(positional or flag or _MODEL.model)


def _prefix_caching(args: argparse.Namespace) -> bool:
    if args.no_prefix_caching and args.enable_prefix_caching:
        raise ConfigError("--no-prefix-caching contradicts --enable-prefix-caching; pass one")
    return not args.no_prefix_caching and args.enable_prefix_caching is not False


def _kv_cache_memory_bytes(args: argparse.Namespace) -> int | None:
    if args.kv_cache_memory is not None and args.kv_cache_memory_bytes is not None:
        raise ConfigError("--kv-cache-memory and --kv-cache-memory-bytes both given; pass one")
    if args.kv_cache_memory_bytes is not None:
        return int(args.kv_cache_memory_bytes)
    return parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None


def _schedule_policy(args: argparse.Namespace) -> str:
    if args.scheduling_policy == "priority":
        raise ConfigError(
            "--scheduling-policy priority (vLLM's) is refused: tailserve orders prompts by TTFT "
            "deadline and SLO class (--schedule-policy slo; a request's `priority` names a class)"
        )
    return str(args.scheduling_policy or args.schedule_policy)


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    extra = args.ssl_keyfile or args.ssl_ca_certs or args.ssl_cert_reqs or args.enable_ssl_refresh
    if args.ssl_certfile is None:
        if extra:
            raise ConfigError(
                "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs and --enable-ssl-refresh need --ssl-certfile"
            )
        return None
    return TlsFiles(
        args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.enable_ssl_refresh
    )


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from parsed flags; ConfigError names the flag to fix (a refused vLLM flag too)."""
    vllm_flags.check(args)
    engine = EngineConfig(
        model=from_flags(ModelConfig, args, model=model_from_args(args)),
        cache=from_flags(
            CacheConfig,
            args,
            kv_cache_memory_bytes=_kv_cache_memory_bytes(args),
            enable_prefix_caching=_prefix_caching(args),
        ),
        kv_events=KVEventsConfig.from_json(args.kv_events_config)
        if args.kv_events_config
        else KVEventsConfig(),
        scheduler=from_flags(
            SchedulerConfig,
            args,
            policy=_schedule_policy(args),
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
        ),
    )
    slo_classes = SloClasses.load(args.slo_classes, engine.scheduler) if args.slo_classes else None
    if slo_classes is not None:
        engine = dataclasses.replace(engine, scheduler=slo_classes.scheduler_config(engine.scheduler))
    server = from_flags(
        ServerConfig,
        args,
        api_key=args.api_key or None,
        max_body_bytes=parse_bytes(args.max_body_bytes),
        drain_timeout_s=args.drain_timeout,
        warmup=not args.no_warmup,
        slo_classes=slo_classes,
        switch_interval_s=args.switch_interval_ms / 1000,
        admission_correction=not args.no_admission_correction,
        tls=_tls(args),
        access_log=not args.disable_uvicorn_access_log,
        openapi=not args.disable_fastapi_docs,
    )
    return engine, server


def serve(args: argparse.Namespace) -> int:
    """Handler of `tailserve serve`: 0 after a clean drain, 1 if the model fails to load, 2 on bad flags."""
    try:
        args.model = model_from_args(args)
        if args.replicas > 1 and args.ssl_certfile:
            raise ConfigError("--ssl-certfile with --replicas: the router speaks plain HTTP to its replicas")
        if args.replicas > 1:
            from tailserve.router.launcher import run_replicas

            return int(run_replicas(args))
        if args.replicas < 1:
            raise ConfigError("--replicas must be at least 1")
        engine_config, server_config = configs_from_args(args)
        generation = generation_defaults(args.generation_config, args.model)
        chat_template = read_chat_template(args.chat_template)
    except ConfigError as exc:
        print(f"tailserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for note in vllm_flags.check(args):  # once, at start: nothing on the command line goes unseen
        log.warning("%s", note)

    from tailserve.engine import AsyncEngine
    from tailserve.server.app import create_app
    from tailserve.server.lifecycle import run_server

    try:
        # The engine thread creates every prompt-row kernel before the warm-up generation, so /ready
        # waits for it (tailserve.kernels.onednn).
        warm_kernels = server_config.warmup and not args.no_kernel_warmup
        engine = AsyncEngine(engine_config, warm_kernels=warm_kernels)
    except ModelLoadError as exc:
        print(f"tailserve serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # e.g. a --tensor-parallel-size the model cannot split into
        print(f"tailserve serve: {exc}", file=sys.stderr)
        return 2
    engine.exit_process_on_worker_death()  # tensor parallelism: a dead worker ends the server
    if chat_template is not None:
        set_template = getattr(engine.tokenizer, "set_chat_template", None)
        if set_template is None:
            engine.close()
            print(
                f"tailserve serve: --chat-template: {args.model} has no chat-capable tokenizer",
                file=sys.stderr,
            )
            return 2
        set_template(chat_template)
    server_config = dataclasses.replace(server_config, generation=generation)
    try:
        return run_server(create_app(engine, server_config), server_config)
    finally:
        engine.close()  # stops tensor-parallel workers after the drain


def generation_defaults(source: str, model: str) -> GenerationDefaults:
    """--generation-config (vLLM's): auto, the model's generation_config.json; vllm, none (the
    server's own defaults); else a folder holding a generation_config.json."""
    if source == "auto":
        return read_generation_defaults(model_file(model))
    if source == "vllm":
        return GenerationDefaults()
    folder = Path(source)
    if not (folder / "generation_config.json").is_file():
        raise ConfigError(f"--generation-config {source}: no generation_config.json in that folder")
    return read_generation_defaults(folder)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template (vLLM's): a file's text, or the value itself when it is a template (has
    Jinja markup); a path that does not exist and is no template is a ConfigError."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value.encode().decode("unicode_escape") if "\\n" in value else value
    raise ConfigError(f"--chat-template {value}: no such file, and not a Jinja template")
