"""One server per delivery directory: what keeps two servers from removing each other's files.

Protects: the store that delivers holds the directory (an exclusive ``flock`` on its claim file,
its pid inside) for as long as it lives; a second store on the directory, in this process or in
another, is refused at construction with ``DeliveryDirInUse`` naming the holder, before it adopts
(and so before it could remove) a single file; ``close`` (the worker's shutdown) and the death of
the holding process, however abrupt, free the directory; a store built without the claim (a worker
rank that never delivers) neither creates, adopts nor removes anything there, and refuses to take
a file's lock; ``RowDelivery`` names the setting in its refusal (also of a directory it cannot create); the launcher's probe
(``claim_holder``) names the holder and holds nothing itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_cache.integration.delivery import DeliverySettings, RowDelivery
from omni_cache.integration.delivery_files import CLAIM_NAME, DeliveryDirInUse, DeliveryStore, claim_holder

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
    with pytest.raises(RuntimeError, match="delivers nothing"):
        bystander.hold_lock(str(tmp_path / "a.safetensors"))
    assert not (tmp_path / "a.safetensors.lock").exists()
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
    settings = DeliverySettings.from_settings({"delivery_dir": str(tmp_path / "a-file" / "files")})
    assert settings is not None
    with pytest.raises(ValueError, match=r"omni_cache\.delivery_dir '.*a-file/files' cannot hold the delivered files"):
        RowDelivery(settings)
    RowDelivery(settings, claim=False).shutdown()  # a rank that does not deliver never touches it
