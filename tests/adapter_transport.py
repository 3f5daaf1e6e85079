"""The reference engine's steps delivered as vLLM scheduler outputs, through the adapter.

Owns: ``AdapterTransport``, which turns each ``PrefixCacheStep`` that tests/reference_model.py's
``Engine`` sends into the ``SchedulerOutput`` fields a vLLM scheduler would carry
(``scheduled_new_reqs`` for STARTED, ``scheduled_cached_reqs`` for EXTENDED and -- with
``resumed_req_ids`` -- RESUMED, ``finished_req_ids`` / ``aborted_req_ids``,
``prefix_cache_replacements`` for REPLACED controls, the owners and the step's sequence), lets a
real ``PrefixCacheSchedulerAdapter`` translate it, and hands the adapter's step to the manager.
The engine's ground truth then checks what the adapter made of it (I12, I13).

Knobs (set by the stateful machine between steps): ``numpy_sequence`` sends the sequence as
``np.int64``; ``refuse`` first sends a malformed copy of the next scheduler output, which the
adapter must refuse without changing its state, then the real one (a retry must never be taken
for a replay).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from omni_cache import (
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheSchedulerAdapter,
    PrefixCacheStep,
)

E = PrefixCacheEventKind
TERMINAL = (E.FINISHED, E.ABORTED)
REFUSALS = ("float_sequence", "str_sequence", "bad_count", "bad_entry", "bad_control")


def _groups(block_ids: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return [list(group) for group in block_ids]


class AdapterTransport:
    """``Engine.deliver`` through a real adapter (engine thread only)."""

    def __init__(self, manager: Any, engine: Any) -> None:
        self.m = manager
        self.engine = engine
        self.adapter = PrefixCacheSchedulerAdapter()
        self.numpy_sequence = False
        self.refuse: str | None = None
        self.refused = 0  # malformed scheduler outputs refused (and retried)
        self.same_step_controls = 0  # controls that arrived with their owner's first new request

    def scheduler_output(self, step: PrefixCacheStep) -> SimpleNamespace:
        """The vLLM scheduler output that carries ``step``'s events."""
        new: list[SimpleNamespace] = []
        cached: dict[str, list[Any]] = {"req_ids": [], "num_computed_tokens": [], "new_block_ids": []}
        resumed: set[str] = set()
        controls: list[PrefixCacheRequestEvent] = []
        owners: dict[str, Any] = {}
        ending: dict[str, PrefixCacheRequestEvent] = {}
        for e in step.events:
            if e.kind is E.REPLACED:
                controls.append(e)
                continue
            if e.kind in TERMINAL:  # one terminal per id and step: the newest owner's (older ones are stale)
                held = ending.get(e.req_id)
                if held is None or (e.owner is not None and (held.owner is None or held.owner < e.owner)):
                    ending[e.req_id] = e
                continue
            if e.owner is not None:
                owners[e.req_id] = e.owner
            if e.kind is E.STARTED:
                new.append(SimpleNamespace(req_id=e.req_id, num_computed_tokens=e.hit_end,
                                           block_ids=_groups(e.block_ids)))
                if any(c.req_id == e.req_id for c in controls):
                    self.same_step_controls += 1
            else:  # RESUMED (its hit on its new blocks) or EXTENDED (the tokens computed so far)
                cached["req_ids"].append(e.req_id)
                if e.kind is E.RESUMED:
                    resumed.add(e.req_id)
                    cached["num_computed_tokens"].append(e.hit_end)
                    cached["new_block_ids"].append(_groups(e.block_ids))
                else:
                    cached["num_computed_tokens"].append(self.engine.reqs[e.req_id].computed)
                    cached["new_block_ids"].append([])
        sequence = step.sequence
        return SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=resumed, num_output_tokens=[], **cached),
            num_scheduled_tokens=dict(step.scheduled_tokens),
            finished_req_ids=set(ending),
            aborted_req_ids={r for r, e in ending.items() if e.kind is E.ABORTED},
            prefix_cache_replacements=controls,
            prefix_cache_owners=owners,
            prefix_cache_terminal_owners={r: e.owner for r, e in ending.items() if e.owner is not None},
            prefix_cache_step_sequence=np.int64(sequence) if self.numpy_sequence and sequence is not None else sequence,
        )

    def _malformed(self, so: SimpleNamespace, how: str) -> SimpleNamespace:
        bad = copy.copy(so)
        sequence = int(so.prefix_cache_step_sequence or 0)
        if how == "float_sequence":
            bad.prefix_cache_step_sequence = float(sequence)
        elif how == "str_sequence":
            bad.prefix_cache_step_sequence = str(sequence)
        elif how == "bad_count":
            bad.num_scheduled_tokens = {**so.num_scheduled_tokens, "ghost": "x"}
        elif how == "bad_entry":  # after the controls were accepted: a translation refused midway
            bad.scheduled_new_reqs = [*so.scheduled_new_reqs, SimpleNamespace(num_computed_tokens=0)]
        else:
            bad.prefix_cache_replacements = [*so.prefix_cache_replacements,
                                             PrefixCacheRequestEvent("ghost", E.FINISHED)]
        return bad

    def _state(self) -> tuple[Any, ...]:
        a = self.adapter
        return a.live_req_ids, a.preempted_req_ids, dict(a._owners), dict(getattr(a, "_controls", {})), a._last_sequence

    def deliver(self, step: PrefixCacheStep) -> None:
        so = self.scheduler_output(step)
        last = self.adapter._last_sequence
        replay = step.sequence is not None and last is not None and step.sequence <= last
        # A replay is answered before its content is read: only a malformed sequence is refused then.
        if self.refuse is not None and (not replay or self.refuse.endswith("_sequence")):
            how, self.refuse = self.refuse, None
            before = self._state()
            with pytest.raises((TypeError, ValueError)):
                self.adapter.translate_step(self._malformed(so, how))
            assert self._state() == before, f"a refused scheduler output ({how}) changed the adapter"
            self.refused += 1
        self.m.new_step_starts(self.adapter.translate_step(so))
