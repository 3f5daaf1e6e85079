"""The hidden-state tier's model-based machine, shared by the tests that run it.

Owns: ``TierMachine`` (eager) and ``TierMachineAsync``: the engine and a KV connector played
against the real ``OmniPrefixCacheManager`` and ``TierApplier``, every hit checked against a
model of the tier (described in tests/tier/test_tier_stateful.py, which runs them);
tests/project/test_machine_device.py checks where its tensors live.

Invariants touched: I6, I7 (a hit reads its tenant's rows or is refused), through the tier.
"""

from __future__ import annotations

from collections import OrderedDict

import hypothesis.strategies as st
import pytest
import torch
from cache_helpers import BS, WIDTH, config, finished, machine_device, settle, slot_of, slots, started, truth
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omni_cache import PrefixCacheWriteLayout
from omni_cache.integration.tier_apply import TierApplier, TierLoad, TierPlan, TierStore
from omni_cache.runtime.errors import OmniPrefixCacheUnmatchError
from omni_cache.runtime.manager import OmniPrefixCacheManager
from omni_cache.runtime.tier import HiddenTier

NUM_BLOCKS = 6
CONTENTS = 3
CAP = 2  # tier entries the budget holds
ENTRY = BS * WIDTH * 4 + BS * 2 * 4  # hidden + audio.codes rows of one block, fp32


def _hash(c: int) -> bytes:
    return f"content-{c}".encode()


