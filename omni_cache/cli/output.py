"""The console every ``omni-cache`` command prints its tables with.

Owns: ``OutputConsole``, rich's ``Console`` with one change: stdout's reader leaving (``| head``)
is the ``BrokenPipeError`` it is, so the command line ends it as every other write does (exit
141, ``omni_cache.cli.main``) -- rich's own handling exits 1, the code of a failed check.

Upholds nothing (output).
"""

from __future__ import annotations

from rich.console import Console

__all__ = ["OutputConsole"]


class OutputConsole(Console):
    """``rich.console.Console`` whose broken pipe is raised, not turned into ``SystemExit(1)``."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is rendered on the way out
        raise BrokenPipeError("stdout's reader left")
