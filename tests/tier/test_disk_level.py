"""The hidden-state tier's refusals and its disk level under faults.

``budget_bytes`` is a non-negative whole number or one ValueError naming it; a
damaged, foreign or non-safetensors file is a counted miss (never raised out of
``get`` nor out of the worker's apply); the newest put wins across a failed
spill, a get during a spill and a promotion racing a put; a removed directory is
recreated; a tier never reads another tier's files; ``close`` removes the
instance's own spill files (and only those); a malformed plan is refused
at the worker and a partly written block is never stored.
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import BS, finished, manager, save, settle, started, truth

from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan, TierStore
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.tier import HiddenTier


def _rows(tag: str, n: int = 4) -> dict[str, torch.Tensor]:
    return {"hidden": truth(tag, range(n)), "audio.codes": -truth(tag, range(n))[:, :2]}


ENTRY = sum(t.nbytes for t in _rows("x").values())


def _same(got: dict[str, torch.Tensor] | None, tag: str) -> bool:
    want = _rows(tag)
    return got is not None and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _spilled_file(tmp_path: Path) -> Path:
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.parametrize("bad", [None, "1024", float("nan"), float("inf"), 1.5, True, False, -1, -1.0, [8]])
def test_a_budget_that_is_not_a_whole_non_negative_number_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        HiddenTier(bad)  # type: ignore[arg-type]


def test_a_whole_float_budget_is_accepted() -> None:
    assert HiddenTier(2048.0).budget_bytes == 2048  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign", "empty", "bitflip"])
def test_a_damaged_file_is_a_counted_miss_never_raised(tmp_path: Path, damage: str) -> None:
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))  # 1 spills
    path = _spilled_file(tmp_path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a safetensors file at all" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "bitflip":  # bit rot in the rows: the header (hash, instance) still matches
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x01]) + data[-2:])
    else:  # a valid safetensors file without this tier's metadata
        from safetensors.torch import save_file
        save_file({"hidden": torch.ones(4, 8)}, str(path))
    assert tier.get(b"1") is None
    s = tier.stats()
    assert s.load_failures == 1 and s.misses == 1 and s.disk_hits == 0
    m = manager(True)
    applier = TierApplier(tier, BS)
    tier.put(b"3", _rows("3"))  # 2 spills; damage it too, then load it through the worker
    path2 = _spilled_file(tmp_path)
    path2.write_bytes(b"\x00" * 7)
    applier.apply(TierPlan(loads=(TierLoad("b", 0, b"2", 5),)), m)
    assert [f["block_id"] for f in applier.load_failures] == [5]
    assert applier.tier_failures() == {"spill_failures": 0, "file_load_failures": 2, "misses": 1}
    m.shutdown()


def _fail_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("safetensors.torch.save_file", boom)


def test_a_failed_spill_never_leaves_an_older_version_to_serve(tmp_path: Path, monkeypatch) -> None:
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"h", _rows("old"))
    tier.put(b"x", _rows("x"))  # h (old) spills to disk
    tier.put(b"h", _rows("new"))  # x spills; h (new) in memory
    _fail_saves(monkeypatch)
    tier.put(b"y", _rows("y"))  # evicting h (new) fails: disk full -- never raised
    s = tier.stats()
    assert s.spill_failures == 1
    got = tier.get(b"h")
    assert got is None or _same(got, "new")  # never the old version
    assert got is None  # lost, and counted above


def test_a_get_during_a_spill_never_reads_the_old_file(tmp_path: Path, monkeypatch) -> None:
    from safetensors import torch as st

    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"h", _rows("old"))
    tier.put(b"x", _rows("x"))  # h (old) on disk
    tier.put(b"h", _rows("new"))  # x to disk, h (new) in memory
    writing, release = threading.Event(), threading.Event()
    real = st.save_file

    def slow(*args: object, **kwargs: object) -> None:
        writing.set()
        release.wait(2.0)
        real(*args, **kwargs)

    monkeypatch.setattr("safetensors.torch.save_file", slow)
    spill = threading.Thread(target=tier.put, args=(b"y", _rows("y")))  # spills h (new)
    spill.start()
    assert writing.wait(2.0)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(tier.get(b"h")))
    reader.start()
    reader.join(0.3)
    release.set()
    spill.join(5.0)
    reader.join(5.0)
    assert len(got) == 1 and _same(got[0], "new")  # type: ignore[arg-type]


def test_a_promotion_never_overwrites_a_newer_put(tmp_path: Path, monkeypatch) -> None:
    import safetensors

    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"h", _rows("old"))
    tier.put(b"x", _rows("x"))  # h (old) on disk
    reading, put_done = threading.Event(), threading.Event()
    real = safetensors.safe_open

    def slow_open(*args: object, **kwargs: object) -> object:
        reading.set()
        put_done.wait(0.5)  # the newer put lands now unless the read holds the tier's lock
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", slow_open)
    getter = threading.Thread(target=tier.get, args=(b"h",))
    getter.start()
    assert reading.wait(2.0)
    putter = threading.Thread(target=lambda: (tier.put(b"h", _rows("new")), put_done.set()))
    putter.start()
    getter.join(5.0)
    putter.join(5.0)
    monkeypatch.setattr(safetensors, "safe_open", real)
    assert _same(tier.get(b"h"), "new")


def test_a_removed_directory_is_recreated_and_nothing_is_lost(tmp_path: Path) -> None:
    base = tmp_path / "tier"
    tier = HiddenTier(ENTRY, directory=str(base))
    tier.put(b"1", _rows("1"))
    shutil.rmtree(base)
    tier.put(b"2", _rows("2"))  # 1 spills into a recreated directory
    assert tier.stats().spill_failures == 0 and tier.stats().spilled == 1
    assert _same(tier.get(b"1"), "1")


def test_two_tiers_sharing_a_directory_never_read_each_others_files(tmp_path: Path) -> None:
    first = HiddenTier(ENTRY, directory=str(tmp_path))
    first.put(b"h", {"hidden": torch.ones(4, 6)})
    first.put(b"x", {"hidden": torch.ones(4, 6)})  # h spills (width 6)
    second = HiddenTier(ENTRY, directory=str(tmp_path))  # another engine, or a restart
    assert b"h" not in second and second.get(b"h") is None
    assert second.stats().disk_hits == 0
    # a file of the first tier copied into the second's own place is refused too (identity)
    src = next(p for p in tmp_path.rglob("*.safetensors"))
    second.put(b"y", _rows("y"))
    dst_dir = Path(second.spill_directory)  # type: ignore[arg-type]
    shutil.copy(src, dst_dir / src.name)
    assert second.get(b"h") is None and second.stats().load_failures == 1
    assert first.get(b"h") is not None


def test_safetensors_is_a_declared_dependency_and_a_missing_one_refuses_the_directory(tmp_path, monkeypatch) -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"safetensors' in deps
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ValueError, match="safetensors"):
        HiddenTier(ENTRY, directory=str(tmp_path))
    HiddenTier(ENTRY)  # no directory: no safetensors needed


# ---------------------------------------------------------------- the worker's plans
def _applied() -> tuple[TierApplier, Any]:
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, _ = save(m, [("a", [2], 0, 4)])
    m.materialize(s1, ["a"])
    return TierApplier(HiddenTier(1 << 20), BS), m


@pytest.mark.parametrize(("plan", "match"), [
    (TierPlan(loads=(TierLoad("b", 0, b"h1", 3), TierLoad("c", 0, b"h2", 3))), r"load #1 .*'c'.*KV slots \[12, 15\] loaded twice"),
    (TierPlan(loads=(TierLoad("b", 0, b"h1", 3), TierLoad("b", 0, b"h1", 3))), "loaded twice"),
    (TierPlan(stores=(TierStore("a", b"h1", 2), TierStore("a", b"h2", 2))), "stored twice"),
    (TierPlan(stores=(TierStore("a", b"h1", -1),)), "block_id must be an integer >= 0"),
    (TierPlan(stores=(TierStore("a", b"h1", True),)), "block_id"),  # type: ignore[arg-type]
    (TierPlan(loads=(TierLoad("b", -2, b"h1", 3),)), "block_index"),
    (TierPlan(loads=(TierLoad("b", 0, b"", 3),)), "block hash"),
    (TierPlan(loads=(TierLoad("b", 0, "h1", 3),)), "block hash"),  # type: ignore[arg-type]
    (TierPlan(loads=(TierStore("a", b"h1", 2),)), "is not a TierLoad"),  # type: ignore[arg-type]
    # a block outside the pool (32 blocks), after an entry that alone would apply
    (TierPlan(stores=(TierStore("a", b"h1", 2), TierStore("a", b"h2", 32))),
     r"store #1 \(request 'a', block 32\): block_id is outside the pool's blocks \[0, 32\)"),
    (TierPlan(loads=(TierLoad("b", 0, b"h1", 3), TierLoad("b", 1, b"h2", 40))), r"load #1 .*outside the pool's blocks"),
    ({"stores": ()}, "is not a TierPlan"),
])
def test_a_malformed_plan_is_refused_whole_and_changes_nothing(plan: object, match: str) -> None:
    applier, m = _applied()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=match):
        applier.apply(plan, m)  # type: ignore[arg-type]
    assert applier.tier.stats().puts == 0 and applier.restored_blocks == 0
    assert applier.num_load_failures == 0 and applier.take_load_errors() == set()  # no load vacated a block
    m.shutdown()


def test_a_block_its_tenant_wrote_only_partly_is_never_stored() -> None:
    m = manager(True)
    m.new_step_starts([started("a")])
    s1, _ = save(m, [("a", [2], 0, 4)])  # a fills block 2
    m.materialize(s1, ["a"])
    m.new_step_starts([finished("a"), started("b", blocks=[2])])
    s2, _ = save(m, [("b", [2], 0, 3)])  # b writes 3 of block 2's 4 slots; slot 11 still a's row
    m.materialize(s2, ["b"])
    settle(m)
    applier = TierApplier(HiddenTier(1 << 20), BS)
    applier.apply(TierPlan(stores=(TierStore("b", b"hb", 2),)), m)
    assert applier.tier.get(b"hb") is None and applier.store_skipped == 1 and applier.stored_blocks == 0
    m.shutdown()


def test_concurrent_puts_spills_and_gets_never_serve_an_older_version(tmp_path: Path) -> None:
    """One writer puts versions 1..N of one hash while others spill it (other hashes) and read it:
    a get started after version v was put returns v or newer, never older, never nothing."""
    tier = HiddenTier(ENTRY, directory=str(tmp_path))  # one entry in memory: every put spills
    done = [0]
    bad: list[str] = []

    def version(rows: dict[str, torch.Tensor] | None) -> int:
        return -1 if rows is None else int(rows["hidden"][0, 0].item())

    def writer() -> None:
        for v in range(1, 41):
            tier.put(b"h", {"hidden": torch.full((4, 8), float(v))})
            done[0] = v

    def spiller() -> None:
        for i in range(80):
            tier.put(b"o%d" % (i % 3), _rows(f"o{i}"))

    def reader() -> None:
        for _ in range(80):
            floor = done[0]
            got = version(tier.get(b"h"))
            if floor and got < floor:
                bad.append(f"get after put {floor} returned {got}")

    threads = [threading.Thread(target=f) for f in (writer, spiller, spiller, reader, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not bad, bad[:5]
    assert version(tier.get(b"h")) == 40
    assert tier.stats().spill_failures == 0 and tier.stats().load_failures == 0


def test_a_disk_hit_that_fits_is_promoted_to_memory(tmp_path: Path) -> None:
    """A disk hit whose rows fit the budget moves back into memory (the next get is a memory hit)
    and the entry it displaces spills in its place."""
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"a", _rows("a"))
    tier.put(b"b", _rows("b"))  # a spills
    assert _same(tier.get(b"a"), "a")
    first = tier.stats()
    assert (first.disk_hits, first.entries, first.spilled) == (1, 1, 2)  # b spilled by the promotion
    assert first.puts == 2  # a promotion is not a put
    assert _same(tier.get(b"a"), "a")
    assert tier.stats().disk_hits == 1  # served from memory this time
    assert _same(tier.get(b"b"), "b")
    assert tier.stats().disk_hits == 2


def test_stats_is_one_snapshot_never_taken_inside_a_put(tmp_path: Path, monkeypatch) -> None:
    """``stats()`` takes the tier's lock: while a put is still spilling what it evicted, a reader of
    the counters waits for the put to end instead of reading its half-updated numbers."""
    import safetensors.torch

    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"a", _rows("a"))
    spilling, release = threading.Event(), threading.Event()
    real = safetensors.torch.save_file

    def slow_save(*args: object, **kwargs: object) -> object:
        spilling.set()
        release.wait(5.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", slow_save)
    putter = threading.Thread(target=tier.put, args=(b"b", _rows("b")))
    putter.start()
    assert spilling.wait(2.0)
    seen: list[Any] = []
    reader = threading.Thread(target=lambda: seen.append(tier.stats()))
    reader.start()
    reader.join(0.3)
    assert not seen, "stats() read the counters while a put held the tier"
    release.set()
    putter.join(5.0)
    reader.join(5.0)
    assert seen and (seen[0].puts, seen[0].spilled, seen[0].entries) == (2, 1, 1)


def test_a_put_removes_the_older_spilled_version_of_its_hash(tmp_path: Path) -> None:
    """A put replaces every older version of its hash, the spilled file included: the disk never
    keeps a version that the memory level has replaced."""
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"a", _rows("old"))
    tier.put(b"b", _rows("b"))  # a (old) spills
    _spilled_file(tmp_path)  # exactly one file
    tier.put(b"a", _rows("new"))  # a (new) in memory, b spills: a's old file is gone
    _spilled_file(tmp_path)
    assert _same(tier.get(b"b"), "b")  # b (the one file) promoted; a (new) spills
    assert _same(tier.get(b"a"), "new")


def test_close_removes_the_instances_spill_files_and_keeps_the_users_directory(tmp_path: Path) -> None:
    """A restarted server must not leave its spill files behind: ``close`` (the connector's shutdown)
    removes this instance's subdirectory; another tier's subdirectory and ``directory`` itself stay."""
    other = HiddenTier(ENTRY, directory=str(tmp_path))
    other.put(b"o1", _rows("o1"))
    other.put(b"o2", _rows("o2"))  # o1 spills into the other tier's subdirectory
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))  # 1 spills
    mine = Path(tier.spill_directory or "")
    assert list(mine.glob("*.safetensors")), "nothing spilled: the test checks nothing"
    tier.close()
    assert not mine.exists() and tmp_path.is_dir()
    assert tier.closed and tier.stats().entries == 0 and tier.stats().bytes == 0
    tier.close()  # idempotent
    for call in (lambda: tier.get(b"2"), lambda: tier.put(b"3", _rows("3")), lambda: b"2" in tier):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert _same(other.get(b"o1"), "o1")  # the other tier's file is untouched


def test_a_spill_directory_that_cannot_be_removed_is_logged_with_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"1", _rows("1"))
    tier.put(b"2", _rows("2"))

    def refuse(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level("WARNING", logger="omni_cache.runtime.tier"):
        tier.close()
    assert tier.spill_directory in caplog.text and "could not remove" in caplog.text


def test_a_spill_directory_turned_into_a_file_costs_spills_never_puts(tmp_path: Path) -> None:
    """The tier's spill directory replaced by a file while serving: every later put still stores in
    memory (the older file's removal meets a path that cannot hold it), the spills fail counted."""
    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    for tag in ("a", "b", "c"):
        tier.put(tag.encode(), _rows(tag))  # a and b spill
    assert tier.stats().spilled == 2
    spill = tier.spill_directory
    assert spill is not None
    shutil.rmtree(spill)
    Path(spill).write_text("not a directory")
    assert tier.put(b"a", _rows("a2"))  # raised NotADirectoryError before
    assert tier.put(b"d", _rows("d"))  # evicts: the spill fails, counted
    assert _same(tier.get(b"d"), "d")
    assert tier.stats().spill_failures >= 1
    tier.close()


def test_an_older_file_a_put_cannot_remove_is_never_served(tmp_path: Path, monkeypatch) -> None:
    """The older spilled version of a hash stays on disk (a read-only remount, a permission): the put
    still wins, its file is never read until a spill replaces it, even after the new rows' spill fails."""
    import os

    tier = HiddenTier(ENTRY, directory=str(tmp_path))
    tier.put(b"h", _rows("old"))
    tier.put(b"x", _rows("x"))  # h (old) spills to disk
    real_remove = os.remove

    def stuck(path: str) -> None:
        if path.endswith(".safetensors"):
            raise PermissionError(13, "Permission denied", path)
        real_remove(path)

    monkeypatch.setattr(os, "remove", stuck)
    assert tier.put(b"h", _rows("new"))  # the old file stays, counted
    assert tier.stats().stale_files == 1
    _fail_saves(monkeypatch)
    tier.put(b"y", _rows("y"))  # evicting h (new): its spill fails, and the cleanup cannot remove either
    assert tier.get(b"h") is None and b"h" not in tier  # a counted miss, never the old version
    monkeypatch.undo()
    tier.put(b"h", _rows("newest"))
    tier.put(b"z", _rows("z"))  # h (newest) spills: its file replaces the stale one, readable again
    assert _same(tier.get(b"h"), "newest")
    tier.close()

