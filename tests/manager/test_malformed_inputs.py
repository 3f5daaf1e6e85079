"""Malformed input to the manager's door is the contract error, named, with nothing changed.

Each case is refused before anything is claimed: no staging claim is counted and no step id is
issued, the next valid save gets the next id, and the manager stays usable. Constructors
(``ModelCachePolicy``, ``PrefixCacheConfig``, the event and write values) refuse bad fields with
a ``TypeError``/``ValueError`` naming them, never by misreading them (a str of key names split
into characters, a bool taken for the int 1, a timeout no wait can take).
"""

from __future__ import annotations

import re
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import config, manager, save, slots, started

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.events import as_index
from omni_cache.runtime.manager import OmniPrefixCacheManager


def _strided_nested(parts: list[torch.Tensor]) -> torch.Tensor:
    """A nested tensor of the strided layout (torch's prototype: no ``shape``), without its warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.as_nested_tensor(parts)


H = torch.ones(4, 8)
SLOTS = slots([0], 0, 4)
LAYOUT = PrefixCacheWriteLayout.packed([("a", 0, 4)], SLOTS)
ONE_WRITE = (PrefixCacheWrite("a", 0, 4, 0, 4),)

CASES: list[tuple[str, Any, Any, str]] = [  # id, hidden, mm, layout, phrase
    ("mm is a list", H, [1, 2], LAYOUT, "mm_outputs must be a dict of mm key name -> value"),
    ("mm keys of mixed types", H, {1: torch.ones(4, 2), "x": torch.ones(4, 2)}, LAYOUT,
     "mm_outputs keys must be mm key names"),
    ("an empty mm key", H, {"": 1}, LAYOUT, "mm_outputs keys must be mm key names"),
    ("sparse hidden", torch.eye(4, 8).to_sparse(), None, LAYOUT, "is a torch.sparse_coo tensor"),
    ("meta hidden", torch.empty(4, 8, device="meta"), None, LAYOUT, "is a meta tensor"),
    ("sparse per-token mm", H, {"k": torch.eye(4, 8).to_sparse()}, LAYOUT, "per-token key 'k' is a torch.sparse_coo"),
    ("nested hidden", _strided_nested([torch.ones(2, 8)] * 4), None, LAYOUT, "(a nested tensor: "),
    ("nested per-token mm", H, {"k": _strided_nested([torch.ones(2, 3)] * 4)}, LAYOUT,
     "per-token key 'k' is a nested tensor"),
    ("writes are tuples", H, None, PrefixCacheWriteLayout([("a", 0, 4, 0, 4)], 4, SLOTS),
     "token_start, token_end: a PrefixCacheWrite) only; got a tuple"),
    ("a duck-typed write with a float row", H, None,
     PrefixCacheWriteLayout((type("Duck", (), {"req_id": "a", "row_start": 0.0, "row_end": 4, "token_start": 0,
                                               "token_end": 4})(),), 4, SLOTS),
     "got a Duck in the layout's writes"),
    ("two writes that are tuples", torch.ones(8, 8), None,
     PrefixCacheWriteLayout([("a", 0, 4, 0, 4), ("b", 4, 8, 0, 4)], 8, slots([0, 1], 0, 8)),
     "token_start, token_end: a PrefixCacheWrite) only; got a tuple"),
    ("total_rows an array", H, None, PrefixCacheWriteLayout(ONE_WRITE, np.array([4, 4]), SLOTS),
     "rows (layout total_rows)"),
    ("total_rows a tensor", H, None, PrefixCacheWriteLayout(ONE_WRITE, torch.tensor([4, 4]), SLOTS),
     "rows (layout total_rows)"),
    ("total_rows a bool tensor", torch.ones(1, 8), None,
     PrefixCacheWriteLayout((PrefixCacheWrite("a", 0, 1, 0, 1),), torch.tensor(True), slots([0], 0, 1)),
     "rows (layout total_rows)"),
]
SLOT_MAPPINGS = [["a"], [2**70], {1: 2}, [[1], [2, 3]]]


def _refused(m: Any, hidden: Any, mm: Any, layout: Any, phrase: str) -> None:
    n = layout.total_rows if type(layout.total_rows) is int else layout.writes[-1].row_end  # the step's rows
    with pytest.raises(OmniPrefixCacheUnmatchError, match=re.escape(phrase)):
        m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


@pytest.mark.parametrize(("hidden", "mm", "layout", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_save_is_refused_before_anything_is_claimed(hidden: Any, mm: Any, layout: Any, phrase: str) -> None:
    m = manager()
    try:
        first, _ = save(m, [("z", [5], 0, 4)])
        m.discard_step(first)
        _refused(m, hidden, mm, layout, phrase)
        assert m.stats()["staging"]["claims"] == 1, "the refused save claimed a staging slot"
        after, _ = save(m, [("a", [0], 0, 4)])
        assert after > first and m.stats()["saved"] == 2
        m.discard_step(after)
    finally:
        m.shutdown()


@pytest.mark.parametrize("mapping", SLOT_MAPPINGS, ids=repr)
def test_a_slot_mapping_that_is_no_integer_tensor_is_kept_for_the_save_to_refuse(mapping: Any) -> None:
    layout = PrefixCacheWriteLayout(ONE_WRITE, 4, mapping)  # no torch error at construction
    m = manager()
    try:
        _refused(m, H, None, layout, "slot mapping covers the step's 4 rows only as a 1-D integer CPU tensor")
        assert m.stats()["staging"]["claims"] == 0
    finally:
        m.shutdown()


def test_a_taken_int32_mapping_is_refused_naming_int64_and_a_layout_without_writes_names_them() -> None:
    """``PrefixCacheWriteLayout.taking`` keeps its tensor as it is: an int32 mapping is refused as not
    int64 (it is an integer dtype); ``writes`` that are no iterable are refused naming ``writes``."""
    layout = PrefixCacheWriteLayout.taking(ONE_WRITE, 4, torch.arange(4, 8, dtype=torch.int32))
    m = manager()
    try:
        _refused(m, H, None, layout, "slots_cpu has dtype torch.int32, not int64")
        assert m.stats()["staging"]["claims"] == 0
    finally:
        m.shutdown()
    with pytest.raises(TypeError, match="writes must be an iterable of PrefixCacheWrite, not NoneType"):
        PrefixCacheWriteLayout(None, 4, torch.arange(4))  # type: ignore[arg-type]


def test_an_id_that_has_no_truth_value_is_outside_the_snapshot_and_nothing_is_consumed() -> None:
    m = manager()
    try:
        step_id, _ = save(m, [("a", [0, 1], 0, 6), ("b", [2, 3], 0, 5)])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="outside the save snapshot"):
            m.materialize(step_id, [np.array([1, 2]), "b"])
        assert m.stats()["unconsumed_step_ids"].keys() == {step_id}
        m.discard_step(step_id)
    finally:
        m.shutdown()


@pytest.mark.parametrize("keys", ["codes", b"codes", None, 3, [1], ["a", ""]], ids=repr)
def test_a_policy_refuses_deferred_keys_that_are_not_key_names(keys: Any) -> None:
    with pytest.raises(TypeError, match=r"ModelCachePolicy\.deferred_keys must be a collection of mm key names"):
        ModelCachePolicy(deferred_keys=keys)
    model = type("Model", (), {"deferred_prefix_cache_mm_keys": keys})()
    if keys:  # the model attribute goes through the same check (a falsy one means none)
        with pytest.raises(TypeError, match="deferred_keys must be a collection"):
            ModelCachePolicy.from_model(model)


def test_a_policy_takes_any_collection_of_key_names() -> None:
    for keys in ([], (), set(), frozenset(), ["codes"], iter(["codes"]), {"codes": 1}):
        assert ModelCachePolicy(deferred_keys=keys).deferred_keys <= {"codes"}


def test_a_config_refuses_what_no_wait_or_allocation_can_take() -> None:
    with pytest.raises(ValueError, match=r"staging_claim_timeout_s must be a positive finite number of seconds up to"):
        config(staging_claim_timeout_s=threading.TIMEOUT_MAX * 2)
    with pytest.raises(ValueError, match=r"num_blocks x block_size must address at most \d+ KV slots"):
        PrefixCacheConfig(num_blocks=2**62, block_size=4)
    assert config(staging_claim_timeout_s=threading.TIMEOUT_MAX).staging_claim_timeout_s == threading.TIMEOUT_MAX
    with pytest.raises(ValueError, match=r"staging_depth must be at most 1024 .*got 1025"):
        config(staging_depth=1025)  # each slot's bookkeeping is built at start: 10**9 never returned
    assert config(staging_depth=1024).staging_depth == 1024


@pytest.mark.parametrize("refusal", [
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 105553116266496 bytes"),
    MemoryError(),  # no message at all
], ids=["RuntimeError", "bare MemoryError"])
def test_staging_pages_the_allocator_refuses_fail_the_save_naming_the_sizing_and_change_nothing(
    refusal: BaseException, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A staging page of ``staging_depth x staging_capacity_tokens`` rows the allocator refuses (about
    2**47 bytes here; the refusal is forced, since an overcommitting host may hand out the address space)
    is a contract error of the save naming the key, the fields and the bytes -- never the allocator's
    bare RuntimeError -- and the save changes nothing."""
    import omni_cache.runtime.staging as staging

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise refusal

    monkeypatch.setattr(staging.torch, "empty", refuse)
    m = manager(True, staging_capacity_tokens=2**40)
    m.new_step_starts([started("a")])
    before = m.stats()
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"cannot allocate the staging pages of 'hidden': staging_depth 3 "
                       r"x staging_capacity_tokens 1099511627776 rows of shape \(8,\) torch.float32 = "
                       rf"105,553,116,266,496 bytes \({type(refusal).__name__}"):
        save(m, [("a", [0], 0, 4)])
    after = m.stats()
    assert after["saved"] == before["saved"] == 0 and after["failed"] is None and after["unconsumed_step_ids"] == {}
    assert after["staging"]["slots"]["free"] == 3 and after["staging"]["page_bytes"] == {} and after["writes_in_flight"] == 0
    assert m.shutdown() == {}


