"""The ``omni-cache`` console command.

Owns: argument parsing and dispatch. Each subcommand lives in its own module
``omni_cache.cli.<name>`` exposing ``register(subparsers)``, which adds its parser
and sets ``func(args) -> int``. Modules are imported only to build the parser;
heavy imports happen inside ``func``. Validation of arguments lives in
``omni_cache.cli.args`` (exit codes there): a user mistake gets one line and the
usage of the (sub)command it belongs to, exit 2, never a traceback. A runtime
error that escapes a subcommand is one line too (exit 1); the ``--debug``
flag shows its traceback. SIGTERM (``kill``, ``timeout``, a cancelled job) ends a command as
Ctrl-C does -- every server it started stopped, every temporary folder removed -- with one line
and exit 143.

Upholds nothing (dispatch).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import select
import signal
import sys
from collections.abc import Sequence

from omni_cache.cli.args import EXIT_FAILED, CliParser, add_debug_flag
from omni_cache.harness.exit_codes import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_TERMINATED

# Subcommands, in the order ``omni-cache --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("selfcheck", "diagram", "simulate", "pipeline", "serve", "check-server", "bench",
                                 "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="omni-cache",
        description="A formally specified prefix cache for multi-stage (omni) model serving.",
        epilog="Exit codes: 0 ok; 1 a check failed; 2 bad arguments; 3 ran, but did less than asked "
        "or missed its target; 130 Ctrl-C; 143 SIGTERM; 141 stdout's reader left (| head). "
        "`omni-cache COMMAND --help` describes each command.",
    )
    add_debug_flag(parser, top_level=True)
    # Not required here: main() reports a missing command itself, so `omni-cache --bogus` names --bogus.
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"omni_cache.cli.{name.replace('-', '_')}").register(subparsers)
    for sub in subparsers.choices.values():
        add_debug_flag(sub, top_level=False)
    parser.set_defaults(_subparsers=subparsers.choices)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse like ``omni-cache`` does: every error exits 2 with the right parser's usage."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)} (a COMMAND comes first: "
                         f"{', '.join(SUBCOMMANDS)})")
        parser.error(f"a COMMAND is required: one of {', '.join(SUBCOMMANDS)}")
    if extras:
        hint = " (vLLM's options go after MODEL)" if args.command == "serve" else ""
        args._subparsers[args.command].error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            if sys.stdout is not None:  # None: started with stdout closed
                sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush
    except BrokenPipeError:  # stdout's reader left (``| head``): it read what it wanted; no error line
        if not _stdout_reader_gone():
            raise  # another pipe's, re-raised by --debug: its traceback
        with contextlib.suppress(OSError, ValueError, AttributeError):  # NOTE: so the last flush cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _stdout_reader_gone() -> bool:
    """stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real stdout, or no poll here
        return False


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is: a ``KeyboardInterrupt``, so every cleanup an interrupt
    runs (a server stopped, a temporary folder removed) runs for it too."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _run(argv: Sequence[str] | None) -> int:
    installed = False
    with contextlib.suppress(ValueError):  # ValueError: not the main thread (an embedding caller's)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # never over a handler someone installed
            signal.signal(signal.SIGTERM, _raise_terminated)
            installed = True
    try:
        return _dispatch(argv)
    finally:
        if installed:  # a caller that runs main() in its own process gets its default back
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _dispatch(argv: Sequence[str] | None) -> int:
    try:
        args = parse_args(argv)
    except KeyboardInterrupt as exc:
        return _interrupted("omni-cache", exc)
    try:
        return int(args.func(args) or 0)  # torch and the rest are imported in here, after parsing
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, also while torch loads: one line
        return _interrupted(f"omni-cache {args.command}", exc)
    except BrokenPipeError as exc:
        if _stdout_reader_gone():
            raise  # main ends it quietly
        return _failed(args, exc)
    except Exception as exc:
        return _failed(args, exc)


def _interrupted(who: str, exc: KeyboardInterrupt) -> int:
    """Ctrl-C (exit 130) or SIGTERM (exit 143): one line."""
    terminated = isinstance(exc, Terminated)
    print(f"{who}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _failed(args: argparse.Namespace, exc: Exception) -> int:
    """A runtime error: one line and exit 1 (``--debug``: the traceback)."""
    if args.debug:
        raise
    print(f"omni-cache {args.command}: error: {type(exc).__name__}: {exc} (--debug shows the traceback)",
          file=sys.stderr)
    return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
