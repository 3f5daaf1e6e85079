"""Model-based test of the hidden-state tier on a real manager: store, evict, load, hit.

``TierMachine`` (tests/tier_machine.py) plays the engine and a KV connector against the real
``OmniPrefixCacheManager`` (eager and async) and ``TierApplier``: requests
compute a content into a block (a new tenant), finished blocks are stored under
their content's hash, the tier's LRU evicts under its byte budget (the model
mirrors the order), and a connector load puts a content into a *new* block that
the next step reads as a hit. Every hit is checked against the model: exactly
the rows stored for that content, or -- when the tier no longer holds it -- the
"is not readable" contract error, never zeros nor the rows of the block's
previous tenant (another content, still in the pool). The model keeps each
KV slot's rows (``None``: absent for its tenant) and the order of the write
that put them; a store of a block with an absent slot, or of a block its
tenant wrote only partly (a later slot holds an older write), stores nothing. Stores are of blocks whose content a request
computed or a load restored (as vLLM's ``request_finished`` reports them);
``store_unwritten`` tries the others. A fixed run reaches store, eviction, a
served load and a refused one deterministically. The rows a step hands the manager are on
``machine_device()`` (tests/cache_helpers.py: ``$OMNI_CACHE_TEST_DEVICE``, CPU by default); the
model's rows stay on the CPU.
"""

from __future__ import annotations

from hypothesis import settings
from tier_machine import TierMachine, TierMachineAsync

TestTierEager = TierMachine.TestCase
TestTierEager.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestTierAsync = TierMachineAsync.TestCase
TestTierAsync.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)


def test_one_fixed_run_reaches_store_evict_load_and_refusal() -> None:
    """The states the machine must reach, reached deterministically (not by a lucky seed)."""
    machine = TierMachine()
    machine.setup()
    for c, b in ((0, 0), (1, 1), (2, 2)):
        machine.compute(b, c)
        machine._store(b, c)  # the third store evicts content 0 (LRU, two entries)
    machine.load_and_hit(3, 4, 2)  # served from the tier into new block 3
    machine.load_and_hit(1, 4, 0)  # evicted: refused, never block 1's previous rows (content 1)
    machine.take_block(5)
    machine._store(5, 2)  # a block its tenant did not wholly write: nothing stored
    machine.tier_matches_the_model()
    assert (machine.stores, machine.evictions, machine.loads, machine.refusals, machine.skipped) == (3, 1, 2, 1, 1)
    machine.teardown()
