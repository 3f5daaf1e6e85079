"""Verification of every output the cache hands to the next stage.

Owns: ``StepExpectation`` (what the engine knows a step's materialize must
return), ``Mismatch`` (one finding, naming step, request, key and position),
``OutputChecker`` (row-exact comparison of a ``StageCacheOutputs`` against
``truth.TruthSpec``) and ``Talker`` (the next stage: accumulates each
request's hidden rows and checks at finish that positions ``[0, n)`` were
delivered exactly once and equal the ground truth).

Checks, per request of a step: hidden and per-token mm rows cover exactly
``[out_start, token_end)`` (``out_start`` is 0 on the first step after a
STARTED/RESUMED, else the step's ``token_start``), with the right dtype and
shape, and every row equals the truth (I6 no silent miss / zeros, I7 no stale
tenant, I4 snapshot: the thinker's buffers have moved on by then); leftovers
equal the step's own value; no unexpected keys.

Upholds nothing itself: it checks I4, I6 and I7 from outside.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.harness.sim_engine.truth import TruthSpec
from omni_cache.runtime.interface import HIDDEN_KEY, StageCacheOutputs, TensorName, mm_of_request


@dataclass(frozen=True)
class ReqExpectation:
    req_id: str
    hashes: list[int]
    """The request's truth hashes (append-only; positions < token_end are fixed)."""
    token_start: int
    token_end: int
    out_start: int
    """First position materialize must return: 0 after a hit/restart, else token_start."""


@dataclass
class StepExpectation:
    """What the builder must check for one step (or only notices, if no save)."""

    step: int
    step_id: int | None
    reqs: list[ReqExpectation] = field(default_factory=list)
    leftovers: dict[TensorName, Any] = field(default_factory=dict)
    finished: list[tuple[str, list[int], int]] = field(default_factory=list)
    """(req_id, truth hashes, number of computed positions) of requests finished at this step."""
    aborted: list[str] = field(default_factory=list)
    enqueued_at: float = field(default_factory=time.perf_counter)

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.reqs]


@dataclass(frozen=True)
class Mismatch:
    """One verification failure or contract error."""

    step: int | None
    step_id: int | None
    req_id: str | None
    key: TensorName | None
    position: int | None
    detail: str

    def __str__(self) -> str:
        parts = [f"step {self.step}" + (f" (step id {self.step_id})" if self.step_id is not None else "")]
        if self.req_id is not None:
            parts.append(f"request {self.req_id}")
        if self.key is not None:
            parts.append(f"key {self.key!r}")
        if self.position is not None:
            parts.append(f"position {self.position}")
        return ", ".join(parts) + f": {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "step_id": self.step_id,
            "request": self.req_id,
            "key": self.key,
            "position": self.position,
            "detail": self.detail,
        }


