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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default value, unless the help already says it, the
    default says nothing (None, an on/off flag's False) or comes from the environment ("(env NAME)"
    in the help: it may be a secret)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _shows_default(action) or any(s in text for s in ("(default", "%(default)", "(env ")):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.help is argparse.SUPPRESS:
        return False
    if isinstance(default, bool) and action.nargs == 0:  # store_true / store_false
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every sub-command below it the defaults-showing formatter; an option
    without help text gets one that is only its default, so none is left out."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_defaults(sub)
        elif action.help is None and _shows_default(action):
            action.help = "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every package's sub-commands, each option's default in its help."""
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
    _with_defaults(parser)
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
