"""The names and paths of a served engine's delivered files: what protects the server's file system.

Protected: a client-chosen request id never becomes an unsafe file name (no separator, NUL or
leading dot, bounded length, only ``[A-Za-z0-9._-]``) and two distinct ids never share one
(Hypothesis over arbitrary text, the hostile ids by name); a client-given path is ignored unless
the operator allows it, and then refused outside the directory (also through a symlinked
directory, and for a sibling whose name only starts like the directory's), for an existing file,
lock or symlink, for a hidden file and for a name that is not ``.safetensors``. The write and its lock files are in
test_delivery_files.py, retention in test_delivery_retention.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from delivery_store_helpers import NONCE, delivered
from delivery_store_helpers import new_root as _root
from hypothesis import given
from hypothesis import strategies as st

from omni_cache.integration.delivery_paths import FILE_SUFFIX, DeliveryPaths, delivery_name

SAFE_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
HOSTILE_IDS = ["..", ".", "/", "../../etc/passwd", "a/../../b", "/etc/shadow", "\0", "a\0b", "x" * 10_000,
               "日本語のリクエスト", "", ".hidden", "...", "....//....//", "\udcff", "cmpl-..-0", " ", "\n"]


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


def test_each_sample_of_an_n_request_gets_its_own_file_beside_the_path_asked_for(tmp_path: Path) -> None:
    """vLLM runs ``n > 1`` as one request per sample, ``<k>_<id>``, all with the same params: sample 0
    gets the path, sample k its ``.k`` sibling (never the same path, which only one could write)."""
    root = _root(tmp_path)
    os.mkdir(os.path.join(root, "sub"))
    paths = DeliveryPaths(root, NONCE, allow_custom_path=True)
    assert paths.target("0_cmpl-9", "sub/n.safetensors") == (os.path.join(root, "sub", "n.safetensors"), None)
    assert paths.target("1_cmpl-9", "sub/n.safetensors") == (os.path.join(root, "sub", "n.1.safetensors"), None)
    assert paths.target("12_cmpl-9", "n.safetensors") == (os.path.join(root, "n.12.safetensors"), None)
    assert paths.target("cmpl_9", "n.safetensors") == (os.path.join(root, "n.safetensors"), None)  # not a sample id
    assert paths.target("1_", "n.safetensors") == (os.path.join(root, "n.safetensors"), None)
    open(os.path.join(root, "n.3.safetensors"), "wb").close()
    path, error = paths.target("3_cmpl-9", "n.safetensors")
    assert path is None and "'n.3.safetensors' exists already" in error
    path, error = paths.target("1_cmpl-9", "n.txt")
    assert path is None and "must end in .safetensors" in error


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


@pytest.mark.parametrize("requested", [".safetensors", ".omni-cache-server.lock.safetensors", "sub/.x.safetensors"])
def test_a_requested_hidden_file_is_refused(tmp_path: Path, requested: str) -> None:
    """The delivery directory's own files (the server's lock) start with a dot: a client's path never
    names a hidden file, so it can neither shadow nor sit beside them unseen."""
    root = _root(tmp_path)
    os.mkdir(os.path.join(root, "sub"))
    path, error = DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", requested)
    assert path is None and "names a hidden file (a leading '.')" in error
    assert DeliveryPaths(root, NONCE, allow_custom_path=True).target("r", "sub/x.safetensors")[1] is None
