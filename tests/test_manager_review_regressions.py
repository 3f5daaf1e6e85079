"""Regressions found by an adversarial review of the runtime (each failed before its fix).

- I7, async: an older write that lands after a newer tenant keeps its rows for a pinned read.
- A per-token key whose width or dtype changes is refused at save (nothing changes), not a
  sticky failure at some later call; a refused save burns no step id.
- Validation: a scheduled request missing from the layout, a negative or start-only hit,
  numpy block ids.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from omni_cache import (
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheRequestEvent,
    PrefixCacheWriteLayout,
)
from omni_cache import PrefixCacheEventKind as E
from omni_cache.runtime.faults import FaultHooks
from omni_cache.runtime.manager import OmniPrefixCacheManager

BS, W = 4, 8


def cfg(**kw: object) -> PrefixCacheConfig:
    base: dict[str, object] = dict(
        num_blocks=32, block_size=BS, staging_depth=3, staging_capacity_tokens=64, staging_claim_timeout_s=2.0
    )
    base.update(kw)
    return PrefixCacheConfig(**base)  # type: ignore[arg-type]


def rows(tag: str, start: int, end: int, width: int = W) -> torch.Tensor:
    base = (sum(ord(c) for c in tag) % 97 + 1) * 1000.0
    pos = torch.arange(start, end, dtype=torch.float32)
    return base + pos[:, None] * 10 + torch.arange(width, dtype=torch.float32)[None, :] + 1


def kv(blocks: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, end)], dtype=torch.int64)


def ev(req: str, kind: E, hit_end: int = 0, blocks: tuple[int, ...] | list[int] = ()) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req, kind, 0, hit_end, (tuple(blocks),) if blocks else ())


def save(m: OmniPrefixCacheManager, spans: list, *, hidden: bool = True, mm_keys: tuple[str, ...] = (),
         width: int = W) -> int:
    hs = torch.cat([rows(r, s, e, width) for r, _, s, e in spans])
    sl = torch.cat([kv(b, s, e) for _, b, s, e in spans])
    mm = {k: torch.cat([rows(r + k, s, e, 4) for r, _, s, e in spans]) for k in mm_keys}
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e in spans], sl)
    n = hs.shape[0]
    return m.save_outputs(hs if hidden else None, mm, num_tokens_unpadded=n, num_tokens_padded=n,
                          write_layout=layout)


class Gate(FaultHooks):
    """Holds the device->host copy of chosen steps' writes until released."""

    def __init__(self) -> None:
        self.block_steps: set[int] = set()
        self.release, self.entered = threading.Event(), threading.Event()

    def before_device_to_host(self, write) -> None:  # type: ignore[no-untyped-def]
        if write.step_id in self.block_steps:
            self.entered.set()
            assert self.release.wait(10)


def test_delayed_hit_survives_newer_tenant_pushed_ahead_async() -> None:
    gate = Gate()
    m = OmniPrefixCacheManager(cfg(), eager=False, faults=gate)
    m.register_policy(ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({"audio"})))
    try:
        m.new_step_starts([ev("Z", E.STARTED)])
        s0 = save(m, [("Z", [5], 0, 4)], hidden=False, mm_keys=("audio",))
        m.discard_step(s0)
        gate.block_steps.add(s0)
        m.new_step_starts([ev("Z", E.FINISHED)])
        assert gate.entered.wait(5)  # the committer is busy with Z's write
        m.new_step_starts([ev("A", E.STARTED)])
        s1 = save(m, [("A", [0], 0, 4)], hidden=False, mm_keys=("audio",))  # A's deferred write T1: pending
        m.discard_step(s1)
        m.new_step_starts([ev("C", E.STARTED, 4, [0, 1])])
        s2 = save(m, [("C", [0, 1], 4, 6)], hidden=False, mm_keys=("audio",))  # plans T1; T1 queued
        m.new_step_starts([ev("A", E.FINISHED), ev("C", E.ABORTED), ev("B", E.STARTED)])
        s3 = save(m, [("B", [0], 0, 4)], hidden=False, mm_keys=("audio",))  # new tenant T3 of block 0
        m.discard_step(s3)
        m.new_step_starts([ev("B", E.FINISHED)])  # T3 jumps to the front, ahead of the queued T1
        gate.release.set()
        deadline = time.monotonic() + 5
        while m.stats()["write_queue"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = m.materialize(s2, ["C"])
        want = torch.cat([rows("Aaudio", 0, 4, 4), rows("Caudio", 4, 6, 4)])
        assert torch.equal(out.mm_outputs["audio"]["C"], want)
    finally:
        gate.release.set()
        m.shutdown()


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "immediate"])
def test_width_change_is_refused_at_save_and_burns_no_step_id(deferred: bool) -> None:
    m = OmniPrefixCacheManager(cfg(), eager=True)
    m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"audio"} if deferred else ())))
    m.new_step_starts([ev("A", E.STARTED)])
    s1 = save(m, [("A", [0], 0, 4)], mm_keys=("audio",))
    m.discard_step(s1)
    m.new_step_starts([ev("A", E.FINISHED), ev("B", E.STARTED)])
    layout = PrefixCacheWriteLayout.packed([("B", 0, 4)], kv([1], 0, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        m.save_outputs(rows("B", 0, 4), {"audio": torch.ones(4, 6)}, num_tokens_unpadded=4,
                       num_tokens_padded=4, write_layout=layout)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="width and dtype never change"):
        save(m, [("B", [1], 0, 4)], width=6)  # hidden: the staging page and the pool refuse it
    m.new_step_starts([ev("B", E.FINISHED), ev("C", E.STARTED)])
    s2 = save(m, [("C", [2], 0, 4)], mm_keys=("audio",))
    assert s2 == s1 + 1 and m.stats()["failed"] is None
    m.discard_step(s2)


def test_scheduled_request_missing_from_layout() -> None:
    m = OmniPrefixCacheManager(cfg(), eager=True)
    m.new_step_starts([ev("A", E.STARTED), ev("B", E.STARTED)], num_scheduled_tokens={"A": 4, "B": 4})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="slot mapping covers"):
        save(m, [("A", [0], 0, 4)])


@pytest.mark.parametrize(("hit_start", "hit_end"), [(0, -4), (4, 0)])
def test_malformed_hit_spans_are_rejected(hit_start: int, hit_end: int) -> None:
    m = OmniPrefixCacheManager(cfg(), eager=True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="I5"):
        m.new_step_starts([PrefixCacheRequestEvent("A", E.STARTED, hit_start, hit_end, ((0,),))])
    assert m.stats()["live_requests"] == 0


def test_event_accepts_numpy_and_tensor_block_ids() -> None:
    e = PrefixCacheRequestEvent("A", E.STARTED, 0, 8, [np.int64(0), np.int64(1)])
    assert e.group0_block_ids == (0, 1)
    e = PrefixCacheRequestEvent("A", E.STARTED, 0, 8, (np.array([2, 3]), torch.tensor([4])))
    assert e.block_ids == ((2, 3), (4,))