def test_a_nested_tensor_that_is_not_per_token_is_kept_as_a_leftover() -> None:
    """A nested tensor whose first dimension is not the step's token count (a list of images'
    embeddings) is no per-token key: it is kept as the step's leftover, a private copy."""
    m = manager()
    images = _strided_nested([torch.ones(2, 3), torch.ones(5, 3)])
    m.new_step_starts([started("a")])
    step, _ = save(m, [("a", [0], 0, 4)], mm={"images": images})
    kept = m.materialize(step, ["a"]).mm_outputs["images"]["a"]
    assert kept.is_nested and [t.shape[0] for t in kept.unbind()] == [2, 5]
    images.unbind()[0].fill_(7.0)
    assert kept.unbind()[0].eq(1.0).all(), "the leftover shares storage with the caller's tensor"
    m.shutdown()


def _refusing_rows_of_width_4096(real: Any) -> Any:
    """``real`` (``torch.zeros`` or ``torch.empty``), refusing as the allocator does a tensor of rows 4096 wide."""

    def refuse_wide(*shape: Any, **kwargs: Any) -> torch.Tensor:
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if dims[-1:] == (4096,):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes")
        return real(*shape, **kwargs)

    return refuse_wide


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "async"])
def test_a_block_pool_the_allocator_refuses_is_a_refused_save_that_changes_nothing(
    eager: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The block pool of a per-token key first seen mid-run (a pool tensor of num_slots rows) that the
    allocator refuses is a contract error of that save naming the key, num_blocks x block_size and the
    bytes, before anything is claimed -- never a failed landing that fails the cache for good (I8). The
    refused key's row shape is not fixed: the key is saved later at another width, and hidden-only
    saves go on."""
    import omni_cache.runtime.block_pool as block_pool

    refuse_wide = _refusing_rows_of_width_4096(torch.zeros)
    m = manager(eager)
    m.new_step_starts([started("a")])
    first, _ = save(m, [("a", [0], 0, 4)])
    m.discard_step(first)
    monkeypatch.setattr(block_pool.torch, "zeros", refuse_wide)
    before = m.stats()
    wide = {"audio": torch.ones(4, 4096)}
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"cannot allocate the block pool of 'audio': 128 KV slots "
                       r"\(num_blocks x block_size\) x rows of shape \(4096,\) torch.float32 = 2,097,152 bytes"):
        save(m, [("a", [0, 1], 4, 8)], mm=wide)
    monkeypatch.undo()
    after = m.stats()
    assert after["failed"] is None and after["saved"] == before["saved"] and after["staging"]["claims"] == 1
    assert sorted(after["pool_bytes"]) == ["hidden"], after["pool_bytes"]
    step, rows = save(m, [("a", [0, 1], 4, 8)], mm={"audio": torch.full((4, 16), 2.0)})  # another width: accepted
    out = m.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows) and out.mm_outputs["audio"]["a"].shape == (4, 16)
    assert m.shutdown() == {}


def test_a_save_refused_after_its_new_keys_pool_was_reserved_gives_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool tensor of a new key is reserved before the claim; a save refused after that (here the
    key's staging page, which the allocator refuses) gives it back: no memory kept, no row shape fixed,
    and the key is saved later at another width."""
    import omni_cache.runtime.staging as staging

    refuse_wide = _refusing_rows_of_width_4096(torch.empty)
    m = manager()
    m.new_step_starts([started("a")])
    monkeypatch.setattr(staging.torch, "empty", refuse_wide)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot allocate the staging pages of 'audio'"):
        save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 4096)})
    monkeypatch.undo()
    assert m.pool._reserved == {} and m.stats()["failed"] is None, "the refused save kept its pool reservation"
    step, _ = save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 16)})
    assert m.materialize(step, ["a"]).mm_outputs["audio"]["a"].shape == (4, 16)
    assert m.shutdown() == {}


