"""Where a request's hidden-state file goes: its safe default name, or a client-given path.

Owns: ``FILE_SUFFIX``, ``delivery_name`` (the file name of a request's rows, made safe from the
client-chosen request id), ``DEFAULT_NAME`` (the pattern of every name it makes) and
``DeliveryPaths`` (the delivery directory and where a request's file may go: the default name
under it, or a client-given path when the operator allows it, only under the directory; with
``n > 1``, one path per sample). No vLLM, no torch: the scheduler-side connector names the file
the client is told about with it, the worker's store (``delivery_files.DeliveryStore``) writes
there.

Upholds: no file name or path derives from client-controlled text without being made safe
(``..``, ``/``, NUL and over-long ids cannot leave the directory or collide with another
request's file: the name carries a digest of the id and a per-server nonce); a client-given path
is honoured only when allowed and only inside the directory after resolving symlinks, and never
where a file (or its lock) already is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_NAME", "FILE_SUFFIX", "DeliveryPaths", "delivery_name"]

log = logging.getLogger(__name__)

FILE_SUFFIX = ".safetensors"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_PREFIX = 48
DEFAULT_NAME = re.compile(r"[A-Za-z0-9_.-]*-[0-9a-f]{20}" + re.escape(FILE_SUFFIX))
"""Every name ``delivery_name`` makes (a store adopts and removes a previous server's files by it)."""


def delivery_name(req_id: str, nonce: str) -> str:
    """The file name of request ``req_id``'s rows: a readable, safe prefix of the id, then a
    digest of the id and the server's ``nonce`` (two ids, or one id reused after a restart,
    never share a name). Never contains a path separator, NUL, or a leading dot."""
    prefix = _SAFE.sub("_", req_id)[:_MAX_PREFIX].lstrip(".") or "req"
    digest = hashlib.sha256(f"{nonce}\0{req_id}".encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{prefix}-{digest}{FILE_SUFFIX}"


_SAMPLE = re.compile(r"(\d+)_.")
"""vLLM's request id of sample ``k`` of an ``n > 1`` request: ``<k>_<id>`` (``ParentRequest.get_child_info``)."""


@dataclass(frozen=True)
class DeliveryPaths:
    """Where a request's file goes: ``root`` (absolute, symlinks resolved) and the rule for a
    client-given path (``allow_custom_path``, as vLLM's ``allow_custom_save_path``)."""

    root: str
    nonce: str
    allow_custom_path: bool = False

    def default_path(self, req_id: str) -> str:
        return os.path.join(self.root, delivery_name(req_id, self.nonce))

    def target(self, req_id: str, requested: object) -> tuple[str | None, str | None]:
        """``(path, None)`` for the file of ``req_id``, or ``(None, error)``.

        ``requested`` is the request's ``kv_transfer_params["hidden_states_path"]`` (or
        ``None``). As vLLM's connector does, a requested path is ignored (the default is used)
        unless the operator allowed custom paths; when allowed it must be a string naming a
        ``.safetensors`` file inside the delivery directory once symlinks are resolved, and no
        file may exist there yet.

        With ``n > 1`` vLLM runs one request per sample, ``<k>_<id>``, each carrying the same
        ``kv_transfer_params``: sample 0 gets the path asked for and sample ``k > 0`` gets
        ``<stem>.<k>.safetensors`` beside it, so every sample has a file and a client that cannot
        read the response (a streaming one) knows where each is. A request id of that form is
        read as a sample whatever its origin."""
        if requested is None or not self.allow_custom_path:
            if requested is not None:
                log.warning("request %r asked for hidden_states_path but custom paths are not allowed "
                            "(omni_cache.allow_custom_save_path); using %s", req_id, self.root)
            return self.default_path(req_id), None
        if not isinstance(requested, str) or not requested or "\0" in requested:
            return None, f"hidden_states_path must be a non-empty string without NUL, got {requested!r}"
        try:
            os.fsencode(requested)
        except UnicodeError:
            return None, f"hidden_states_path {requested!r} cannot be encoded as a file name on this system"
        path = requested if os.path.isabs(requested) else os.path.join(self.root, requested)
        if not path.endswith(FILE_SUFFIX):
            return None, f"hidden_states_path {requested!r} must end in {FILE_SUFFIX}"
        if (sample := _SAMPLE.match(req_id)) is not None and int(sample.group(1)) > 0:
            path = f"{path[: -len(FILE_SUFFIX)]}.{int(sample.group(1))}{FILE_SUFFIX}"
            requested = f"{requested[: -len(FILE_SUFFIX)]}.{int(sample.group(1))}{FILE_SUFFIX}"
        parent = os.path.realpath(os.path.dirname(path))
        if parent != self.root and not parent.startswith(self.root + os.sep):
            return None, (f"hidden_states_path {requested!r} is outside the delivery directory {self.root} "
                          "(after resolving symlinks)")
        name = os.path.basename(path)
        if name.startswith("."):  # the directory's own files (the server's lock) start with a dot
            return None, f"hidden_states_path {requested!r} names a hidden file (a leading '.'); name a visible one"
        final = os.path.join(parent, name)
        if os.path.lexists(final) or os.path.lexists(final + ".lock"):
            return None, f"hidden_states_path {requested!r} exists already: a delivery never overwrites a file"
        return final, None
