"""tailserve on Ray Serve: `serve run tailserve.integrations.ray_serve:build_app model=default
num_replicas=2` runs N replicas, each the whole OpenAI server (routes, SSE, errors, admission's 429)
around its own engine, behind Ray Serve's HTTP proxy and its default request router.

Ray's app-builder convention: `build_app(args)` takes `tailserve serve`'s flags as `key=value` (dashes
or underscores) plus `num_replicas`, `num_cpus`, `num_gpus` per replica. Needs `ray[serve]` (pinned
2.60.0 in the dev extras); nothing else in tailserve imports Ray.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from tailserve.config import EngineConfig
from tailserve.engine import AsyncEngine
from tailserve.server import cli as server_cli
from tailserve.server.app import create_app
from tailserve.server.config import ServerConfig

DEPLOYMENT_KEYS = ("num_replicas", "num_cpus", "num_gpus")  # Ray's, not `tailserve serve` flags


def serve_configs(args: Mapping[str, object]) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from `tailserve serve` flags given as a mapping (`true` turns a switch on);
    ConfigError or argparse's exit names a bad one, as on the command line."""
    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value)
        if text.lower() == "true":
            argv.append(flag)
        elif text.lower() != "false":
            argv += [flag, text]
    parser = argparse.ArgumentParser(prog="tailserve")
    server_cli.register(parser.add_subparsers(dest="command"))
    return server_cli.configs_from_args(parser.parse_args(argv))


def build_app(args: Mapping[str, object]) -> Application:
    """The Ray Serve application: `num_replicas` copies of one deployment, each building its engine
    and server inside its own replica (the model loads there, not in the driver). Host and port are
    Ray's proxy's (`serve start --http-host/--http-port`); --host/--port here are ignored."""
    flags = {k: v for k, v in args.items() if k.replace("-", "_") not in DEPLOYMENT_KEYS}
    engine_config, server_config = serve_configs(flags)
    options = {k.replace("-", "_"): v for k, v in args.items() if k.replace("-", "_") in DEPLOYMENT_KEYS}

    def server() -> FastAPI:
        """Runs in the replica: its engine and the same app `tailserve serve` runs (lifespan included:
        Ray Serve starts the engine and warms it up, and drains it when the replica stops)."""
        return create_app(AsyncEngine(engine_config), server_config)

    @serve.deployment(
        name="tailserve",
        num_replicas=int(str(options.get("num_replicas", 1))),
        ray_actor_options={
            "num_cpus": float(str(options.get("num_cpus", 1))),
            "num_gpus": float(str(options.get("num_gpus", 0))),
        },
    )
    @serve.ingress(server)
    class TailserveReplica:
        """One engine and its OpenAI server."""

    return TailserveReplica.bind()  # type: ignore[attr-defined, no-any-return]
