"""Writing the harness's figures: one place that turns a matplotlib figure into the file asked for.

Owns: ``save_figure``. The format is the path's suffix (``.png`` or ``.svg``: the CLI's
``--plot``, ``--sweep`` and ``--width-sweep`` accept both); an SVG keeps its text as text, so it
stays searchable. Upholds nothing of the cache's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIGURE_FORMATS = ("png", "svg")


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` in the format its suffix names, then close it."""
    import matplotlib
    import matplotlib.pyplot as plt

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        raise ValueError(f"figure path must end in .png or .svg, got {str(path)!r}")
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):
            fig.savefig(path, format=fmt, dpi=110)
    finally:
        plt.close(fig)
    return path