def _first_bad_row(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """Index of the first row where ``got`` differs from ``want`` (same shape)."""
    diff = (got != want).reshape(got.shape[0], -1).any(dim=1)
    bad = torch.nonzero(diff)
    return int(bad[0]) if bad.numel() else None


def _same_value(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and got.dtype == want.dtype
            and bool(torch.equal(got.cpu(), want))
        )
    return type(got) is type(want) and got == want


class OutputChecker:
    """Compares materialize results with the ground truth; thread-safe counters."""

    def __init__(self, spec: TruthSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self.mismatches: list[Mismatch] = []
        self.rows_checked = 0
        self.rows_from_cache = 0

    def record(self, mismatch: Mismatch) -> None:
        with self._lock:
            self.mismatches.append(mismatch)

    def check_rows(
        self, exp: StepExpectation, req: ReqExpectation, key: TensorName, got: Any
    ) -> Mismatch | None:
        """Rows of ``key`` for ``req``: type, shape, dtype, then every value."""
        span = f"[{req.out_start}, {req.token_end})"
        if not isinstance(got, torch.Tensor):
            return Mismatch(exp.step, exp.step_id, req.req_id, key, None, f"expected a tensor of positions {span}, got {type(got).__name__}")
        shape = (req.token_end - req.out_start, *self.spec.row_shape(key))
        if tuple(got.shape) != shape:
            return Mismatch(
                exp.step, exp.step_id, req.req_id, key, None,
                f"expected shape {shape} (positions {span}), got {tuple(got.shape)}",
            )
        dtype = self.spec.key_dtype(key)
        if got.dtype != dtype:
            return Mismatch(exp.step, exp.step_id, req.req_id, key, None, f"expected dtype {dtype}, got {got.dtype}")
        want = self.spec.rows(key, req.hashes[req.out_start:req.token_end])
        bad = _first_bad_row(got.cpu(), want)
        if bad is not None:
            pos = req.out_start + bad
            how = "zeros (a silent miss)" if not bool(got[bad].any()) else "another prefix's row"
            src = "cached prefix" if pos < req.token_start else "this step"
            return Mismatch(exp.step, exp.step_id, req.req_id, key, pos, f"row differs from the ground truth ({how}; {src} row)")
        return None

    def check_step(self, exp: StepExpectation, out: Any) -> list[Mismatch]:
        """Every request of the step; returns (and records) the mismatches."""
        found: list[Mismatch] = []
        if not isinstance(out, StageCacheOutputs) and not (isinstance(out, tuple) and len(out) == 2):
            found.append(Mismatch(exp.step, exp.step_id, None, None, None, f"materialize returned {type(out).__name__}"))
        else:
            hidden, mm = out[0], out[1]
            rows = cached = 0
            for req in exp.reqs:
                got_h = None if hidden is None else hidden.get(req.req_id)
                m = self.check_rows(exp, req, HIDDEN_KEY, got_h)
                if m is not None:
                    found.append(m)
                if not isinstance(mm, dict) or not all(isinstance(v, dict) for v in mm.values()):
                    found.append(Mismatch(exp.step, exp.step_id, req.req_id, None, None,
                                          "mm outputs are not key-major mm[key][req]"))
                    continue
                req_mm = mm_of_request(mm, req.req_id)
                if not req_mm and len(self.spec.per_token_keys) > 1:
                    found.append(Mismatch(exp.step, exp.step_id, req.req_id, None, None, "no mm outputs for the request"))
                    continue
                for key in self.spec.per_token_keys[1:]:
                    m = self.check_rows(exp, req, key, req_mm.get(key))
                    if m is not None:
                        found.append(m)
                for key, want in exp.leftovers.items():
                    if not _same_value(req_mm.get(key), want):
                        found.append(Mismatch(
                            exp.step, exp.step_id, req.req_id, key, None,
                            f"leftover value {req_mm.get(key)!r} is not this step's {want!r}",
                        ))
                extra = set(req_mm) - set(self.spec.per_token_keys) - set(exp.leftovers)
                if extra:
                    found.append(Mismatch(exp.step, exp.step_id, req.req_id, sorted(extra)[0], None, f"unexpected keys {sorted(extra)}"))
                rows += req.token_end - req.out_start
                cached += req.token_start - req.out_start
            with self._lock:
                self.rows_checked += rows
                self.rows_from_cache += cached
        for m in found:
            self.record(m)
        return found


class Talker:
    """The next stage: per request, the hidden rows delivered so far."""

    def __init__(self, spec: TruthSpec) -> None:
        self.spec = spec
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._next: dict[str, int] = {}
        self.completed = 0

    def receive(self, step: int, req: ReqExpectation, rows: torch.Tensor) -> Mismatch | None:
        """Accept rows starting at ``req.out_start``; a restart drops earlier rows."""
        if req.out_start == 0:
            self._rows[req.req_id] = []
            self._next[req.req_id] = 0
        expected = self._next.get(req.req_id, 0)
        if req.out_start != expected:
            return Mismatch(step, None, req.req_id, HIDDEN_KEY, expected, f"talker expected position {expected} next, got {req.out_start}")
        self._rows.setdefault(req.req_id, []).append(rows.cpu())
        self._next[req.req_id] = expected + rows.shape[0]
        return None

    def finish(self, step: int, req_id: str, hashes: list[int], num_positions: int) -> Mismatch | None:
        """The full sequence ``[0, num_positions)`` was seen exactly once and is right."""
        parts = self._rows.pop(req_id, [])
        self._next.pop(req_id, None)
        got = torch.cat(parts) if parts else torch.empty((0, self.spec.hidden_width), dtype=self.spec.torch_dtype)
        if got.shape[0] != num_positions:
            return Mismatch(step, None, req_id, HIDDEN_KEY, got.shape[0], f"talker saw {got.shape[0]} positions at finish, expected {num_positions}")
        bad = _first_bad_row(got, self.spec.rows(HIDDEN_KEY, hashes[:num_positions]))
        if bad is not None:
            return Mismatch(step, None, req_id, HIDDEN_KEY, bad, "talker's accumulated sequence differs from the ground truth")
        self.completed += 1
        return None

    def abort(self, req_id: str) -> None:
        self._rows.pop(req_id, None)
        self._next.pop(req_id, None)
