"""The exit codes every ``omni-cache`` command shares, for the runs that decide them.

Owns: ``EXIT_OK``, ``EXIT_FAILED``, ``EXIT_USAGE``, ``EXIT_INCOMPLETE``, ``EXIT_INTERRUPTED``,
``EXIT_TERMINATED`` and ``EXIT_BROKEN_PIPE``. A harness run's report
(``pipeline``'s ``exit_code``) decides which one its command returns, so they sit in the harness
wing, below the command line; ``omni_cache.cli.args`` hands them to the subcommands.

Upholds: nothing (a vocabulary).
"""

from __future__ import annotations

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_FAILED", "EXIT_INCOMPLETE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED",
           "EXIT_USAGE"]

EXIT_OK = 0
"""Everything asked for ran and was verified."""
EXIT_FAILED = 1
"""A check failed: a mismatch, a contract error, a ground-truth failure, a TLC surprise."""
EXIT_USAGE = 2
"""Bad arguments (argparse's own code): nothing ran."""
EXIT_INCOMPLETE = 3
"""It ran without a wrong result, but did less than asked or missed its target (simulate: requests
dropped or steps cut; bench: a ratio below the target)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT): the command stopped what it started and ended with one line."""
EXIT_TERMINATED = 143
"""SIGTERM (128 + SIGTERM): as Ctrl-C, for ``kill``, ``timeout`` or a cancelled job."""
EXIT_BROKEN_PIPE = 141
"""stdout's reader left before the output was written (``| head``): 128 + SIGPIPE, as a shell
reports such a writer; no error line (the reader took what it wanted)."""
