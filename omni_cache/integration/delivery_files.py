"""The files a served engine delivers: atomic writes, lock files, the directory's claim and retention.

Owns: ``DeliveryStore`` (the worker side: the claim on the directory, lock files held
while a file is being written, the atomic write itself, the ``.error`` note of a failed one, and
retention under a byte and an age bound), and the claim's probe (``claim_holder``,
``DeliveryDirInUse``; ``CLAIM_NAME`` and ``claim_name`` are ``delivery_adopt``'s, re-exported here,
as is the search for an earlier server's deliveries). Where a request's file goes is
``delivery_paths``' (the names this store writes and adopts are its ``delivery_name``). No vLLM
import.

The file format is vLLM's hidden-states format (``ExampleHiddenStatesConnector``): one
safetensors file per finished request with ``hidden_states`` ``[num_tokens, width]`` and
``token_ids`` ``[num_tokens]``, read with ``load_hidden_states(path)``; the omni cache adds
one tensor per cached per-token multimodal key, under the key's name. Beside the file is
``<path>.lock``: the writer holds an exclusive ``flock`` on it from the request's first step
until the file is in place, so vLLM's reader (a shared ``flock``, then the read) never reads
before the writer is done; ``cleanup_hidden_states(path)`` removes both.

Upholds, for what leaves the engine: one live server delivers into a directory (its store holds
an exclusive ``flock`` on ``CLAIM_NAME`` there, each further data-parallel replica on its own
``claim_name(r)``; a second server is refused at start, ``DeliveryDirInUse``, instead of counting
the first one's files against its bounds and removing them; a store that does not hold the
directory writes nothing there); a reader never sees a partial file (the rows are written
to a temporary name and linked to the final name only when complete: ``os.link`` refuses an
existing name, so no file is ever overwritten, and the temporary name is never the final
name); no file name or path derives from client-controlled text without being made safe
(``delivery_paths``); files and lock files are the server user's only (mode 0600, the directory 0700 when created);
the directory holds at most ``max_bytes`` of delivered files per store (each data-parallel
replica's store keeps its own bounds) and none older than ``max_age_s`` (applied on each write
and, on an idle server, by a timer every quarter of the bound, from half a second to a minute;
oldest removed first,
never the file just delivered nor a held one, whose client has not been told its path yet: held
files are not counted against ``max_bytes``, and a file's age counts from its ``release``; a file
larger than ``max_bytes`` is refused before it is written), a failed delivery's lock file and ``.error`` note included (a dropped one's lock file is removed at once); a lock is never shared or waited for (a second
request for a path whose lock exists fails at once: the engine thread never blocks on a lock).

Fault injection (for tests of a served engine, where no Python hook reaches the worker): the
environment variable ``OMNI_CACHE_DELIVERY_FAULT`` holds comma-separated rules ``KIND@MARKER``
(or ``KIND`` alone: every file): a write of a file whose name contains ``MARKER`` (the name
carries the request id's safe prefix, so a client's ``X-Request-Id`` picks the fault) first
sleeps (``slow:SECONDS``: a slow disk) or fails with ``ENOSPC`` (``enospc``: a full disk). It is
read once, when the store is built.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Protocol

from omni_cache.integration.delivery_adopt import (
    CLAIM_NAME,
    claim_name,
    earlier_deliveries,
    is_claim_name,
    temporary_name,
)

__all__ = [
    "CLAIM_NAME",
    "FAULT_ENV",
    "DeliveryDirInUse",
    "DeliveryStore",
    "FaultRule",
    "PublishGate",
    "claim_holder",
    "claim_name",
    "parse_fault",
]

log = logging.getLogger(__name__)

FAULT_ENV = "OMNI_CACHE_DELIVERY_FAULT"
_CLAIM_TRIES = 5  # a launcher's probe holds a claim file for an instant: a claim retries before it refuses
_CLAIM_RETRY_S = 0.02


@dataclass(frozen=True)
class FaultRule:
    kind: str  # "slow" or "enospc"
    seconds: float = 0.0
    marker: str = ""  # applies to file names containing it ("": every file)


def parse_fault(text: str | None) -> tuple[FaultRule, ...]:
    """The rules of ``OMNI_CACHE_DELIVERY_FAULT`` (see the module docstring); ``ValueError`` names a bad one."""
    rules = []
    for part in filter(None, (text or "").split(",")):
        spec, _, marker = part.partition("@")
        kind, _, value = spec.partition(":")
        try:
            seconds = float(value) if kind == "slow" else 0.0
        except ValueError:
            seconds = -1.0
        if kind not in ("slow", "enospc") or (kind == "slow" and not seconds >= 0) or (kind == "enospc" and value):
            raise ValueError(f"{FAULT_ENV}: bad rule {part!r}: expected slow:SECONDS[@MARKER] or enospc[@MARKER]")
        rules.append(FaultRule(kind, seconds, marker))
    return tuple(rules)


class PublishGate(Protocol):
    """Decides, under ``lock``, whether a finished file may still be published: not once
    ``cancelled`` is set (its request was failed for taking too long); sets ``published``."""

    lock: threading.Lock
    cancelled: threading.Event
    published: bool


@dataclass
class _Delivered:
    nbytes: int
    at: float


class DeliveryDirInUse(ValueError):
    """Another live process holds the delivery directory (``DeliveryStore(claim=True)``)."""


# Stores holding a claim in this process: a child forked without exec closes its copies of their
# fds (the claim stays the parent's, and ends with the parent, never outlived by a child).
_CLAIMING: weakref.WeakSet[DeliveryStore] = weakref.WeakSet()


def _holder(fd: int) -> str:
    """The pid a claim file names (``"unknown"`` when its holder could not write it)."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def _claim_directory(root: str, name: str) -> int:
    """Hold an exclusive ``flock`` on ``root/name`` (the holder's pid written in it, best effort); the fd.

    NOTE: a ``flock`` ends with the last process holding its file open, however it dies, so a
    crashed server never leaves its directory claimed; the file itself stays (removing it would
    race a new claimant)."""
    path = os.path.join(root, name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        for attempt in range(_CLAIM_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == _CLAIM_TRIES - 1:
                    raise DeliveryDirInUse(f"{root} is the delivery directory of another running server (process "
                                           f"{_holder(fd)} holds {path}); each server needs its own directory") from None
                time.sleep(_CLAIM_RETRY_S)
    except BaseException:
        os.close(fd)
        raise
    try:  # only a name for the refusal of a rival: a full disk must not stop the server here
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        log.warning("could not write this process's pid into %s: %s", path, exc)
    return fd


def claim_holder(root: str) -> str | None:
    """The pid (as written) of a live process that holds ``root`` for delivery (any replica's
    claim), or ``None``.

    A probe for launchers (a clear refusal before a server starts); the worker's claim itself
    (``DeliveryStore``) stays the authority. It takes a shared lock for an instant, which a
    claim retries past."""
    try:
        with os.scandir(root) as scan:
            names = [entry.name for entry in scan if is_claim_name(entry.name)]
    except OSError:  # no directory (or none readable): nobody delivers there yet
        return None
    for name in sorted(names):
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        finally:
            os.close(fd)  # also ends the probe's own shared lock at once
    return None


class DeliveryStore:
    """The worker's side of the delivery directory (see the module docstring).

    Thread model: the engine thread holds locks (``hold_lock``) and forgets them; a writer
    thread calls ``write``; retention runs under this object's lock after each write and on the
    age timer's thread (every quarter of ``max_age_s``, 0.5 s to 60 s, until ``close``). Only files
    this store delivered (and, at start, files of this naming already in the directory) are
    ever removed."""

    def __init__(self, root: str, *, max_bytes: int, max_age_s: float, claim: bool = True,
                 replica: int = 0) -> None:
        """``claim``: take the directory for this store (``DeliveryDirInUse`` when another live
        store holds it; ``replica``: the data-parallel replica, each holding its own claim), adopt
        what is there and deliver into it; a store built with ``claim=False`` (a worker rank that
        never delivers) leaves the directory untouched and refuses to write."""
        self.root = os.path.realpath(root)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._delivered: OrderedDict[str, _Delivered] = OrderedDict()  # oldest first; guarded by _lock
        # Paths whose client has not been told them yet (their request still runs), with how many
        # holds each has: retention skips them; ``release`` ends a hold. Guarded by _lock.
        self._held: Counter[str] = Counter()
        self._bytes = 0
        self.removed = 0  # files removed by retention
        self.fault = parse_fault(os.environ.get(FAULT_ENV))
        self._claim_fd: int | None = None
        self._closed = threading.Event()
        self.age_timer: threading.Thread | None = None  # the age bound's timer, while the store holds its directory
        if claim:
            os.makedirs(root, mode=0o700, exist_ok=True)
            self._claim_fd = _claim_directory(self.root, claim_name(replica))
            _CLAIMING.add(self)
            try:
                self._adopt_existing()
                # NOTE: the age bound holds on an idle server too (writes apply the bounds; no write
                # comes while nothing is served), so a timer applies them between writes. It holds
                # the store weakly: a store dropped without ``close`` stops it too.
                period = min(60.0, max(0.5, self.max_age_s / 4))
                self.age_timer = threading.Thread(target=_apply_age_bound, args=(weakref.ref(self), self._closed, period),
                                                  name="omni-cache-delivery-retention", daemon=True)
                self.age_timer.start()
            except BaseException:  # a half-built store gives the directory back
                self.close()
                raise

    @property
    def claimed(self) -> bool:
        """Whether this store holds its directory (and so may deliver into it)."""
        return self._claim_fd is not None

    def close(self) -> None:
        """Give the directory up (a later server may claim it); idempotent. Writes refused from now on;
        a retention pass under way finishes first (the claim is given up under the store's lock)."""
        self._closed.set()
        _CLAIMING.discard(self)
        with self._lock:
            self._close_claim_fd()

    def _close_claim_fd(self) -> None:
        """Close this process's fd of the claim (in a forked child: its copy; the parent's claim holds)."""
        fd, self._claim_fd = self._claim_fd, None
        if fd is not None:
            os.close(fd)

    def _check_claimed(self, path: str) -> None:
        if self._claim_fd is None:
            raise PermissionError(errno.EACCES, f"this store does not hold {self.root} (not claimed, or closed): "
                                                "it delivers nothing", path)

    # ------------------------------------------------------------------ locks
    def hold_lock(self, path: str) -> int:
        """Create ``<path>.lock`` (mode 0600) and hold an exclusive ``flock`` on it; the fd.

        ``FileExistsError`` when the lock file exists (another request's file is on its way
        there: two clients may ask for one custom path before either lock exists); never waits,
        since the engine thread that calls it is the one that would release the other lock."""
        self._check_claimed(path)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:  # an earlier delivery to this (client) path is gone: retention must not count or remove it
            if (old := self._delivered.pop(path, None)) is not None:
                self._bytes -= old.nbytes
        return fd

    @staticmethod
    def release_lock(fd: int | None) -> None:
        if fd is not None:
            os.close(fd)  # releases LOCK_EX: a reader sleeping on LOCK_SH wakes up

    def discard_lock(self, path: str, fd: int | None) -> None:
        """A delivery that will never be written and whose path no client was told (its request
        ended before its rows were complete): remove ``<path>.lock``, then release it."""
        try:
            os.unlink(path + ".lock")
        except FileNotFoundError:
            pass
        except OSError as exc:  # a read-only or failing disk: the lock file stays, never held
            log.warning("could not remove the lock file of %s: %s", path, exc)
        finally:
            self.release_lock(fd)

    # ------------------------------------------------------------------ write
    def write(self, path: str, payload: bytes, *, publish: PublishGate | None = None) -> int:
        """Put ``payload`` at ``path`` atomically; never overwrites. Returns the bytes written.

        Written to a temporary name in the same directory (O_EXCL, O_NOFOLLOW, 0600), then
        linked to ``path`` (which fails if anything exists there, a symlink included), then the
        temporary name is removed. ``publish``: the link happens under its lock, and not at all
        once it is cancelled."""
        self._check_claimed(path)
        if len(payload) > self.max_bytes:  # retention would remove it before any client could read it
            raise OSError(errno.EFBIG, f"a file of {len(payload)} bytes is larger than the delivery "
                                       f"directory's bound (delivery_max_bytes={self.max_bytes})", path)
        directory, name = os.path.split(path)
        for rule in self.fault:
            if rule.marker in name:
                if rule.kind == "enospc":
                    raise OSError(errno.ENOSPC, f"No space left on device ({FAULT_ENV})", path)
                time.sleep(rule.seconds)
        if publish is not None and publish.cancelled.is_set():  # given up on while the disk was slow: write nothing
            raise TimeoutError("the delivery was abandoned before its file was written")
        real = os.path.realpath(directory)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise PermissionError(f"{path} is outside the delivery directory {self.root} (after resolving symlinks)")
        dir_fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        tmp = temporary_name(name)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb", closefd=True) as f:
                    f.write(payload)
                if publish is None:
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                else:
                    with publish.lock:
                        if publish.cancelled.is_set():
                            raise TimeoutError("the delivery was abandoned before its file was published")
                        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                        publish.published = True
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        self._track(path, len(payload))
        return len(payload)

    def note_failure(self, path: str, message: str) -> None:
        """Best effort: ``<path>.error`` holds why the file is not there (a full disk may refuse it too).
        The note and the lock file are then under retention, as a delivered file is."""
        nbytes = 0
        if self._claim_fd is None:  # a store that does not hold the directory leaves nothing there
            log.warning("not recording the delivery error of %s: this store does not hold %s", path, self.root)
            return
        try:
            fd = os.open(path + ".error", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                nbytes = f.write(message + "\n")
        except OSError as exc:
            log.warning("could not record the delivery error of %s: %s", path, exc)
        self._track(path, nbytes)

    # -------------------------------------------------------------- retention
    def hold(self, path: str) -> None:
        """Keep ``path`` (written or still to be written) from retention until ``release``: its
        request still runs, so no client has been told the path yet. Held files are not counted
        against ``max_bytes`` (the directory holds up to ``max_bytes`` of released files besides them)."""
        with self._lock:
            self._held[path] += 1

    def release(self, path: str) -> None:
        """End a hold of ``path``; at its last, its client is told the path now, so its age counts from
        now and it is the newest file (the last one the bounds remove). A path not held: nothing."""
        with self._lock:
            if self._held[path] > 1:
                self._held[path] -= 1
                return
            del self._held[path]
            entry = self._delivered.pop(path, None)
            if entry is not None:
                self._delivered[path] = _Delivered(entry.nbytes, time.time())

    @property
    def num_held(self) -> int:
        """Paths held (``hold``) and not released yet."""
        with self._lock:
            return len(self._held)

    def _track(self, path: str, nbytes: int) -> None:
        with self._lock:
            old = self._delivered.pop(path, None)  # e.g. a failed write over an adopted name
            self._bytes += nbytes - (old.nbytes if old is not None else 0)
            self._delivered[path] = _Delivered(nbytes, time.time())
            self._enforce_locked(keep=path)

    def enforce(self) -> None:
        """Apply the bounds now (also called on each write, and by the age timer)."""
        with self._lock:
            self._enforce_locked()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def _enforce_locked(self, keep: str | None = None) -> None:
        """Remove the oldest deliveries until the bounds hold, never ``keep`` (the file just
        delivered: its client has not been told its path yet; the next write or ``enforce``
        applies the bounds to it) nor a held file (``hold``). A store that gave its directory up
        removes nothing."""
        if self._claim_fd is None:
            return
        now = time.time()
        # bytes of files not held beyond the bound (held files are not counted: see ``hold``)
        over = self._bytes - self.max_bytes - sum(self._delivered[p].nbytes for p in self._held if p in self._delivered)
        doomed: list[tuple[str, _Delivered]] = []
        for path, entry in self._delivered.items():  # oldest first
            if over <= 0 and now - entry.at <= self.max_age_s:
                break  # the rest are younger
            if path != keep and path not in self._held:
                doomed.append((path, entry))
                over -= entry.nbytes
        for path, entry in doomed:
            del self._delivered[path]
            self._bytes -= entry.nbytes
            for p in (path, path + ".lock", path + ".error"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass  # the client cleaned it up already
                except OSError as exc:
                    log.warning("retention could not remove %s: %s", p, exc)
            self.removed += 1

    def _adopt_existing(self) -> None:
        """Deliveries an earlier server left (``delivery_adopt.earlier_deliveries``) count against
        the bounds, oldest first."""
        found = earlier_deliveries(self.root)
        with self._lock:
            for path, (mtime, size) in sorted(found.items(), key=lambda item: (item[1][0], item[0])):
                self._delivered[path] = _Delivered(int(size), mtime)
                self._bytes += int(size)
            self._enforce_locked()


def _apply_age_bound(ref: weakref.ReferenceType[DeliveryStore], closed: threading.Event, period: float) -> None:
    """A store's age timer: ``enforce`` every ``period`` seconds until it is closed or dropped."""
    while not closed.wait(period):
        store = ref()
        if store is None:
            return
        try:
            store.enforce()
        except Exception:  # NOTE: retention never takes the server down; the next round tries again
            log.exception("omni-cache delivery retention failed in %s", store.root)
        del store


def _forget_claims_in_child() -> None:
    for store in list(_CLAIMING):  # this module's own class
        store._closed.set()  # no timer thread crossed the fork; none is started again
        store._lock = threading.Lock()  # NOTE: the parent's timer may have held it at the fork
        store._close_claim_fd()
    _CLAIMING.clear()


os.register_at_fork(after_in_child=_forget_claims_in_child)
