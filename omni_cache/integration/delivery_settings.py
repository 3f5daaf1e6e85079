"""The delivery settings: ``kv_connector_extra_config["omni_cache"]``'s delivery keys, checked.

Owns: ``DeliverySettings`` (the checked values, with their defaults), ``DELIVERY_KEYS``,
``directory_problem`` (whether a directory setting can be made and written: the tier's ``tier_dir``
too) and ``write_problem`` (whether a new file can be made in a directory, tried with a probe
file; the command line's file options use it too). No
torch, no vLLM: the launcher (``omni-cache serve``) checks a server's settings with this before
anything heavy is imported, and the connector checks them again at engine start, with the same
messages.

Upholds: a bad value is refused with one ``ValueError`` naming its key
(``omni_cache.<key> ...``); nothing is created or claimed here but a probe file, removed at once
(the directory is created and claimed by the worker, ``delivery_files.DeliveryStore``).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_cache.integration.delivery_paths import DeliveryPaths

__all__ = ["DELIVERY_KEYS", "DeliverySettings", "directory_problem", "write_problem"]

_BOOL_KEYS = ("include_output_tokens", "allow_custom_save_path")
_POSITIVE_KEYS = {"delivery_max_bytes": int, "delivery_max_age_s": float, "delivery_timeout_s": float,
                  "delivery_max_pending": int}
DELIVERY_KEYS = frozenset({"delivery_dir", *_BOOL_KEYS, *_POSITIVE_KEYS})


@dataclass(frozen=True)
class DeliverySettings:
    """The delivery keys of ``kv_connector_extra_config["omni_cache"]`` (docs/serving.md)."""

    delivery_dir: str
    include_output_tokens: bool = False
    allow_custom_save_path: bool = False
    delivery_max_bytes: int = 4 << 30
    delivery_max_age_s: float = 3600.0
    delivery_timeout_s: float = 10.0
    delivery_max_pending: int = 16
    nonce: str = field(default_factory=lambda: secrets.token_hex(6))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> DeliverySettings | None:
        """The checked settings, or ``None`` when ``delivery_dir`` is absent (no delivery).
        ``ValueError`` names the key of the first bad value."""
        if settings.get("delivery_dir") is None:
            extra = sorted(k for k in DELIVERY_KEYS - {"delivery_dir"} if k in settings)
            if extra:
                raise ValueError(f"omni_cache.{extra[0]} needs omni_cache.delivery_dir "
                                 "(the directory the hidden-state files are written to)")
            return None
        directory = settings["delivery_dir"]
        if not isinstance(directory, str) or not directory or "\0" in directory:
            raise ValueError(f"omni_cache.delivery_dir must be a directory path, got {directory!r}")
        if (problem := directory_problem(directory)) is not None:  # created at start when missing
            raise ValueError(f"omni_cache.delivery_dir {directory!r} {problem}")
        values: dict[str, Any] = {"delivery_dir": os.path.realpath(os.path.abspath(directory))}
        for key in _BOOL_KEYS:
            if key in settings:
                if not isinstance(settings[key], bool):
                    raise ValueError(f"omni_cache.{key} must be true or false, got {settings[key]!r}")
                values[key] = settings[key]
        for key, kind in _POSITIVE_KEYS.items():
            if key in settings:
                value = settings[key]
                if not _positive(value, integer=kind is int):
                    raise ValueError(f"omni_cache.{key} must be a positive "
                                     f"{'integer' if kind is int else 'number'}, got {value!r}")
                values[key] = kind(value)
        timeout = values.get("delivery_timeout_s", cls.delivery_timeout_s)
        if timeout > threading.TIMEOUT_MAX:  # a wait on a writer could not be bounded by it
            raise ValueError(f"omni_cache.delivery_timeout_s must be at most "
                             f"{threading.TIMEOUT_MAX:.0f} seconds, got {timeout!r}")
        return cls(**values)

    def paths(self) -> DeliveryPaths:
        return DeliveryPaths(self.delivery_dir, self.nonce, self.allow_custom_save_path)


def directory_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be a directory the cache creates and writes (None: it can): an existing file
    or a directory no file can be made in, or a missing path whose nearest existing ancestor is not a
    directory or takes no new entry. A setting's refusal at start, naming it, instead of an ``OSError``
    from deep inside the engine when the directory is first made."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is an existing file, not a directory"
        problem = write_problem(path)
        return None if problem is None else f"is a directory no file can be written in ({problem})"
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file, not a directory"
    if (problem := write_problem(parent)) is not None:
        return f"cannot be created in {parent!r} ({problem})"
    return None


def write_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why no new file can be made in the existing directory ``folder`` (None: one can).

    NOTE: tried, not predicted: a probe file is created and removed at once. ``os.access`` answers
    yes for root on a read-only mount or ``/proc``, where the first real write fails."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".omni-cache-probe-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def _positive(value: Any, *, integer: bool) -> bool:
    """A positive finite int or float (not a bool), integral when ``integer``; an int past float's
    range is refused too (``math.isfinite`` would raise ``OverflowError``, naming no key)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and number > 0 and (not integer or number.is_integer())
