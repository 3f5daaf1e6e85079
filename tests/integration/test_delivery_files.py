"""The write of a served engine's delivered file and the lock files vLLM's reader relies on.

Protected: no reader ever sees a partial file (the final name appears only by a link of a complete
temporary file, checked at the moment of the link), a file is never overwritten (a file or a
symlink at the final name fails, the target untouched), files are 0600, a cancelled
``PublishGate`` publishes nothing and leaves no temporary file, and a directory swapped for a
symlink after the path was approved is refused. Then the lock files vLLM's reader relies on
(``hold_lock`` is ``LOCK_EX``; ``load_hidden_states`` sleeps on it and reads the complete file;
``cleanup_hidden_states`` removes both; a dropped delivery's lock file is released even where the
disk refuses to remove it). Safe names and client-given paths are in test_delivery_names.py,
retention in test_delivery_retention.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from delivery_store_helpers import NONCE, delivered
from delivery_store_helpers import new_root as _root

from omni_cache.integration import delivery_files
from omni_cache.integration.delivery_files import DeliveryStore
from omni_cache.integration.delivery_paths import DeliveryPaths, delivery_name


def _no_temporary_files(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if ".omni-tmp-" in n]


# ---------------------------------------------------------------------------------- writes
class _InspectingGate:
    """A ``PublishGate`` whose lock looks at the directory at the moment the file is linked."""

    def __init__(self, path: str, payload: bytes) -> None:
        self.cancelled = threading.Event()
        self.published = False
        self.seen: list[tuple[bool, list[bytes]]] = []
        gate = self

        class _Lock:
            def __enter__(self) -> None:
                directory = os.path.dirname(path)
                temporaries = [Path(directory, n).read_bytes() for n in _no_temporary_files(directory)]
                gate.seen.append((os.path.lexists(path), temporaries))

            def __exit__(self, *exc: object) -> None:
                return None

        self.lock = _Lock()
        self.payload = payload


def test_the_final_name_appears_only_when_the_file_is_complete(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    payload = os.urandom(3 << 20)
    gate = _InspectingGate(path, payload)
    assert store.write(path, payload, publish=gate) == len(payload)
    assert gate.seen == [(False, [payload])], "at the link: no final name yet, one complete temporary file"
    assert gate.published and Path(path).read_bytes() == payload
    assert _no_temporary_files(root) == [] and store.nbytes == len(payload)


def test_without_a_gate_the_link_also_comes_after_the_complete_write(tmp_path: Path, monkeypatch) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    payload = os.urandom(1 << 20)
    real_link = os.link
    seen: list[tuple[bool, list[bytes]]] = []

    def link(src, dst, **kw):
        seen.append((os.path.lexists(path), [Path(root, n).read_bytes() for n in _no_temporary_files(root)]))
        return real_link(src, dst, **kw)

    monkeypatch.setattr(delivery_files.os, "link", link)
    store.write(path, payload)
    assert seen == [(False, [payload])]
    assert Path(path).read_bytes() == payload and _no_temporary_files(root) == []


def test_a_reader_polling_the_final_name_never_sees_a_partial_file(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    payload = os.urandom(8 << 20)
    paths = [os.path.join(root, f"f{i}.safetensors") for i in range(3)]
    stop = threading.Event()
    sizes: list[int] = []

    def watch() -> None:
        while not stop.is_set():
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    sizes.append(os.stat(p).st_size)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for p in paths:
            store.write(p, payload)
    finally:
        stop.set()
        watcher.join()
    assert set(sizes) <= {len(payload)}


def test_files_are_the_server_users_only(tmp_path: Path) -> None:
    root = str(tmp_path / "new-dir")
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    path = os.path.join(store.root, "a.safetensors")
    fd = store.hold_lock(path)
    store.write(path, b"rows")
    store.release_lock(fd)
    store.note_failure(os.path.join(store.root, "b.safetensors"), "disk full")
    for name in ("a.safetensors", "a.safetensors.lock", "b.safetensors.error"):
        assert stat.S_IMODE(os.stat(os.path.join(store.root, name)).st_mode) == 0o600, name


@pytest.mark.parametrize("occupant", ["file", "symlink to a file outside", "dangling symlink"])
def test_a_write_never_overwrites_what_is_at_the_final_name(tmp_path: Path, occupant: str) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    victim = tmp_path / "victim"
    if occupant == "file":
        Path(path).write_bytes(b"first")
    elif occupant == "symlink to a file outside":
        victim.write_bytes(b"victim")
        os.symlink(victim, path)
    else:
        os.symlink(victim, path)
    with pytest.raises(FileExistsError):
        store.write(path, b"second")
    if occupant == "file":
        assert Path(path).read_bytes() == b"first"
    else:
        assert os.path.islink(path)
        assert (victim.read_bytes() == b"victim") if occupant != "dangling symlink" else not victim.exists()
    assert _no_temporary_files(root) == [] and store.nbytes == 0


def test_a_cancelled_gate_publishes_nothing_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "late.safetensors")
    gate = SimpleNamespace(lock=threading.Lock(), cancelled=threading.Event(), published=False)
    gate.cancelled.set()
    with pytest.raises(TimeoutError, match="abandoned"):
        store.write(path, b"rows", publish=gate)
    assert not os.path.lexists(path) and not gate.published
    assert delivered(root) == [] and store.nbytes == 0


def test_a_write_outside_the_root_is_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    outside = _root(tmp_path, "outside")
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    with pytest.raises(PermissionError, match="outside the delivery directory"):
        store.write(os.path.join(outside, "a.safetensors"), b"rows")
    assert os.listdir(outside) == []


def test_a_directory_swapped_for_a_symlink_after_approval_is_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    outside = _root(tmp_path, "outside")
    os.mkdir(os.path.join(root, "sub"))
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "sub/a.safetensors")
    assert error is None
    os.rmdir(os.path.join(root, "sub"))
    os.symlink(outside, os.path.join(root, "sub"))  # between the scheduler's check and the worker's write
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    with pytest.raises(PermissionError):
        store.write(path, b"rows")
    assert os.listdir(outside) == []


# ---------------------------------------------------------------------------------- lock files
def _shared_lock_now(path: str) -> bool:
    """Whether another open file description gets ``LOCK_SH`` on ``path`` without waiting."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        return True
    finally:
        os.close(fd)


