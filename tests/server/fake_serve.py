"""Run the real server stack (lifecycle + app) around FakeEngine as a process, for signal tests.

Usage: python tests/server/fake_serve.py --port P [--step-s S] [--drain-timeout S] [--wait-estimate-s S]
[--model-name NAME]; never loads a model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tailserve.server.config import ServerConfig  # noqa: E402
from tailserve.server.lifecycle import run_server  # noqa: E402
from tests.server.fake_engine import FakeEngine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-s", type=float, default=0.002)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument(
        "--wait-estimate-s", type=float, default=None, help="a predicted wait (5: every request 429)"
    )
    p.add_argument("--model-name", default="fake-model")
    args = p.parse_args()
    from tailserve.server.app import create_app

    config = ServerConfig(port=args.port, drain_timeout_s=args.drain_timeout, log_level="warning")
    engine = FakeEngine(step_s=args.step_s, wait_estimate_s=args.wait_estimate_s, model_name=args.model_name)
    return run_server(create_app(engine, config), config)


if __name__ == "__main__":
    sys.exit(main())