def test_staging_pages_past_int64_bytes_are_refused_naming_their_true_size() -> None:
    """Pages whose byte count overflows int64 (torch's own size computation refuses them) are named
    with their true size, never a wrapped one."""
    m = manager(True, staging_capacity_tokens=2**62)
    m.new_step_starts([started("a")])
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"staging_capacity_tokens 4611686018427387904 rows of shape "
                       r"\(8,\) torch.float32 = 442,721,857,769,029,238,784 bytes \(RuntimeError"):
        save(m, [("a", [0], 0, 4)])
    assert m.stats()["failed"] is None and m.shutdown() == {}


def test_a_save_whose_second_new_keys_pool_is_refused_gives_back_the_first_ones() -> None:
    """Two keys new to the pool: the allocator refuses the second one's pool tensor after the first
    one's was reserved; the refused save gives both back (it keeps no memory)."""
    import omni_cache.runtime.block_pool as block_pool

    m = manager()
    m.new_step_starts([started("a")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_pool.torch, "zeros", _refusing_rows_of_width_4096(torch.zeros))
        with pytest.raises(OmniPrefixCacheUnmatchError, match="cannot allocate the block pool of 'wide'"):
            save(m, [("a", [0], 0, 4)], mm={"audio": torch.ones(4, 16), "wide": torch.ones(4, 4096)})
    assert m.pool._reserved == {}, "the refused save kept the first key's pool reservation"
    assert m.stats()["failed"] is None and m.stats()["pool_bytes"] == {} and m.shutdown() == {}


def test_a_version_table_the_host_refuses_for_a_new_key_is_a_refused_save_that_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key first seen mid-run widens the per-slot version table; numpy's ``MemoryError`` there is a
    contract error of that save naming the key, num_blocks x block_size and the bytes (never the bare
    ``MemoryError``), before anything is claimed: the key's pool reservation is given back, the cache
    is not failed, and the key is saved once the host has the memory."""
    import omni_cache.runtime.tenancy as tenancy

    real_zeros = np.zeros

    def refuse_wider(shape: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        if isinstance(shape, tuple) and len(shape) == 2 and shape[1] > 4:  # tenant + hidden's 3 columns
            raise MemoryError
        return real_zeros(shape, *args, **kwargs)

    m = manager()
    m.new_step_starts([started("a")])
    first, _ = save(m, [("a", [0], 0, 4)])
    m.discard_step(first)
    before = m.stats()
    monkeypatch.setattr(tenancy.np, "zeros", refuse_wider)
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"cannot allocate the version table for key 'audio': 128 KV "
                       r"slots \(num_blocks x block_size\) x 7 int64 versions = 7,168 bytes"):
        save(m, [("a", [0, 1], 4, 8)], mm={"audio": torch.ones(4, 16)})
    monkeypatch.undo()
    after = m.stats()
    assert after["failed"] is None and after["saved"] == before["saved"] and after["staging"]["claims"] == 1
    assert m.pool._reserved == {} and sorted(after["pool_bytes"]) == ["hidden"], after["pool_bytes"]
    step, rows = save(m, [("a", [0, 1], 4, 8)], mm={"audio": torch.full((4, 16), 2.0)})
    out = m.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows) and torch.equal(out.mm_outputs["audio"]["a"], torch.full((4, 16), 2.0))
    assert m.shutdown() == {}


def test_a_config_whose_per_slot_bookkeeping_cannot_be_allocated_is_refused_naming_its_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A config within the bounds whose per-slot bookkeeping the host cannot hold is refused at
    construction with one ``ValueError`` naming num_blocks x block_size and the bytes, never
    numpy's bare ``MemoryError`` (refused by the host here: forced, since a host that overcommits
    may hand out the address space)."""
    import omni_cache.runtime.tenancy as tenancy

    real_zeros = np.zeros

    def refuse_huge(shape: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        if (shape[0] if isinstance(shape, tuple) else shape) >= 2**36:
            raise MemoryError("Unable to allocate 8.00 TiB for an array with shape (1099511627776, 1)")
        return real_zeros(shape, *args, **kwargs)

    monkeypatch.setattr(tenancy.np, "zeros", refuse_huge)
    with pytest.raises(ValueError, match=r"PrefixCacheConfig.num_blocks x block_size = 274877906944 x 4 = "
                       r"1,099,511,627,776 KV slots: their per-slot bookkeeping \(8,796,093,022,208 bytes"):
        OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=2**38, block_size=4), eager=True)


