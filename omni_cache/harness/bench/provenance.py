"""Where and when a measurement was taken, for the footnotes of the bench's figures.

Owns: ``source_commit`` (the checkout's commit, ``+changes`` when its tracked files differ) and
``provenance_line`` (machine, date, commit and the load average). Upholds nothing of I1..I13.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def source_commit() -> str:
    """The short commit of the source checkout this package runs from, or "not a git checkout"."""
    root = Path(__file__).resolve().parents[3]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return commit + (" +changes" if changed else "")


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available on this platform
        return None


def provenance_line(machine: str, load_before: float | None, load_after: float | None) -> str:
    """``machine: ...; measured ...; commit ...; 1-min load average a before, b after``."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = ", ".join("?" if v is None else f"{v:.2f}" for v in (load_before, load_after))
    cpus = os.cpu_count() or 1
    busy = any(v is not None and v > cpus / 2 for v in (load_before, load_after))
    return (f"machine: {machine}; measured {when}, commit {source_commit()}; 1-min load average {load} "
            f"(before, after){': other work competed with the run' if busy else ''}")