class TierMachine(RuleBasedStateMachine):
    eager = True

    @initialize()
    def setup(self) -> None:
        self.m = OmniPrefixCacheManager(config(num_blocks=NUM_BLOCKS), eager=self.eager)
        self.device = machine_device()  # where the step rows handed to the manager live
        self.applier = TierApplier(HiddenTier(CAP * ENTRY), BS)
        self.n = 0
        self.live: list[str] = []
        self.rows: dict[int, torch.Tensor | None] = dict.fromkeys(range(NUM_BLOCKS * BS))  # per KV slot
        self.ver: dict[int, int] = dict.fromkeys(range(NUM_BLOCKS * BS), 0)  # per KV slot: its write's order
        self.clock = 0
        self.content: dict[int, int | None] = dict.fromkeys(range(NUM_BLOCKS))  # block -> content it holds
        self.tier: OrderedDict[int, torch.Tensor] = OrderedDict()  # content -> rows, LRU first
        self.stores = self.evictions = self.loads = self.refusals = self.skipped = 0

    def _events(self, *more):  # finish last step's requests with this step's events
        done, self.live = self.live, []
        return [finished(r) for r in done] + list(more)

    def _save(self, req: str, blocks: list[int], start: int, end: int, rows: torch.Tensor) -> int:
        layout = PrefixCacheWriteLayout.packed([(req, start, end)], slots(blocks, start, end))
        n = end - start
        dev_rows = rows.to(self.device)
        step = self.m.save_outputs(dev_rows, {"audio.codes": -dev_rows[:, :2].clone()}, num_tokens_unpadded=n,
                                   num_tokens_padded=n, write_layout=layout)
        self.clock += 1
        for i, slot in enumerate(slots(blocks, start, end).tolist()):
            self.rows[slot] = rows[i]
            self.ver[slot] = self.clock
        return step

    def _block_rows(self, b: int) -> torch.Tensor | None:
        got = [self.rows[slot_of([b], i)] for i in range(BS)]
        vers = [self.ver[slot_of([b], i)] for i in range(BS)]
        if any(r is None for r in got) or vers != sorted(vers):  # absent, or written only partly by its tenant
            return None
        return torch.stack(got)  # type: ignore[arg-type]

    @rule(b=st.integers(0, NUM_BLOCKS - 1), c=st.integers(0, CONTENTS - 1))
    def compute(self, b: int, c: int) -> None:
        self.n += 1
        req = f"r{self.n}"
        self.m.new_step_starts(self._events(started(req)))
        self.m.materialize(self._save(req, [b], 0, BS, truth(f"{c}/{self.n}", range(BS))), [req])
        self.live.append(req)
        self.content[b] = c

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def take_block(self, b: int) -> None:
        """A new tenant writes only the block's first row (a request of one token)."""
        self.n += 1
        req = f"r{self.n}"
        self.m.new_step_starts(self._events(started(req)))
        self.m.materialize(self._save(req, [b], 0, 1, truth(f"partial/{self.n}", range(1))), [req])
        self.live.append(req)
        self.content[b] = None

    def _put(self, c: int, rows: torch.Tensor) -> None:
        self.tier.pop(c, None)
        self.tier[c] = rows
        while len(self.tier) > CAP:
            self.tier.popitem(last=False)
            self.evictions += 1

    def _store(self, b: int, c: int) -> None:
        self.m.new_step_starts(self._events())
        settle(self.m)
        skipped = self.applier.store_skipped
        self.applier.apply(TierPlan(stores=(TierStore("done", _hash(c), b),)), self.m)
        held = self._block_rows(b)
        if held is None:
            assert self.applier.store_skipped == skipped + 1
            self.skipped += 1
        else:
            self._put(c, held)
            self.stores += 1

    @precondition(lambda self: any(c is not None for c in self.content.values()))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(k for k, c in self.content.items() if c is not None)))
        self._store(b, self.content[b])  # type: ignore[arg-type]

    @precondition(lambda self: any(c is None for c in self.content.values()))
    @rule(data=st.data(), c=st.integers(0, CONTENTS - 1))
    def store_unwritten(self, data: st.DataObject, c: int) -> None:
        self._store(data.draw(st.sampled_from(sorted(k for k, v in self.content.items() if v is None))), c)

    @rule(dst=st.integers(0, NUM_BLOCKS - 1), extra=st.integers(0, NUM_BLOCKS - 1), c=st.integers(0, CONTENTS - 1))
    def load_and_hit(self, dst: int, extra: int, c: int) -> None:
        if dst == extra:
            extra = (dst + 1) % NUM_BLOCKS
        self.n += 1
        req = f"r{self.n}"
        self.m.new_step_starts(self._events())
        failures = self.applier.num_load_failures
        self.applier.apply(TierPlan(loads=(TierLoad(req, 0, _hash(c), dst),)), self.m)
        expected = self.tier.get(c)
        if expected is not None:
            self.tier.move_to_end(c)
        assert self.applier.num_load_failures == failures + (expected is None)
        self.clock += 1
        for i in range(BS):
            self.rows[slot_of([dst], i)] = None if expected is None else expected[i]
            self.ver[slot_of([dst], i)] = self.clock
        self.loads += 1
        self.m.new_step_starts([started(req, hit_end=BS, blocks=[dst, extra])])
        new_row = truth(f"tail/{self.n}", range(BS, BS + 1))
        step = self._save(req, [dst, extra], BS, BS + 1, new_row)
        self.live.append(req)
        self.content[extra] = None
        self.content[dst] = None if expected is None else c
        if expected is None:
            with pytest.raises(OmniPrefixCacheUnmatchError, match="is not readable"):
                self.m.materialize(step, [req])
            self.refusals += 1
            return
        out = self.m.materialize(step, [req])
        assert torch.equal(out.hidden_states[req], torch.cat([expected, new_row]))
        assert torch.equal(out.mm_outputs["audio.codes"][req][:BS], -expected[:, :2])

    @invariant()
    def tier_matches_the_model(self) -> None:
        if not hasattr(self, "m"):
            return
        stats = self.applier.tier.stats()
        assert stats.entries == len(self.tier) and stats.evictions == self.evictions
        assert stats.bytes == len(self.tier) * ENTRY

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.m.new_step_starts(self._events())
            assert self.m.shutdown() == {}


class TierMachineAsync(TierMachine):
    eager = False
