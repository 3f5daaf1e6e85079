"""The files a served engine delivers: what protects the server's file system and its readers.

Protected first: a client-chosen request id never becomes an unsafe file name (no separator, NUL
or leading dot, bounded length, only ``[A-Za-z0-9._-]``) and two distinct ids never share one
(Hypothesis over arbitrary text, the hostile ids by name); a client-given path is ignored unless
the operator allows it, and then refused outside the directory (also through a symlinked
directory, and for a sibling whose name only starts like the directory's), for an existing file,
lock or symlink, and for a name that is not ``.safetensors``. Then the write: no reader ever sees
a partial file (the final name appears only by a link of a complete temporary file, checked at the
moment of the link), a file is never overwritten (a file or a symlink at the final name fails, the
target untouched), files are 0600, a cancelled ``PublishGate`` publishes nothing and leaves no
temporary file, and a directory swapped for a symlink after the path was approved is refused.
Then the lock files vLLM's reader relies on (``hold_lock`` is ``LOCK_EX``; ``load_hidden_states``
sleeps on it and reads the complete file; ``cleanup_hidden_states`` removes both), and retention
(by bytes and by age, oldest first, the file with its lock and ``.error``; files already in the
directory are adopted and stale temporary files removed at start; a failed delivery's notes are
bounded too).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_cache.integration import delivery_files
from omni_cache.integration.delivery_files import (
    CLAIM_NAME,
    FILE_SUFFIX,
    DeliveryPaths,
    DeliveryStore,
    delivery_name,
)

NONCE = "0123456789ab"
SAFE_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
HOSTILE_IDS = ["..", ".", "/", "../../etc/passwd", "a/../../b", "/etc/shadow", "\0", "a\0b", "x" * 10_000,
               "日本語のリクエスト", "", ".hidden", "...", "....//....//", "\udcff", "cmpl-..-0", " ", "\n"]


def _root(tmp_path: Path, name: str = "root") -> str:
    root = tmp_path / name
    root.mkdir(mode=0o700)
    return os.path.realpath(root)


def _no_temporary_files(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if ".omni-tmp-" in n]


def delivered(root: str | Path) -> list[str]:
    """What ``root`` holds besides the store's own claim on it."""
    return [n for n in os.listdir(root) if n != CLAIM_NAME]


# ------------------------------------------------------------------------------------ names
def _assert_safe_name(name: str) -> None:
    assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,47}-[0-9a-f]{20}\.safetensors", name), name
    assert set(name) <= SAFE_CHARS and not name.startswith("."), name
    assert len(name) <= 81  # a 48-character prefix, an 80-bit digest: far below NAME_MAX (255)


@pytest.mark.parametrize("req_id", HOSTILE_IDS)
def test_a_hostile_request_id_gives_a_safe_name_inside_the_root(tmp_path: Path, req_id: str) -> None:
    root = _root(tmp_path)
    name = delivery_name(req_id, NONCE)
    _assert_safe_name(name)
    path = DeliveryPaths(root, NONCE).default_path(req_id)
    assert os.path.dirname(path) == root and os.path.basename(path) == name


def test_hostile_ids_that_clean_up_alike_get_distinct_names() -> None:
    alike = ["a/b", "a_b", "a\0b", "a b", "a//b", "a\\b", "a%2Fb", "a\nb", "a\u00e9b"]
    assert len({delivery_name(r, NONCE)[:-len(FILE_SUFFIX)].split("-")[0] for r in alike}) < len(alike)  # prefixes clash
    assert len({delivery_name(r, NONCE) for r in alike}) == len(alike)


@given(st.text())
def test_any_request_id_gives_a_safe_name(req_id: str) -> None:
    _assert_safe_name(delivery_name(req_id, NONCE))


@given(st.text(), st.text())
def test_distinct_request_ids_never_share_a_name(a: str, b: str) -> None:
    if a != b:
        assert delivery_name(a, NONCE) != delivery_name(b, NONCE)


def test_the_same_id_under_another_server_nonce_gets_another_name() -> None:
    assert delivery_name("req-1", NONCE) != delivery_name("req-1", "ba9876543210")
    assert delivery_name("req-1", NONCE) == delivery_name("req-1", NONCE)