def test_hold_lock_is_exclusive_until_released(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    fd = store.hold_lock(path)
    assert not _shared_lock_now(path + ".lock"), "a reader's LOCK_SH must wait while the writer holds the lock"
    store.release_lock(fd)
    assert _shared_lock_now(path + ".lock")
    store.release_lock(None)  # nothing held: nothing to do


def test_hold_lock_does_not_follow_a_symlink(tmp_path: Path) -> None:
    root = _root(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    os.symlink(victim, path + ".lock")
    with pytest.raises(OSError) as info:
        store.hold_lock(path)
    assert info.value.errno in (errno.EEXIST, errno.ELOOP)
    assert os.path.islink(path + ".lock") and victim.read_bytes() == b"x"


def test_hold_lock_never_shares_or_waits_for_an_existing_lock(tmp_path: Path) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, "a.safetensors")
    fd = store.hold_lock(path)
    with pytest.raises(FileExistsError):
        store.hold_lock(path)  # a second request for the same path: refused at once, never a wait
    store.release_lock(fd)


def _vllm_reader():
    pytest.importorskip("vllm", reason="vLLM's hidden-states reader comes with the [vllm] extra")
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    return load_hidden_states, cleanup_hidden_states


def test_vllms_reader_waits_for_the_lock_then_reads_the_complete_file(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save

    load_hidden_states, cleanup_hidden_states = _vllm_reader()
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    path = os.path.join(root, delivery_name("req", NONCE))
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ids = torch.arange(6, dtype=torch.long)
    fd = store.hold_lock(path)  # as the worker does at the request's first step
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(_load_or_error(load_hidden_states, path)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and got == [], "the reader must sleep on the writer's lock"
    store.write(path, save({"hidden_states": rows, "token_ids": ids}))
    store.release_lock(fd)
    reader.join(10)
    assert not reader.is_alive()
    (data,) = got
    assert isinstance(data, dict) and torch.equal(data["hidden_states"], rows) and torch.equal(data["token_ids"], ids)
    cleanup_hidden_states(path)
    assert delivered(root) == []


def _load_or_error(load, path: str) -> object:
    try:
        return load(path)
    except Exception as exc:  # reported by the assertion
        return exc


def test_a_lock_file_the_disk_will_not_remove_is_still_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A dropped delivery's lock file on a disk that refuses the unlink (read-only, failing): the error
    is logged, never raised into the engine step, and the lock is released (no reader waits forever)."""
    store = DeliveryStore(str(tmp_path), max_bytes=1 << 20, max_age_s=60.0)
    path = str(tmp_path / "a.safetensors")
    fd = store.hold_lock(path)
    real_unlink = os.unlink

    def read_only(p: str, *args: object, **kwargs: object) -> None:
        if str(p).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", p)
        real_unlink(p, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(delivery_files.os, "unlink", read_only)
    with caplog.at_level("WARNING", logger="omni_cache.integration.delivery_files"):
        store.discard_lock(path, fd)
    assert "could not remove the lock file" in caplog.text and "Read-only file system" in caplog.text
    probe = os.open(path + ".lock", os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the dropped delivery still held it
    finally:
        os.close(probe)
