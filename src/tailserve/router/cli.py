"""`tailserve route`: run the router in front of replicas given by URL.

Imports nothing heavy at module level; the app and uvicorn load inside the handler.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tailserve.config import parse_bytes
from tailserve.router.config import POLICIES, RouterConfig


def register(subparsers: Any) -> None:
    """Add the `route` sub-command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "route",
        help="load-balance OpenAI-compatible requests across tailserve replicas",
        description="An OpenAI-compatible router: places each request on a replica by live load "
        "and prefix affinity, with health checks and failover.",
    )
    parser.add_argument(
        "--replica", action="append", required=True, metavar="URL", help="a replica base URL (repeat)"
    )
    parser.add_argument(
        "--policy", choices=POLICIES, default="prefix", help="placement policy (default: prefix)"
    )
    add_router_options(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("TAILSERVE_API_KEY"), help="Bearer token (env TAILSERVE_API_KEY)"
    )
    parser.add_argument("--max-body-bytes", default="4MiB", help="request body limit, e.g. 4MiB (413 beyond)")
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    parser.set_defaults(func=run_route)


def add_router_options(parser: argparse.ArgumentParser) -> None:
    """Tuning flags shared by `route` (health checks, retries, prefix affinity)."""
    defaults = RouterConfig(replicas=("http://placeholder",))
    group = parser.add_argument_group("router tuning")
    group.add_argument("--health-interval", type=float, default=defaults.health_interval_s, metavar="S")
    group.add_argument("--health-timeout", type=float, default=defaults.health_timeout_s, metavar="S")
    group.add_argument("--unhealthy-threshold", type=int, default=defaults.unhealthy_threshold, metavar="N")
    group.add_argument("--healthy-threshold", type=int, default=defaults.healthy_threshold, metavar="N")
    group.add_argument("--load-interval", type=float, default=defaults.load_interval_s, metavar="S")
    group.add_argument("--max-attempts", type=int, default=defaults.max_attempts, metavar="N")
    group.add_argument("--prefix-block-chars", type=int, default=defaults.prefix_block_chars, metavar="N")
    group.add_argument("--prefix-load-bound", type=float, default=defaults.prefix_load_bound, metavar="LOAD")


def config_from_args(args: argparse.Namespace, replicas: list[str]) -> RouterConfig:
    """A RouterConfig from parsed flags (missing tuning flags keep their defaults)."""
    defaults = RouterConfig(replicas=tuple(replicas))
    return RouterConfig(
        replicas=tuple(replicas),
        policy=getattr(args, "policy", None) or defaults.policy,
        host=args.host,
        port=args.port,
        health_interval_s=getattr(args, "health_interval", defaults.health_interval_s),
        health_timeout_s=getattr(args, "health_timeout", defaults.health_timeout_s),
        unhealthy_threshold=getattr(args, "unhealthy_threshold", defaults.unhealthy_threshold),
        healthy_threshold=getattr(args, "healthy_threshold", defaults.healthy_threshold),
        load_interval_s=getattr(args, "load_interval", defaults.load_interval_s),
        max_attempts=getattr(args, "max_attempts", defaults.max_attempts),
        prefix_block_chars=getattr(args, "prefix_block_chars", defaults.prefix_block_chars),
        prefix_load_bound=getattr(args, "prefix_load_bound", defaults.prefix_load_bound),
        api_key=getattr(args, "api_key", None) or None,
        max_body_bytes=parse_bytes(getattr(args, "max_body_bytes", None) or "4MiB"),
        drain_timeout_s=float(getattr(args, "drain_timeout", defaults.drain_timeout_s)),
    )


def serve_router(config: RouterConfig, log_level: str = "info") -> int:
    """Run the router on config.host:config.port until SIGINT/SIGTERM, draining as the server does;
    0 after a clean drain, 1 if it could not start."""
    import logging

    from tailserve.http.serve import serve_until_drained
    from tailserve.router.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    return serve_until_drained(
        app,
        app.state.router.drain,
        host=config.host,
        port=config.port,
        log_level=log_level,
        drain_timeout_s=config.drain_timeout_s,
        access_log=False,
    )


def run_route(args: argparse.Namespace) -> int:
    """Handler of `tailserve route`."""
    from tailserve.errors import ConfigError

    try:
        config = config_from_args(args, args.replica)
    except ConfigError as exc:
        print(f"tailserve route: {exc}")
        return 2
    return serve_router(config, args.log_level)