# ------------------------------------------------------------------------- client-given paths
def test_a_requested_path_is_ignored_unless_custom_paths_are_allowed(tmp_path: Path) -> None:
    root = _root(tmp_path)
    paths = DeliveryPaths(root, NONCE, allow_custom_path=False)
    for requested in ("/etc/passwd.safetensors", "../x.safetensors", "mine.safetensors", 7):
        assert paths.target("r1", requested) == (paths.default_path("r1"), None)
    assert paths.target("r1", None) == (paths.default_path("r1"), None)


def test_a_requested_path_inside_the_root_is_honoured(tmp_path: Path) -> None:
    root = _root(tmp_path)
    os.mkdir(os.path.join(root, "sub"))
    paths = DeliveryPaths(root, NONCE, allow_custom_path=True)
    assert paths.target("r", "mine.safetensors") == (os.path.join(root, "mine.safetensors"), None)
    assert paths.target("r", os.path.join(root, "sub", "a.safetensors")) == (os.path.join(root, "sub", "a.safetensors"),
                                                                            None)
    assert paths.target("r", None) == (paths.default_path("r"), None)


@pytest.mark.parametrize("requested", ["../escape.safetensors", "sub/../../escape.safetensors", "/tmp/escape.safetensors",
                                       "/escape.safetensors"])
def test_a_requested_path_outside_the_root_is_refused(tmp_path: Path, requested: str) -> None:
    root = _root(tmp_path)
    os.mkdir(os.path.join(root, "sub"))
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", requested)
    assert path is None and "outside the delivery directory" in error


def test_a_requested_path_that_cannot_be_a_file_name_is_refused(tmp_path: Path) -> None:
    """A lone surrogate (possible in-process; JSON over HTTP refuses it) is refused as the request's
    delivery error, never raised into the engine from the lock file's creation."""
    root = _root(tmp_path)
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "bad\ud800.safetensors")
    assert path is None and "cannot be encoded as a file name" in error and delivered(root) == []


def test_a_sibling_directory_whose_name_starts_like_the_root_is_outside(tmp_path: Path) -> None:
    root = _root(tmp_path, "files")
    sibling = _root(tmp_path, "files2")
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", os.path.join(sibling, "a.safetensors"))
    assert path is None and "outside" in error


def test_a_symlinked_directory_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root = _root(tmp_path)
    outside = _root(tmp_path, "outside")
    os.symlink(outside, os.path.join(root, "link"))
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "link/a.safetensors")
    assert path is None and "outside the delivery directory" in error and "symlinks" in error
    assert os.listdir(outside) == []


def test_a_symlinked_directory_inside_the_root_resolves_to_its_target(tmp_path: Path) -> None:
    root = _root(tmp_path)
    os.mkdir(os.path.join(root, "real"))
    os.symlink(os.path.join(root, "real"), os.path.join(root, "alias"))
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "alias/a.safetensors")
    assert (path, error) == (os.path.join(root, "real", "a.safetensors"), None)


@pytest.mark.parametrize("existing", ["file", "lock", "dangling symlink", "symlink to a file outside"])
def test_a_requested_path_that_exists_already_is_refused(tmp_path: Path, existing: str) -> None:
    root = _root(tmp_path)
    target = os.path.join(root, "taken.safetensors")
    if existing == "file":
        Path(target).write_bytes(b"someone else's rows")
    elif existing == "lock":
        Path(target + ".lock").touch()
    elif existing == "dangling symlink":
        os.symlink(os.path.join(root, "nowhere"), target)
    else:
        outside = tmp_path / "victim.safetensors"
        outside.write_bytes(b"victim")
        os.symlink(outside, target)
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "taken.safetensors")
    assert path is None and "exists already" in error


@pytest.mark.parametrize("requested", ["a.txt", "a.safetensors.lock", "a.safetensors/", "a", 42, "", "a\0.safetensors",
                                       ["a.safetensors"]])
def test_a_requested_path_that_is_not_a_safetensors_file_name_is_refused(tmp_path: Path, requested: object) -> None:
    root = _root(tmp_path)
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", requested)
    assert path is None and error and "hidden_states_path" in error


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


def test_a_file_the_client_cleaned_up_already_is_forgotten_quietly(tmp_path: Path, clock: _Clock) -> None:
    root = _root(tmp_path)
    store = DeliveryStore(root, max_bytes=1 << 30, max_age_s=60)
    path = _deliver(store, "a.safetensors", 10)
    os.remove(path)
    os.remove(path + ".lock")
    clock.now += 61
    store.enforce()
    assert store.removed == 1 and store.nbytes == 0


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
