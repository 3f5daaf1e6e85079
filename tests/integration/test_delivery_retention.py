"""Retention of a served engine's delivered files: what keeps the delivery directory bounded.

Protected: retention by bytes and by age, oldest first, removes the file with its lock and
``.error`` (never the file just delivered nor a file held until its client is told its path; a
file the byte bound could never hold is refused);
files already in the directory are adopted and stale temporary files removed at start; a failed
delivery's notes are bounded too. Safe names and client-given paths are in test_delivery_names.py,
the write and its lock files in test_delivery_files.py.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from delivery_store_helpers import delivered
from delivery_store_helpers import new_root as _root

from omni_cache.integration import delivery_files
from omni_cache.integration.delivery_files import DeliveryStore
from omni_cache.integration.delivery_paths import delivery_name


# ---------------------------------------------------------------------------------- retention
class _Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(delivery_files, "time", SimpleNamespace(time=clock.time))
    return clock


def _deliver(store: DeliveryStore, name: str, nbytes: int) -> str:
    path = os.path.join(store.root, name)
    store.release_lock(store.hold_lock(path))
    store.write(path, b"x" * nbytes)
    return path


def test_retention_by_bytes_removes_the_oldest_file_with_its_lock_and_error(tmp_path: Path, clock: _Clock) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=250, max_age_s=3600)
    first = _deliver(store, "a.safetensors", 100)
    Path(first + ".error").write_text("an old note")
    clock.now += 1
    second = _deliver(store, "b.safetensors", 100)
    assert store.removed == 0 and store.nbytes == 200
    clock.now += 1
    third = _deliver(store, "c.safetensors", 100)
    assert store.removed == 1 and store.nbytes == 200
    assert sorted(delivered(root)) == sorted(os.path.basename(p) + s for p in (second, third) for s in ("", ".lock"))


def test_a_file_larger_than_the_bound_is_refused_and_the_newest_file_is_never_removed_on_delivery(
    tmp_path: Path, clock: _Clock,
) -> None:
    """Retention never removes the file it was just given (its client has not been told the path
    yet); a file the byte bound could never hold is refused before anything is written."""
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=250, max_age_s=3600)
    path = os.path.join(root, "big.safetensors")
    with pytest.raises(OSError, match=r"301 bytes is larger than .*delivery_max_bytes=250") as info:
        store.write(path, b"x" * 301)
    assert info.value.errno == errno.EFBIG and delivered(root) == [] and store.nbytes == 0
    first = _deliver(store, "a.safetensors", 100)
    clock.now += 1
    second = _deliver(store, "b.safetensors", 250)  # fits the bound alone: the older file goes, not this one
    assert os.path.exists(second) and not os.path.exists(first) and store.removed == 1 and store.nbytes == 250
    clock.now += 1
    third = _deliver(store, "c.safetensors", 10)  # over the bound again: the oldest (b) goes, never c
    assert os.path.exists(third) and not os.path.exists(second) and store.nbytes == 10


def test_a_held_file_is_never_removed_and_its_age_counts_from_its_release(tmp_path: Path, clock: _Clock) -> None:
    """A prompt-only file is written when its prompt completes but named to its client only when the
    request ends: until then it is held, kept by both bounds and not counted against the byte bound
    (the files whose clients were told keep their whole bound); once released its age counts from the
    release, so its client gets the whole age bound to read it."""
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=250, max_age_s=60)
    held = os.path.join(store.root, "held.safetensors")
    store.hold(held)
    _deliver(store, "held.safetensors", 100)
    clock.now += 1
    second = _deliver(store, "b.safetensors", 100)
    clock.now += 1
    third = _deliver(store, "c.safetensors", 100)  # 200 bytes besides the held file: within the bound
    assert store.removed == 0
    clock.now += 1
    fourth = _deliver(store, "d.safetensors", 100)  # 300 besides it: the oldest file not held goes
    assert os.path.exists(held) and not os.path.exists(second) and os.path.exists(third) and os.path.exists(fourth)
    clock.now += 120  # all older than the age bound: only those not held go
    store.enforce()
    assert os.path.exists(held) and not os.path.exists(third) and not os.path.exists(fourth) and store.num_held == 1
    store.release(held)
    assert store.num_held == 0
    clock.now += 59
    store.enforce()
    assert os.path.exists(held), "released a minute ago at most: its client is still reading"
    clock.now += 2
    store.enforce()
    assert not os.path.exists(held) and store.nbytes == 0
    store.release(os.path.join(store.root, "never.safetensors"))  # never held nor written: nothing
    twice = os.path.join(store.root, "twice.safetensors")  # two requests named one client path in turn
    store.hold(twice)
    store.hold(twice)
    store.release(twice)
    assert store.num_held == 1, "the first request's end ended the second one's hold"
    store.release(twice)
    assert store.num_held == 0
    store.close()


def test_retention_by_age_removes_files_older_than_the_bound(tmp_path: Path, clock: _Clock) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=60)
    old = _deliver(store, "old.safetensors", 10)
    clock.now += 30
    young = _deliver(store, "young.safetensors", 10)
    clock.now += 31  # old is 61 s old, young 31 s
    store.enforce()
    assert not os.path.lexists(old) and not os.path.lexists(old + ".lock") and os.path.exists(young)
    assert store.removed == 1 and store.nbytes == 10
    clock.now += 30
    store.enforce()
    assert delivered(root) == [] and store.nbytes == 0


@pytest.mark.parametrize("again", [False, True], ids=["forgotten", "delivered_again"])
def test_a_file_the_client_cleaned_up_already(tmp_path: Path, clock: _Clock, again: bool) -> None:
    """Retention forgets it quietly; a client that asks for the same path again starts a new
    delivery there, whose lock file and file retention never removes for the earlier one's age."""
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=60)
    path = _deliver(store, "a.safetensors", 10)
    os.remove(path)
    os.remove(path + ".lock")
    clock.now += 59
    fd = store.hold_lock(path) if again else None  # the second delivery to the path is on its way
    clock.now += 2  # the first delivery is now 61 s old
    store.enforce()
    if not again:
        assert store.removed == 1 and store.nbytes == 0
        return
    assert os.path.exists(path + ".lock") and store.removed == 0 and store.nbytes == 0
    store.release_lock(fd)
    store.write(path, b"x" * 10)
    assert os.path.exists(path) and store.nbytes == 10


