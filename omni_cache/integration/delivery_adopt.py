"""The files a delivery store keeps beside the deliveries, and what an earlier server left behind.

Owns: the names of a store's own files in its directory -- the claim (``CLAIM_NAME``, one per
data-parallel replica: ``claim_name``, ``is_claim_name``) and a writer's temporary file
(``temporary_name``) -- and ``earlier_deliveries(root)``: the deliveries an earlier server left in
the directory, for the store that claims it to count against its bounds.

Upholds: only deliveries are found -- a file of the default naming or with a lock file beside it,
and a failed delivery's lock file and error note; a user's own files (a ``.safetensors`` file with
neither) are never reported. A folder inside the directory is searched (a custom save path may
name one), never through a link and never a folder another server claims (its files are its
own). A temporary file of a writer that is gone is removed; a live process's is left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading

from omni_cache.integration.delivery_paths import DEFAULT_NAME, FILE_SUFFIX

__all__ = ["CLAIM_NAME", "claim_name", "earlier_deliveries", "is_claim_name", "temporary_name"]

log = logging.getLogger(__name__)

_CLAIM_STEM, _CLAIM_SUFFIX = ".omni-cache-server", ".lock"
CLAIM_NAME = _CLAIM_STEM + _CLAIM_SUFFIX  # held by the one store that delivers into the directory
# A data-parallel replica r > 0 of the same server holds its own: ``.omni-cache-server-dp<r>.lock``.
_CLAIM = re.compile(re.escape(_CLAIM_STEM) + r"(?:-dp[1-9][0-9]*)?" + re.escape(_CLAIM_SUFFIX))
_TMP_MARK = ".omni-tmp-"
# A writer's temporary file (``<name>.omni-tmp-<pid>-<thread>``).
_TMP_NAME = re.compile(r".+" + re.escape(FILE_SUFFIX + _TMP_MARK) + r"(\d+)-\d+")


def claim_name(replica: int = 0) -> str:
    """The claim file of data-parallel replica ``replica`` (``CLAIM_NAME`` for the first, or no DP)."""
    return CLAIM_NAME if replica == 0 else f"{_CLAIM_STEM}-dp{replica}{_CLAIM_SUFFIX}"


def is_claim_name(name: str) -> bool:
    """Whether ``name`` is the claim file of some replica of a server."""
    return _CLAIM.fullmatch(name) is not None


def temporary_name(name: str) -> str:
    """The temporary file this thread writes ``name`` through before it is linked in place."""
    return f"{name}{_TMP_MARK}{os.getpid()}-{threading.get_ident()}"


def earlier_deliveries(root: str) -> dict[str, tuple[float, int]]:
    """Each delivery found under ``root`` (its path, without ``.lock``/``.error``) -> the newest
    mtime and the bytes of its files (see the module docstring for what is found)."""
    found: dict[str, tuple[float, int]] = {}
    for folder, subfolders, files in os.walk(root, followlinks=False):
        if folder != root and any(is_claim_name(name) for name in files):
            subfolders.clear()  # another server's directory: its files are its own
            continue
        _scan_folder(folder, found)
    return found


def _scan_folder(folder: str, found: dict[str, tuple[float, int]]) -> None:
    try:
        with os.scandir(folder) as scan:
            entries = list(scan)
    except FileNotFoundError:  # a folder removed since the walk listed it
        return
    names = {entry.name for entry in entries}
    for entry in entries:
        if (tmp := _TMP_NAME.fullmatch(entry.name)) is not None:
            if not _process_alive(int(tmp.group(1))):
                try:
                    os.unlink(entry.path)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        log.warning("could not remove the stale temporary file %s: %s", entry.path, exc)
            continue
        extra = next((x for x in ("", ".lock", ".error") if entry.name.endswith(FILE_SUFFIX + x)), None)
        if extra == "" and not (DEFAULT_NAME.fullmatch(entry.name) or entry.name + ".lock" in names):
            continue  # not a delivery: a user's file
        if extra is not None and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            mtime, size = found.get(entry.path[: len(entry.path) - len(extra)], (st.st_mtime, 0))
            found[entry.path[: len(entry.path) - len(extra)]] = (max(mtime, st.st_mtime), size + st.st_size)


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a temporary file of a live writer, e.g. of a server that
    held the directory before, still writing, is never removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # exists, another user's (or a pid this system cannot have: left alone)
    return True
