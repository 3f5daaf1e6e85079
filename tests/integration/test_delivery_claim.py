"""One server per delivery directory: what keeps two servers from removing each other's files.

Protects: the store that delivers holds the directory (an exclusive ``flock`` on its claim file,
its pid inside) for as long as it lives; a second store on the directory, in this process or in
another, is refused at construction with ``DeliveryDirInUse`` naming the holder, before it adopts
(and so before it could remove) a single file; ``close`` (the worker's shutdown) and the death of
the holding process, however abrupt, free the directory; a store built without the claim (a worker
rank that never delivers) neither creates, adopts nor removes anything there, and refuses to take
a file's lock; ``RowDelivery`` names the setting in its refusal (also of a directory it cannot create); the launcher's probe
(``claim_holder``) names the holder (of any data-parallel replica's claim), and a claim retries past
its instant of shared lock; a store that fails after its claim, and a child forked from its
process, give the directory back; a full disk at start does not stop the claim.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_cache.integration import delivery_files
from omni_cache.integration.delivery import RowDelivery
from omni_cache.integration.delivery_files import (
    CLAIM_NAME,
    DeliveryDirInUse,
    DeliveryStore,
    claim_holder,
    claim_name,
)
from omni_cache.integration.delivery_settings import DeliverySettings

BOUNDS = {"max_bytes": 1 << 30, "max_age_s": 3600.0}


def _stale_delivery(root: Path) -> Path:
    """A file of the default naming an earlier server left, old enough for retention to remove."""
    path = root / f"req-{'0' * 20}.safetensors"
    path.write_bytes(b"rows")
    os.utime(path, (1.0, 1.0))
    return path


def test_a_second_store_on_a_claimed_directory_is_refused_before_it_touches_a_file(tmp_path: Path) -> None:
    first = DeliveryStore(str(tmp_path), **BOUNDS)
    stale = _stale_delivery(tmp_path)  # the first server's (here: a file it delivered)
    with pytest.raises(DeliveryDirInUse, match=rf"another running server \(process {os.getpid()} holds"):
        DeliveryStore(str(tmp_path), max_bytes=1, max_age_s=1.0)  # bounds that would remove it
    assert stale.exists(), "the refused store removed a file of the server that holds the directory"
    first.close()
    first.close()  # idempotent
    second = DeliveryStore(str(tmp_path), max_bytes=1, max_age_s=1.0)  # free again: it claims and adopts
    assert second.claimed and not stale.exists()
    second.close()


def test_a_directory_held_by_another_process_is_refused_until_that_process_dies(tmp_path: Path) -> None:
    code = ("import sys, time; from omni_cache.integration.delivery_files import DeliveryStore; "
            "s = DeliveryStore(sys.argv[1], max_bytes=1 << 30, max_age_s=3600.0); print('held', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DeliveryDirInUse, match=rf"process {holder.pid} holds"):
            DeliveryStore(str(tmp_path), **BOUNDS)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no close, no cleanup
        holder.wait(timeout=60)
    deadline = time.monotonic() + 10.0
    while True:  # the kernel drops the lock with the process
        try:
            store = DeliveryStore(str(tmp_path), **BOUNDS)
            break
        except DeliveryDirInUse:
            assert time.monotonic() < deadline, "a dead process still holds the directory"
            time.sleep(0.05)
    assert (tmp_path / CLAIM_NAME).read_text().strip() == str(os.getpid())
    store.close()


def test_a_store_without_the_claim_leaves_the_directory_alone(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    store = DeliveryStore(str(missing), **BOUNDS, claim=False)
    assert not missing.exists() and not store.claimed
    held = DeliveryStore(str(tmp_path), **BOUNDS)  # another rank's (the output rank's) store holds it
    stale = _stale_delivery(tmp_path)
    bystander = DeliveryStore(str(tmp_path), max_bytes=1, max_age_s=1.0, claim=False)
    assert stale.exists(), "a store that does not deliver removed a file"
    for refused in (lambda p: bystander.hold_lock(p), lambda p: bystander.write(p, b"rows")):
        with pytest.raises(PermissionError, match="delivers nothing"):  # an OSError: one request fails, no more
            refused(str(tmp_path / "a.safetensors"))
    bystander.note_failure(str(tmp_path / "a.safetensors"), "why")  # best effort: nothing written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("a.safetensors")]
    held.close()


def test_the_worker_names_the_setting_when_the_directory_is_taken(tmp_path: Path) -> None:
    settings = DeliverySettings.from_settings({"delivery_dir": str(tmp_path)})
    assert settings is not None
    first = RowDelivery(settings)
    with pytest.raises(DeliveryDirInUse, match=r"omni_cache\.delivery_dir: .* another running server"):
        RowDelivery(settings)
    RowDelivery(settings, claim=False).shutdown()  # a rank that does not deliver is no rival
    first.shutdown()  # gives the directory up
    RowDelivery(settings).shutdown()


def test_the_launchers_probe_names_the_holder_and_takes_nothing(tmp_path: Path) -> None:
    assert claim_holder(str(tmp_path / "missing")) is None and claim_holder(str(tmp_path)) is None
    store = DeliveryStore(str(tmp_path), **BOUNDS)
    assert claim_holder(str(tmp_path)) == str(os.getpid())
    store.close()
    assert claim_holder(str(tmp_path)) is None  # a claim file left behind, nobody holding it
    again = DeliveryStore(str(tmp_path), **BOUNDS)  # the probe left no lock behind
    again.close()


def test_a_directory_that_cannot_be_created_is_refused_at_start_naming_the_setting(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ValueError, match=r"omni_cache\.delivery_dir '.*a-file/files' cannot be created: '.*a-file' is "
                                         "a file, not a directory"):
        DeliverySettings.from_settings({"delivery_dir": str(tmp_path / "a-file" / "files")})
    # what the settings check cannot see (the path changed since, another host's view): the store's OSError
    settings = DeliverySettings(delivery_dir=str(tmp_path / "a-file" / "files"))
    with pytest.raises(ValueError, match=r"omni_cache\.delivery_dir '.*a-file/files' cannot hold the delivered files"):
        RowDelivery(settings)
    RowDelivery(settings, claim=False).shutdown()  # a rank that does not deliver never touches it


def test_a_store_that_fails_after_its_claim_gives_the_directory_back(tmp_path: Path, monkeypatch) -> None:
    def unreadable(self: DeliveryStore) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(DeliveryStore, "_adopt_existing", unreadable)
    with pytest.raises(PermissionError):
        DeliveryStore(str(tmp_path), **BOUNDS)
    monkeypatch.undo()
    assert claim_holder(str(tmp_path)) is None
    DeliveryStore(str(tmp_path), **BOUNDS).close()


def test_a_full_disk_at_start_still_claims_the_directory(tmp_path: Path, monkeypatch, caplog) -> None:
    """The pid in the claim file only names the holder for a rival's refusal: a disk that refuses it
    (ENOSPC) does not stop the server, and the lock holds all the same."""
    def full(*args: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(delivery_files.os, "pwrite", full)
    store = DeliveryStore(str(tmp_path), **BOUNDS)
    monkeypatch.undo()
    assert store.claimed and "could not write this process's pid" in caplog.text
    with pytest.raises(DeliveryDirInUse, match="process unknown holds"):
        DeliveryStore(str(tmp_path), **BOUNDS)
    store.close()


def test_a_claim_retries_past_a_launchers_probe(tmp_path: Path, monkeypatch) -> None:
    """``claim_holder`` holds a shared lock for an instant: a worker claiming at that moment waits it out."""
    DeliveryStore(str(tmp_path), **BOUNDS).close()  # the claim file exists
    fd = os.open(tmp_path / CLAIM_NAME, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe, caught in the middle
    waits: list[float] = []

    def probe_ends(seconds: float) -> None:  # the claim's wait between tries: the probe is done by then
        waits.append(seconds)
        if len(waits) == 1:
            os.close(fd)

    monkeypatch.setattr(delivery_files, "time", SimpleNamespace(sleep=probe_ends, time=time.time))
    DeliveryStore(str(tmp_path), **BOUNDS).close()
    assert len(waits) == 1, "the claim did not meet the probe's lock (or retried past a free file)"


def test_each_data_parallel_replica_holds_its_own_claim(tmp_path: Path) -> None:
    first, second = (DeliveryStore(str(tmp_path), **BOUNDS, replica=r) for r in (0, 1))
    assert (tmp_path / claim_name(1)).exists() and claim_name(0) == CLAIM_NAME
    with pytest.raises(DeliveryDirInUse):  # another server's replica 1
        DeliveryStore(str(tmp_path), **BOUNDS, replica=1)
    first.close()
    assert claim_holder(str(tmp_path)) == str(os.getpid()), "the launcher's probe sees every replica's claim"
    second.close()
    assert claim_holder(str(tmp_path)) is None


def test_a_forked_child_does_not_keep_the_directory(tmp_path: Path) -> None:
    store = DeliveryStore(str(tmp_path), **BOUNDS)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: outlives the parent's claim, holding nothing
        os.close(read)
        os.write(write, b"x")
        time.sleep(5)
        os._exit(0)
    try:
        os.close(write)
        assert os.read(read, 1) == b"x"
        store.close()
        DeliveryStore(str(tmp_path), **BOUNDS).close()  # free although the child still runs
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
