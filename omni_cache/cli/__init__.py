"""The ``omni-cache`` console command.

Owns: argument parsing and dispatch. Each subcommand lives in its own module
``omni_cache.cli.<name>`` exposing ``register(subparsers)``, which adds its parser
and sets ``func(args) -> int``. Modules are imported only to build the parser;
heavy imports happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommands, in the order ``omni-cache --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("selfcheck", "diagram", "simulate", "bench", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-cache",
        description="A formally specified prefix cache for multi-stage (omni) model serving.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"omni_cache.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