def test_files_already_in_the_directory_are_adopted_oldest_first(tmp_path: Path, clock: _Clock) -> None:
    """An earlier server's deliveries (a custom-named file with its lock file, files of the default
    naming) count against the bounds, oldest first; a user's own ``.safetensors`` file (no lock file,
    another naming), a symlink and other files are never touched; a dead writer's temporary file
    is removed, a live process's is not."""
    root = _root(tmp_path)
    b, c = delivery_name("b", "earlier"), delivery_name("c", "earlier")
    for i, name in enumerate(["a.safetensors", "a.safetensors.lock", b, c]):
        Path(root, name).write_bytes(b"" if name.endswith(".lock") else b"x" * 100)
        os.utime(os.path.join(root, name), (clock.now - 100 + i, clock.now - 100 + i))
    shard = Path(root, "model-00001-of-00002.safetensors")  # a user's file, older and larger than the bounds
    shard.write_bytes(b"w" * 1000)
    os.utime(shard, (clock.now - 7200, clock.now - 7200))
    Path(root, "notes.txt").write_text("not ours")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"y" * 1000)
    os.symlink(outside, os.path.join(root, "link.safetensors"))
    Path(root, "d.safetensors.omni-tmp-99999999-456").write_bytes(b"partial")  # a killed writer's
    live = f"e.safetensors.omni-tmp-{os.getpid()}-7"  # a live writer's (a server sharing the directory)
    Path(root, live).write_bytes(b"partial")
    store = DeliveryStore(root, max_bytes=250, max_age_s=3600)
    assert sorted(delivered(root)) == sorted([b, c, "link.safetensors", "notes.txt", shard.name, live])
    assert store.nbytes == 200 and store.removed == 1 and outside.read_bytes() == b"y" * 1000
    assert shard.read_bytes() == b"w" * 1000


def test_lock_files_and_error_notes_left_alone_are_adopted_too(tmp_path: Path, clock: _Clock) -> None:
    """A failed delivery of an earlier server left only ``.lock`` and ``.error``: they are bounded too."""
    root = _root(tmp_path)
    for name, age in (("gone.safetensors.lock", 7200), ("gone.safetensors.error", 7200), ("new.safetensors.lock", 10),
                      ("new.safetensors.error", 10), ("other.lock", 7200)):
        Path(root, name).write_text("why" if name.endswith(".error") else "")
        os.utime(os.path.join(root, name), (clock.now - age, clock.now - age))
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    assert sorted(delivered(root)) == ["new.safetensors.error", "new.safetensors.lock", "other.lock"]
    assert store.nbytes == 3 and store.removed == 1
    clock.now += 3600
    store.enforce()
    assert delivered(root) == ["other.lock"]


