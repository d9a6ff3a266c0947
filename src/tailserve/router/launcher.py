"""`tailserve serve --replicas N`: N local `tailserve serve` children behind one router.

Children listen on consecutive free ports of 127.0.0.1 (one GPU each on a multi-GPU host); the
router takes the serve command's host and port. Children are terminated however the router ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import FrameType

import httpx

from tailserve.config import parse_bytes
from tailserve.router.config import RouterConfig

REPLICA_HOST = "127.0.0.1"
# Flags the launcher sets per child itself; everything else on the serve command line passes through.
# The API key travels in the environment, not on a command line that `ps` shows.
_OWN_FLAGS = ("--replicas", "--host", "--port", "--api-key")
_SKIP_ATTRS = {"command", "func", "host", "port", "replicas", "api_key"}
API_KEY_ENV = "TAILSERVE_API_KEY"


def port_is_free(port: int, host: str = REPLICA_HOST) -> bool:
    """Whether a TCP listener could bind host:port now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def consecutive_free_ports(count: int, start: int, avoid: int | None = None) -> list[int]:
    """The first run of `count` consecutive free ports at or above `start`."""
    port = max(start, 1024)
    while port + count <= 65535:
        run = list(range(port, port + count))
        busy = [p for p in run if p == avoid or not port_is_free(p)]
        if not busy:
            return run
        port = busy[-1] + 1
    raise RuntimeError(f"no {count} consecutive free ports above {start}")


def strip_own_flags(argv: Sequence[str]) -> list[str]:
    """The serve command line without --replicas/--host/--port (either `--flag V` or `--flag=V`)."""
    out: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        if arg in _OWN_FLAGS:
            skip_value = True
            continue
        if arg.startswith(tuple(f"{flag}=" for flag in _OWN_FLAGS)):
            continue
        out.append(arg)
    return out


def flags_from_namespace(args: argparse.Namespace) -> list[str]:
    """Best-effort flags rebuilt from parsed args (used when the command line is not sys.argv)."""
    out: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in _SKIP_ATTRS or value is None or value is False or callable(value):
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def replica_flags(args: argparse.Namespace, argv: Sequence[str]) -> list[str]:
    """The serve flags every child gets: the user's own command line when it is `serve ...`."""
    if "serve" in argv[1:]:
        return strip_own_flags(list(argv)[list(argv).index("serve", 1) + 1 :])
    return flags_from_namespace(args)


def visible_gpus() -> list[str]:
    """GPU ids this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi), without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]


def child_env(index: int, gpus: Sequence[str], api_key: str | None = None) -> dict[str, str]:
    """The environment of replica `index`: one GPU of its own when there are several."""
    env = dict(os.environ)
    if api_key:
        env[API_KEY_ENV] = api_key
    if len(gpus) > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return env


def wait_ready(
    urls: Sequence[str],
    children: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
    poll_s: float = 0.2,
) -> None:
    """Block until every URL answers /ready with 200; fail fast if one of `children` (the processes
    behind `urls`, in order; may be empty) exits."""
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for url, child in zip(urls, children, strict=False):
                if child.poll() is not None:
                    raise RuntimeError(
                        f"replica {url} exited with code {child.returncode} before it was ready"
                    )
            for url in sorted(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/ready").status_code == 200:
                        pending.discard(url)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"replicas not ready after {timeout_s:.0f} s: {', '.join(sorted(pending))}"
                )
            if pending:
                time.sleep(poll_s)


def terminate(children: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM every child, wait up to `grace_s` in all, then SIGKILL the ones still there."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so that `finally` blocks (terminating children) run."""

    def _exit(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_replicas(args: argparse.Namespace) -> int:
    """Start args.replicas `tailserve serve` children, wait for them, route on args.host:args.port."""
    from tailserve.router.cli import serve_router

    count = int(args.replicas)
    flags = replica_flags(args, sys.argv)
    gpus = visible_gpus()
    ports = consecutive_free_ports(count, int(args.port) + 1, avoid=int(args.port))
    urls = [f"http://{REPLICA_HOST}:{port}" for port in ports]
    children: list[subprocess.Popen[bytes]] = []
    with sigterm_as_exit():
        try:
            for i, port in enumerate(ports):
                cmd = [sys.executable, "-m", "tailserve.cli", "serve", *flags]
                cmd += ["--host", REPLICA_HOST, "--port", str(port)]
                print(f"tailserve: replica {i} on {urls[i]}: {' '.join(cmd[3:])}", flush=True)
                env = child_env(i, gpus, getattr(args, "api_key", None))
                children.append(subprocess.Popen(cmd, env=env))
            wait_ready(urls, children, float(getattr(args, "replica_start_timeout", 900.0)))
            config = RouterConfig(
                replicas=tuple(urls),
                policy=getattr(args, "router_policy", None) or "prefix",
                host=args.host,
                port=int(args.port),
                api_key=getattr(args, "api_key", None) or None,
                max_body_bytes=parse_bytes(str(getattr(args, "max_body_bytes", None) or "4MiB")),
                drain_timeout_s=float(getattr(args, "drain_timeout", 30.0) or 0.0),
            )
            print(f"tailserve: routing on http://{args.host}:{args.port} ({config.policy})", flush=True)
            code = serve_router(config, getattr(args, "log_level", "info") or "info")
        finally:
            # The children drain in-flight requests on SIGTERM; give them that long.
            terminate(children, float(getattr(args, "drain_timeout", 10.0) or 10.0) + 5.0)
    return code
