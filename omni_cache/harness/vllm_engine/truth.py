"""Ground truth of a real vLLM run, captured from the forward, and check (a).

Owns: ``derive_mm`` (the per-token mm keys and the leftover value a stand-in
thinker derives from each hidden row), ``ForwardCapture`` (the observer the
runner bridge calls after every real forward: it copies each computed row by
the engine's own slot mapping, positions and token ids, never through the
cache) and ``ForwardCapture.check_step`` (check (a): every row the cache
served for a step equals, bit for bit, the row the forward produced for that
request's token at that position when it was computed).

A served hit row is looked up by the KV slot the engine's block table gives
for the position, as the latest capture of that slot at or before the step;
the capture must also belong to the same token prefix (rolling hash of the
request's tokens up to the position), so a row of another prompt is caught
even if its bits happen to match. Upholds nothing itself: it checks I4, I6,
I7 from outside.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from omni_cache.harness.sim_engine.checker import Mismatch
from omni_cache.integration.vllm_bridge import ForwardRecord
from omni_cache.runtime.interface import StageCacheOutputs, mm_of_request

__all__ = ["DEFERRED_KEY", "IMMEDIATE_KEY", "LEFTOVER_KEY", "ForwardCapture", "derive_mm", "mm_of"]

IMMEDIATE_KEY = "audio.codes"
DEFERRED_KEY = "audio.embeds"
LEFTOVER_KEY = "meta.num_rows"
PER_TOKEN_KEYS = (IMMEDIATE_KEY, DEFERRED_KEY)


def derive_mm(hidden: torch.Tensor) -> dict[str, Any]:
    """Per-token keys from each hidden row (elementwise, so bit-exact per row)
    and one leftover value (a 1-D tensor: not token-major)."""
    return {
        IMMEDIATE_KEY: hidden[:, :8] * 2.0 + 1.0,
        DEFERRED_KEY: -hidden[:, -16:].flip(-1),
        LEFTOVER_KEY: torch.tensor([hidden.shape[0]], dtype=torch.int64),
    }


def mm_of(outputs: StageCacheOutputs, req_id: str) -> dict[str, Any]:
    """One request's mm values (through the interface's one accessor)."""
    return mm_of_request(outputs.mm_outputs, req_id)


def _fresh_ids(so: Any) -> set[str]:
    """Ids whose first output must start at position 0: new (or back through
    ``scheduled_new_reqs``) or resumed this step."""
    fresh = {getattr(r, "req_id", None) for r in (getattr(so, "scheduled_new_reqs", None) or ())}
    cached = getattr(so, "scheduled_cached_reqs", None)
    fresh |= set(getattr(cached, "resumed_req_ids", None) or ())
    return {r for r in fresh if r is not None}


@dataclass
class _Capture:
    engine_step: int
    prefix: int
    hidden: torch.Tensor
    mm: dict[str, torch.Tensor]


@dataclass
class _StepRows:
    start: int
    end: int
    fresh: bool
    blocks: tuple[int, ...]
    hidden: torch.Tensor
    mm: dict[str, torch.Tensor]
    leftover: torch.Tensor


class ForwardCapture:
    """The bridge's observer (engine thread) and the checker (consumer thread)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self._hash: dict[str, list[int]] = defaultdict(list)
        self._slots: dict[int, list[_Capture]] = defaultdict(list)
        self._steps: dict[tuple[str, int], _StepRows] = {}
        self.mismatches: list[Mismatch] = []
        self.rows_captured = 0
        self.rows_verified = 0
        self.served_from_cache = 0
        self.same_step_hits = 0
        self.hit_tokens = 0
        self.chunked_prefills = 0
        self.prompt_rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)  # served, by check_step
        self.forward_rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)  # computed, by observe

    def register_prompt(self, req_id: str, prompt: list[int] | tuple[int, ...]) -> None:
        with self._lock:
            self.tokens[req_id] = list(prompt)
            self.prompt_len[req_id] = len(prompt)
            self._hash[req_id] = []

    def _prefix_hash(self, req_id: str, pos: int) -> int:
        hashes, tokens = self._hash[req_id], self.tokens[req_id]
        while len(hashes) <= pos:
            prev = hashes[-1] if hashes else 0
            hashes.append(hash((prev, tokens[len(hashes)])))
        return hashes[pos]

    def place(self, slot: int, engine_step: int, cap: _Capture) -> None:
        """Slot ``slot`` holds ``cap``'s row from ``engine_step`` on (a row restored into a new KV
        slot, as the hidden-state tier does: the later check of a hit on it expects ``cap``)."""
        with self._lock:
            self._slots[int(slot)].append(_Capture(engine_step, cap.prefix, cap.hidden, cap.mm))

    def latest(self, slot: int) -> _Capture | None:
        """The newest row captured (or placed) at ``slot``."""
        with self._lock:
            caps = self._slots.get(int(slot))
            return caps[-1] if caps else None

    # ------------------------------------------------------------ engine thread
    def observe(self, rec: ForwardRecord) -> None:
        so = rec.scheduler_output
        fresh = _fresh_ids(so) | rec.resumed  # resumed by the cache after a failed KV load too
        with self._lock:
            for r in getattr(so, "scheduled_new_reqs", None) or ():
                self.hit_tokens += int(r.num_computed_tokens)
            cached = getattr(so, "scheduled_cached_reqs", None)
            for rid, n in zip(getattr(cached, "req_ids", ()) or (), getattr(cached, "num_computed_tokens", ()) or (),
                              strict=False):
                if rid in set(getattr(cached, "resumed_req_ids", None) or ()):
                    self.hit_tokens += int(n)
            row = 0
            for rid, start, end in rec.spans:
                n = end - start
                pos = rec.positions[row : row + n].tolist()
                if pos != list(range(start, end)):
                    self._fail(rec.engine_step, rid, None, start,
                               f"engine positions {pos[:4]}... differ from the span [{start}, {end})")
                self._feed_tokens(rec.engine_step, rid, start, rec.input_ids[row : row + n].tolist())
                hidden = rec.hidden_states[row : row + n].detach().clone()
                for p in range(start, min(end, self.prompt_len.get(rid, 0))):
                    self.forward_rows[rid][p] = hidden[p - start]
                mm = {k: rec.mm_outputs[k][row : row + n].detach().clone() for k in PER_TOKEN_KEYS}
                for i, slot in enumerate(rec.slot_mapping[row : row + n].tolist()):
                    cap = _Capture(rec.engine_step, self._prefix_hash(rid, start + i), hidden[i],
                                   {k: v[i] for k, v in mm.items()})
                    self._slots[int(slot)].append(cap)
                if rid not in fresh and start > 0 and n > 1:
                    self.chunked_prefills += 1
                self._steps[(rid, rec.engine_step)] = _StepRows(
                    start, end, rid in fresh, rec.block_ids[rid], hidden, mm,
                    rec.mm_outputs[LEFTOVER_KEY].detach().clone())
                self.rows_captured += n
                row += n
            for rid, start, _ in rec.spans:  # hits on blocks another request computed in this forward
                prefix_blocks = rec.block_ids[rid][: start // self.block_size] if rid in fresh else ()
                if any(self._slots[b * self.block_size][-1].engine_step == rec.engine_step
                       for b in prefix_blocks if self._slots.get(b * self.block_size)):
                    self.same_step_hits += 1

    def _feed_tokens(self, engine_step: int, rid: str, start: int, inputs: list[int]) -> None:
        """The request's tokens at positions ``[start, start + len(inputs))`` as the forward fed them
        (engine thread, lock held): a known position must keep its token, a new one extends them."""
        toks = self.tokens.setdefault(rid, [])
        for p, tok in enumerate(inputs, start):
            if p < len(toks):
                if toks[p] != tok:
                    self._fail(engine_step, rid, None, p, f"engine fed token {tok}, expected {toks[p]}")
            elif p == len(toks):
                toks.append(tok)
            else:
                self._fail(engine_step, rid, None, p, f"gap in the request's tokens ({len(toks)})")

    def _keep_served(self, rid: str, engine_step: int, p: int, row: torch.Tensor, own: bool) -> None:
        """A served row checked bit for bit (consumer thread, lock held): prompt rows are kept for
        check (b); ``own``: the step's own row, not a hit's."""
        if p < self.prompt_len.get(rid, 0):
            self.prompt_rows[rid][p] = row.detach().clone()

    def _fail(self, step: int | None, rid: str | None, key: str | None, pos: int | None, detail: str,
              step_id: int | None = None) -> None:
        self.mismatches.append(Mismatch(step, step_id, rid, key, pos, detail))

    # ------------------------------------------------------------ consumer thread
    def check_step(self, engine_step: int, step_id: int, spans: tuple[tuple[str, int, int], ...],
                   out: StageCacheOutputs) -> None:
        """Check (a) on one materialized step (every request, every key, every row)."""
        with self._lock:
            for rid, start, end in spans:
                rows = self._steps.pop((rid, engine_step), None)
                if rows is None:
                    self._fail(engine_step, rid, None, None, "no capture for this request's forward", step_id)
                    continue
                served = (out.hidden_states or {}).get(rid)
                mm = mm_of(out, rid)
                if served is None:
                    self._fail(engine_step, rid, "hidden", None, "no hidden rows served", step_id)
                    continue
                expect_len = end if rows.fresh else end - start
                if served.shape[0] != expect_len:
                    self._fail(engine_step, rid, "hidden", None,
                               f"served {served.shape[0]} rows, expected {expect_len} (positions "
                               f"[{end - expect_len}, {end}); {'new or resumed' if rows.fresh else 'running'} "
                               f"request with {start} tokens computed before this step)", step_id)
                    continue
                first = end - expect_len
                left = mm.get(LEFTOVER_KEY)
                if left is None or not torch.equal(left, rows.leftover):
                    self._fail(engine_step, rid, LEFTOVER_KEY, None, f"leftover {left!r} != {rows.leftover!r}", step_id)
                for key in PER_TOKEN_KEYS:
                    if key not in mm or mm[key].shape[0] != expect_len:
                        self._fail(engine_step, rid, key, None, "per-token rows missing or mis-sized", step_id)
                for p in range(first, end):
                    i = p - first
                    if p < start:
                        slot = rows.blocks[p // self.block_size] * self.block_size + p % self.block_size
                        caps = [c for c in self._slots.get(slot, []) if c.engine_step <= engine_step]
                        if not caps:
                            self._fail(engine_step, rid, "hidden", p, f"served a hit row for KV slot {slot}, "
                                       "which no forward ever computed", step_id)
                            continue
                        cap = caps[-1]
                        if cap.prefix != self._prefix_hash(rid, p):
                            self._fail(engine_step, rid, "hidden", p, f"KV slot {slot} holds a row of another "
                                       f"token prefix (computed at step {cap.engine_step})", step_id)
                            continue
                        want_h, want_mm = cap.hidden, cap.mm
                        self.served_from_cache += 1
                    else:
                        want_h, want_mm = rows.hidden[p - start], {k: v[p - start] for k, v in rows.mm.items()}
                    if not torch.equal(served[i], want_h):
                        diff = (served[i].float() - want_h.float()).abs().max().item()
                        self._fail(engine_step, rid, "hidden", p, f"row differs from the forward's (max |diff| "
                                   f"{diff:.3g}){' [hit]' if p < start else ''}", step_id)
                        continue
                    for key in PER_TOKEN_KEYS:
                        if key in mm and mm[key].shape[0] == expect_len and not torch.equal(mm[key][i], want_mm[key]):
                            self._fail(engine_step, rid, key, p, "row differs from the forward's", step_id)
                    self.rows_verified += 1 + len(PER_TOKEN_KEYS)
                    self._keep_served(rid, engine_step, p, served[i], p >= start)
