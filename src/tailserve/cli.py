"""`tailserve` command line: one argparse tree; each package registers its own sub-commands.

Package `cli` modules import nothing heavy at module level, so `tailserve plan --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Packages that own sub-commands, in help order.
_COMMAND_MODULES = (
    "tailserve.server.cli",
    "tailserve.engine.cli",
    "tailserve.quality.cli",
    "tailserve.bench.cli",
    "tailserve.router.cli",
    "tailserve.plan.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every package's sub-commands."""
    parser = argparse.ArgumentParser(prog="tailserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tailserve` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
