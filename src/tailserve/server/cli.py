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
from tailserve.server.config import LOG_LEVELS, ServerConfig
from tailserve.server.slo_classes import SloClasses

# Flag defaults are the configs' own, so `--help` shows what a run gets.
_MODEL, _CACHE, _SCHED, _SERVER = ModelConfig(), CacheConfig(), SchedulerConfig(), ServerConfig()


def register(subparsers: Any) -> None:
    """Add `serve` to the `tailserve` argument tree."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description=__doc__.splitlines()[0]
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="default", help="HF dir, .gguf file, 'default' or 'dummy:<preset>'")
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
    m.add_argument("--dtype", choices=DTYPES, default="auto", help=argparse.SUPPRESS)  # old --weight-format
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
        "--max-num-seqs", type=int, default=_SCHED.max_num_seqs, help="most requests running at once"
    )
    s.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default=_SCHED.policy,
        help="slo: deadline-ordered prefill within the TPOT target; fcfs: arrival order (docs/ENGINE.md)",
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
        "--api-key", default=os.environ.get("TAILSERVE_API_KEY"), help="Bearer token (env TAILSERVE_API_KEY)"
    )
    h.add_argument("--max-body-bytes", default="4MiB", help="request body limit, e.g. 4MiB (413 beyond)")
    h.add_argument(
        "--cache-salt-from-api-key",
        action="store_true",
        help="derive each request's cache_salt from its API key (and its own cache_salt), so different "
        "keys never share prefix-cache blocks (default off: the request's cache_salt, as vLLM)",
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
    p.set_defaults(func=serve)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from parsed flags; ConfigError names the flag to fix."""
    engine = EngineConfig(
        model=from_flags(ModelConfig, args),
        cache=from_flags(
            CacheConfig,
            args,
            kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        kv_events=KVEventsConfig.from_json(args.kv_events_config)
        if args.kv_events_config
        else KVEventsConfig(),
        scheduler=from_flags(
            SchedulerConfig,
            args,
            policy=args.schedule_policy,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
        ),
    )
    slo_classes = SloClasses.load(args.slo_classes, engine.scheduler) if args.slo_classes else None
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
    )
    return engine, server


def serve(args: argparse.Namespace) -> int:
    """Handler of `tailserve serve`: 0 after a clean drain, 1 if the model fails to load, 2 on bad flags."""
    if args.replicas > 1:
        from tailserve.router.launcher import run_replicas

        return int(run_replicas(args))
    if args.replicas < 1:
        print("tailserve serve: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        engine_config, server_config = configs_from_args(args)
    except ConfigError as exc:
        print(f"tailserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from tailserve.engine import AsyncEngine
    from tailserve.server.app import create_app
    from tailserve.server.generation_defaults import model_file, read_generation_defaults
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
    generation = read_generation_defaults(model_file(args.model))
    server_config = dataclasses.replace(server_config, generation=generation)
    try:
        return run_server(create_app(engine, server_config), server_config)
    finally:
        engine.close()  # stops tensor-parallel workers after the drain