def test_adopted_files_older_than_the_age_bound_are_removed_at_start(tmp_path: Path, clock: _Clock) -> None:
    root = _root(tmp_path)
    old, new = delivery_name("old", "earlier"), delivery_name("new", "earlier")
    Path(root, old).write_bytes(b"x")
    os.utime(os.path.join(root, old), (clock.now - 7200, clock.now - 7200))
    Path(root, new).write_bytes(b"x")
    os.utime(os.path.join(root, new), (clock.now - 10, clock.now - 10))
    DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    assert delivered(root) == [new]


def test_deliveries_in_a_folder_of_the_directory_are_adopted_too(tmp_path: Path, clock: _Clock) -> None:
    """A custom save path may name a folder inside the directory: an earlier server's delivery there
    (its file and lock file) counts against the bounds and ages out; a user's own file there (no lock
    file), a linked folder (never followed) and the directory of another live server inside it are
    left alone."""
    root = _root(tmp_path)
    sub = Path(root, "sub", "deeper")
    sub.mkdir(parents=True)
    for name in ("inner.safetensors", "inner.safetensors.lock"):
        Path(sub, name).write_bytes(b"" if name.endswith(".lock") else b"x" * 100)
        os.utime(sub / name, (clock.now - 7200, clock.now - 7200))
    for name in ("young.safetensors", "young.safetensors.lock"):
        Path(sub, name).write_bytes(b"" if name.endswith(".lock") else b"y" * 50)
        os.utime(sub / name, (clock.now - 10, clock.now - 10))
    Path(sub, "mine.safetensors").write_bytes(b"m" * 10)  # a user's own file: no lock file beside it
    os.utime(sub / "mine.safetensors", (clock.now - 7200, clock.now - 7200))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Path(elsewhere, "x.safetensors").write_bytes(b"e")
    Path(elsewhere, "x.safetensors.lock").write_bytes(b"")
    os.utime(elsewhere / "x.safetensors", (clock.now - 7200, clock.now - 7200))
    os.symlink(elsewhere, os.path.join(root, "linked"))
    nested = DeliveryStore(os.path.join(root, "team-b"), max_bytes=1 << 30, max_age_s=1 << 20)  # another live server
    theirs = nested.hold_lock(os.path.join(root, "team-b", "t.safetensors"))
    nested.write(os.path.join(root, "team-b", "t.safetensors"), b"t" * 20)
    os.utime(os.path.join(root, "team-b", "t.safetensors"), (clock.now - 7200, clock.now - 7200))
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=3600)
    assert sorted(os.listdir(sub)) == ["mine.safetensors", "young.safetensors", "young.safetensors.lock"]
    assert store.nbytes == 50 and store.removed == 1
    assert sorted(os.listdir(elsewhere)) == ["x.safetensors", "x.safetensors.lock"]
    assert sorted(delivered(os.path.join(root, "team-b"))) == ["t.safetensors", "t.safetensors.lock"]
    nested.release_lock(theirs)
    nested.close()
    clock.now += 3600
    store.enforce()
    assert sorted(os.listdir(sub)) == ["mine.safetensors"] and store.nbytes == 0


def test_the_age_bound_holds_on_an_idle_server(tmp_path: Path) -> None:
    """No write comes while nothing is served: a timer applies the age bound between writes, so a
    file never outlives it by more than a quarter of it (here 0.5 s, the shortest period), and
    ``close`` stops the timer."""
    import time

    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=1.0)
    try:
        before = time.time()  # the file's age counts from a moment after this one
        path = _deliver(store, "idle.safetensors", 10)
        while os.path.lexists(path):
            assert time.time() - before < 30, "an idle store kept a file past its age bound"
            time.sleep(0.05)
        assert time.time() - before >= 1.0 and store.removed == 1 and store.nbytes == 0
        assert not os.path.lexists(path + ".lock")
        assert store.age_timer is not None and store.age_timer.is_alive()
    finally:
        store.close()
    store.age_timer.join(5)
    assert not store.age_timer.is_alive()