@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True), torch.tensor([3]), torch.tensor([[3]])],
                         ids=repr)
def test_a_bool_or_an_array_is_never_an_int(value: Any) -> None:
    with pytest.raises(TypeError, match="must be an int"):
        as_index("x", value)
    with pytest.raises(TypeError):
        PrefixCacheWrite("a", 0, value, 0, 1)
    with pytest.raises(TypeError, match="block_ids must be ints"):
        PrefixCacheRequestEvent("a", "started", 0, 0, (value,))
    assert as_index("x", np.int64(3)) == 3 and as_index("x", torch.tensor(3)) == 3  # integer-likes stay ints


def test_leftover_tensors_inside_any_object_are_stored_detached_and_private() -> None:
    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.me = t, self

    class Slotted:
        __slots__ = ("t",)

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    leaf = torch.ones(3, requires_grad=True)
    m = manager()
    try:
        step_id, _ = save(m, [("a", [0, 1], 0, 4)],
                          mm={"box": Box(leaf), "set": {leaf}, "slots": Slotted(leaf), "frozen": frozenset([leaf])})
        with torch.no_grad():
            leaf.add_(1)  # the caller reuses its tensor after the save
        out = m.materialize(step_id, ["a"]).mm_outputs
        box = out["box"]["a"]
        assert box.me is box and not box.t.requires_grad and box.t.equal(torch.ones(3))
        held = [*out["set"]["a"], out["slots"]["a"].t, *out["frozen"]["a"]]
        assert all(not t.requires_grad and t.equal(torch.ones(3)) for t in held)
    finally:
        m.shutdown()
