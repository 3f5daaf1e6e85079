"""Small builders shared by the lead's manager tests: ground-truth rows, slots, steps, and the
device the stateful machines build their step tensors on (``machine_device``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from omni_cache import (
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheRequestOwner,
    PrefixCacheWriteLayout,
)
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.staging import StagingPool

E = PrefixCacheEventKind
WIDTH = 8
BS = 4
# Where the stateful machines (tests/manager_machine.py, tests/tier_machine.py; run by
# tests/manager/, adapter/ and tier/test_*_stateful.py) build the tensors they hand to the manager: "cpu" (the default) or
# "cuda" (the manager's stream path; tools/device_check.sh sets it on a GPU machine).
DEVICE_ENV = "OMNI_CACHE_TEST_DEVICE"


def machine_device() -> torch.device:
    """The device of ``$OMNI_CACHE_TEST_DEVICE`` (default cpu). Anything but cpu or cuda[:N] is
    refused, and cuda where torch sees no CUDA device: a run asked to use the GPU never quietly
    runs on the CPU (tests/conftest.py refuses it once, at start)."""
    name = os.environ.get(DEVICE_ENV, "").strip() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={name}: must be cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_ENV}={name}: no CUDA device (torch {torch.__version__} sees none)")
    return device


def truth(tag: str, positions: Sequence[int] | range, width: int = WIDTH) -> torch.Tensor:
    """Deterministic rows: row p of ``tag`` is unique per (tag, p) and never zero."""
    base = (sum(ord(c) * 31**i for i, c in enumerate(tag)) % 9973) + 1
    pos = torch.tensor(list(positions), dtype=torch.float32)
    cols = torch.arange(width, dtype=torch.float32)
    return base * 1000.0 + pos[:, None] * 10.0 + cols[None, :] + 1.0


def slot_of(blocks: Sequence[int], position: int, bs: int = BS) -> int:
    """The KV slot of token ``position`` of a request whose block table is ``blocks`` (vLLM's slot
    mapping: the block's first slot plus the offset in the block). The tests' one copy of it."""
    return int(blocks[position // bs]) * bs + position % bs


def slots(blocks: Sequence[int], start: int, end: int, bs: int = BS) -> torch.Tensor:
    """KV slots of positions [start, end) of a request whose block table is ``blocks``."""
    return torch.tensor([slot_of(blocks, p, bs) for p in range(start, end)], dtype=torch.int64)


def config(**overrides: object) -> PrefixCacheConfig:
    base: dict[str, object] = dict(
        num_blocks=32, block_size=BS, staging_depth=3, staging_capacity_tokens=64, staging_claim_timeout_s=2.0
    )
    base.update(overrides)
    return PrefixCacheConfig(**base)  # type: ignore[arg-type]


def manager(eager: bool = True, **overrides: object) -> OmniPrefixCacheManager:
    return OmniPrefixCacheManager(config(**overrides), eager=eager)


def event(req: str, kind: PrefixCacheEventKind, owner: PrefixCacheRequestOwner | None = None, *, hit: int | None = 0,
          blocks: Sequence[int] = (), n: int = 0) -> PrefixCacheRequestEvent:
    """One request event: a hit of ``hit`` tokens on ``blocks`` (group 0), ``n`` tokens scheduled,
    of admission ``owner``; ``hit=None`` is a lookup not yet complete (``lookup_complete=False``)."""
    return PrefixCacheRequestEvent(req, kind, 0, hit or 0, (tuple(blocks),) if blocks else (), n,
                                   owner=owner, lookup_complete=hit is not None)


def started(req: str, hit_end: int = 0, blocks: Sequence[int] = (), scheduled: int = 0) -> PrefixCacheRequestEvent:
    return event(req, E.STARTED, hit=hit_end, blocks=blocks, n=scheduled)


def finished(req: str) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req, E.FINISHED)


def aborted(req: str) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req, E.ABORTED)


# The two manager modes most tests run in: inline copies, and the committer thread.
MODES = [pytest.param(True, id="eager"), pytest.param(False, id="async")]


def save(
    m: OmniPrefixCacheManager,
    spans: Sequence[tuple[str, Sequence[int], int, int]],
    *,
    mm: dict[str, object] | None = None,
    padded: int = 0,
    tag_of: dict[str, str] | None = None,
    mm_key: str | None = None,
    mm_keys: Sequence[str] = (),
    hidden: bool = True,
    width: int = WIDTH,
) -> tuple[int, torch.Tensor]:
    """Save one step of ``(req, blocks, token_start, token_end)`` spans; rows are ``truth(tag)``.

    Returns (step id, the packed hidden rows). ``mm_key`` adds a per-token mm key
    whose rows are the hidden rows' first two columns times -1; each of ``mm_keys`` adds one
    whose rows are ``truth(req + key)``, 4 wide. ``hidden=False`` saves no hidden states (a
    policy that opts hidden out); ``width`` is the hidden rows' width.
    """
    tag_of = tag_of or {}
    rows = torch.cat([truth(tag_of.get(r, r), range(s, e), width) for r, _, s, e in spans])
    slot_ids = torch.cat([slots(b, s, e) for _, b, s, e in spans])
    n = rows.shape[0]
    states = rows
    if padded > n:
        states = torch.cat([rows, torch.full((padded - n, width), -7.0)])
    mm = dict(mm or {})
    if mm_key is not None:
        mm[mm_key] = -states[:, :2].clone()
    for key in mm_keys:
        mm[key] = torch.cat([truth(r + key, range(s, e), 4) for r, _, s, e in spans])
    layout = PrefixCacheWriteLayout.packed([(r, s, e) for r, _, s, e in spans], slot_ids)
    step = m.save_outputs(states if hidden else None, mm, num_tokens_unpadded=n,
                          num_tokens_padded=max(padded, n), write_layout=layout)
    return step, rows


def save_without_hidden(m: OmniPrefixCacheManager, req: str, blocks: Sequence[int], start: int, end: int,
                        mm: dict[str, object]) -> int:
    """Save one request's positions ``[start, end)`` with ``hidden_states=None`` (a policy that
    opts hidden out) and the mm outputs ``mm``; return the step id."""
    layout = PrefixCacheWriteLayout.packed([(req, start, end)], slots(blocks, start, end))
    n = end - start
    return m.save_outputs(None, mm, num_tokens_unpadded=n, num_tokens_padded=n, write_layout=layout)


def staging_claims(m: OmniPrefixCacheManager) -> int:
    """How many staging claims ``m`` made (a refused save must not have made one)."""
    return int(m.stats()["staging"]["claims"])


def settle(m: OmniPrefixCacheManager, timeout_s: float = 5.0) -> None:
    """Wait until no queued write is left and no staging page is still held by a write (async
    mode); deferred pending writes stay pending (they hold no page).

    The committer marks a write written and only then lets go of its staging page (I3), so a
    test that asserts slot states after a save waits for both, never for the scheduler's luck.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while [w for w in m.book.live() if w.state != "pending"] or any(s.num_write_holds for s in m.staging._slots):
        assert time.monotonic() < deadline, (
            f"writes never landed: {m.book.describe_in_flight()}; staging {m.staging.slot_states()}"
        )
        time.sleep(0.005)


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
    """Wait, bounded, until ``condition()`` holds: a state another thread reaches is waited for,
    never assumed after a fixed sleep (which a loaded machine outlasts)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never reached within {timeout_s}s: {what}"
        time.sleep(0.002)


def wait_for_waiter(owner: Any, what: str, baseline: int = 0) -> None:
    """Wait until more than ``baseline`` threads wait on ``owner``'s condition (a ``StagingPool``
    or a ``WriteBook``): the thread under test is really blocked in its wait, not on its way."""
    wait_until(lambda: owner._num_waiting > baseline, what)


def assert_waits_for_lock(lock: Any, call: Callable[[], object], what: str) -> None:
    """``call()`` on another thread does not finish while this thread holds ``lock`` (it takes
    the lock, I11), then finishes without an error once the lock is released."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        done.set()

    with lock:
        worker = threading.Thread(target=run)
        worker.start()
        assert not done.wait(0.2), f"{what} ran while another thread held the lock: it does not take the lock"
    assert done.wait(5) and not errors, errors
    worker.join()


def claimed_and_saved() -> tuple[StagingPool, object, object]:
    """A 3-page staging pool holding one saved page (step 1) and one claimed page: (pool, claimed, saved)."""
    pool = StagingPool(3, 4, 0.05)
    saved = pool.claim(2)
    pool.claimed_pages(saved, {"k": torch.ones(2, 3)})["k"].copy_(torch.ones(2, 3))
    pool.save(saved, 1, "engine.py:1")
    return pool, pool.claim(2), saved
