"""Argument validation for every ``omni-cache`` subcommand, in one place.

Owns: the parser class (``CliParser``: a usage error prints the usage of the
parser it belongs to, then one line ``omni-cache <cmd>: error: ...``, and exits
2), the typed validators used as argparse ``type=`` (each names the allowed
range in its message; argparse prefixes the flag), and the exit codes shared
by the subcommands (defined in ``omni_cache.harness.exit_codes``, where the runs that decide
them can import them). A user mistake never reaches the code as a bad value, so
no traceback is shown for one; ``--debug`` re-raises runtime errors.

Upholds nothing (the cache's I1..I13 live in the runtime); this module only
keeps bad input out of it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# The subcommands' exit codes, handed on (explicit re-exports).
from omni_cache.harness.exit_codes import EXIT_FAILED as EXIT_FAILED
from omni_cache.harness.exit_codes import EXIT_INCOMPLETE as EXIT_INCOMPLETE
from omni_cache.harness.exit_codes import EXIT_OK as EXIT_OK
from omni_cache.harness.exit_codes import EXIT_USAGE as EXIT_USAGE
from omni_cache.integration.delivery_settings import write_problem

PLOT_SUFFIXES = (".png", ".svg")


def incomplete_exit(prog: str, reasons: list[str], summary: str, *, allow: bool) -> int:
    """A clean run that did less than asked: each reason on stderr, then exit ``EXIT_INCOMPLETE`` --
    or 0 where ``--allow-incomplete`` says that is intended (the reasons are still said, as notes)."""
    for reason in reasons:
        print(f"{prog}: {'note' if allow else 'warning'}: {reason}", file=sys.stderr)
    if allow:
        return EXIT_OK
    print(f"{prog}: exit {EXIT_INCOMPLETE} (incomplete: {summary}); pass --allow-incomplete if that is intended",
          file=sys.stderr)
    return EXIT_INCOMPLETE


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors name the (sub)command and show its own usage. No flag
    is taken from a prefix of its name (``--all`` is not ``--all-mutants``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _number(text: str, kind: type, what: str) -> Any:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}")
    return value


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (either bound may be open)."""
    what = _range_text("an integer", lo, hi)

    def parse(text: str) -> int:
        value = _number(text, int, what)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"wants {what}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid <name> value"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    what = _range_text("a number", lo, hi, lo_open=lo_open)

    def parse(text: str) -> float:
        value = _number(text, float, what)
        low_bad = lo is not None and (value <= lo if lo_open else value < lo)
        if low_bad or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"wants {what}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _range_text(noun: str, lo: float | None, hi: float | None, *, lo_open: bool = False) -> str:
    if lo is not None and hi is not None and not lo_open:
        return f"{noun} from {lo:,} to {hi:,}"
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:,}")
    if hi is not None:
        parts.append(f"<= {hi:,}")
    return f"{noun} {' and '.join(parts)}" if parts else noun


positive_int = int_range(1)
non_negative_int = int_range(0)
seed_int = int_range(0, 2**32 - 1)
"""A random seed: what every generator the runs seed takes (torch's overflows past 2**64)."""
positive_float = float_range(0, lo_open=True)
non_negative_float = float_range(0)


def int_list(lo: int = 1, hi: int | None = None) -> Callable[[str], list[int]]:
    """Comma-separated integers in ``[lo, hi]``, sorted and de-duplicated."""
    one = int_range(lo, hi)
    what = f"comma-separated {_range_text('integers', lo, hi)}"

    def parse(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",")]
        if not all(parts):  # "8,,32", "8," or "": a missing number is a mistake, never skipped
            raise argparse.ArgumentTypeError(f"wants {what}, got {text!r} (an empty item)")
        try:
            return sorted({one(x) for x in parts})
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}") from None

    parse.__name__ = "list"
    return parse


def file_in_existing_folder(*suffixes: str, writable: bool = True) -> Callable[[str], Path]:
    """A file path ending in one of ``suffixes`` whose folder exists; with ``writable``, one this
    process can write (see ``file_write_problem``)."""
    shown = " or ".join(suffixes)

    def parse(text: str) -> Path:
        path = Path(text)
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"wants a file ending in {shown}, got {text!r}")
        folder = path.parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(
                f"folder {str(folder)!r} does not exist (create it first), got {text!r}")
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
        # NOTE: tried at parse time, so a long run never ends unable to write what it measured
        if writable and (problem := file_write_problem(path)) is not None:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
        return path

    parse.__name__ = "path"
    return parse


def file_write_problem(path: Path) -> str | None:
    """Why this process cannot write the file ``path`` in its existing folder (None: it can). Tried,
    not predicted: an existing file is opened for writing (not truncated), a new one's folder takes a
    probe file made and removed at once (``os.access`` says yes to root on a read-only mount)."""
    if not path.exists():
        return write_problem(path.parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # NOTE: a FIFO never blocks the parse
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


plot_path = file_in_existing_folder(*PLOT_SUFFIXES)
"""A ``.png`` or ``.svg`` file in a folder that exists."""


def existing_folder(text: str) -> Path:
    """A folder that exists."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"wants an existing folder, got {text!r}")
    return path


def suffixed_path(suffix: str) -> Callable[[str], Path]:
    """A path whose name ends in ``suffix`` (a TLC model's ``.cfg``, a module's ``.tla``): another
    file is refused by name before anything runs."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a {suffix} file")
        if path.suffix != suffix:
            raise argparse.ArgumentTypeError(f"wants a {suffix} file, got {text!r}")
        return path

    parse.__name__ = f"{suffix} file"
    return parse


def non_empty_text(text: str) -> str:
    """Any text but an empty (or blank) one: an empty filter would select everything."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"wants a non-empty text, got {text!r}")
    return text


def choice_pattern(*forms: str) -> Callable[[str], str]:
    """One of ``forms``; a form ending in ``:`` takes a non-empty name after the colon."""
    shown = ", ".join(f + "<Name>" if f.endswith(":") else f for f in forms)

    def parse(text: str) -> str:
        for form in forms:
            if form.endswith(":") and text.startswith(form) and text[len(form):].isidentifier():
                return text
            if text == form:
                return text
        raise argparse.ArgumentTypeError(f"wants one of {shown}, got {text!r}")

    parse.__name__ = "choice"
    return parse


def add_debug_flag(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """``--debug``: show the traceback of a runtime error instead of one line."""
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line",
                        default=False if top_level else argparse.SUPPRESS)
